"""KVOutputMerger: the tensor-parallel ranks' KV connector reports of each step, as one.

Every rank runs its own worker-side connector over its shard of the caches, so each reports
on its own shard: a request's blocks are sent (or loaded) only once every rank has reported
them so, and a block failed to load if it failed on any rank (its tokens are computed on all
of them, since a step's attention spans every rank's heads). Ranks may report a request in
different steps (a slower rank's pull finishes later), so counts are kept across steps. The
rule is vLLM's (KVOutputAggregator).
"""

from __future__ import annotations

from typing import Sequence

from kvgraph.kv_transfer import KVConnectorOutput


class KVOutputMerger:
    """Merges each step's reports of `world_size` ranks (see the module docstring)."""

    def __init__(self, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size: expected at least 1 rank, got {world_size}")
        self.world_size = world_size
        self._sending: dict[str, int] = {}  # request -> ranks yet to report it sent
        self._recving: dict[str, int] = {}  # request -> ranks yet to report it loaded

    def merge(self, outputs: Sequence[KVConnectorOutput]) -> KVConnectorOutput:
        """One step's report from every rank's (one each, by rank): the requests the last of
        the ranks finished this step, and the blocks any rank failed to load."""
        if len(outputs) != self.world_size:
            raise ValueError(f"expected one KV connector report per rank ({self.world_size}), "
                             f"got {len(outputs)}")
        return KVConnectorOutput(
            self._count_down(self._sending, [o.finished_sending for o in outputs]),
            self._count_down(self._recving, [o.finished_recving for o in outputs]),
            set().union(*(o.invalid_block_ids for o in outputs)))

    def _count_down(self, remaining: dict[str, int], reports: list[set[str]]) -> set[str]:
        """The requests whose last rank reported them now."""
        done = set()
        for report in reports:
            for request_id in report:
                left = remaining.get(request_id, self.world_size) - 1
                if left:
                    remaining[request_id] = left
                else:
                    remaining.pop(request_id, None)
                    done.add(request_id)
        return done

