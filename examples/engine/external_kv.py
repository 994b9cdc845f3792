"""ExternalKV: the scheduler's side of a KV connector (kvgraph.kv_transfer).

At admission the connector is asked how many tokens after the prefix cache's it can supply.
Loaded in the step (synchronously), they count as computed at once; loaded asynchronously, the
request is parked, holding its blocks, while other requests' steps go on, and runs once the
workers report its load finished. A load that fails is reported by block: the request's tokens
from its first failed block on are computed instead (never served from it). When a request
ends, the connector may keep its blocks held until they are sent; a request aborted while its
blocks load keeps them held until the load is done (a loader still writes them).
"""

from __future__ import annotations

from typing import Sequence

from kvgraph.kv_transfer import KVConnectorBase, KVConnectorMetadata, KVConnectorOutput

from .block_allocator import BlockAllocator
from .request import Request


class ExternalKV:
    """One scheduler's use of `connector` (its scheduler role) over `allocator`'s blocks."""

    def __init__(self, connector: KVConnectorBase, allocator: BlockAllocator, block_size: int):
        self.connector = connector
        self.allocator = allocator
        self.block_size = block_size
        self.loading: dict[str, tuple[Request, int]] = {}  # parked: the request, its tokens
        self.held: dict[str, list[int]] = {}  # blocks of requests gone, until reported done
        self.num_loaded_tokens = 0  # admitted as supplied by the connector, failures taken off
        self.num_failed_blocks = 0

    @property
    def has_work(self) -> bool:
        """Whether the engine must step without requests: loads under way, blocks held for a
        send, or something the connector has for its workers."""
        return bool(self.loading or self.held or self.connector.has_pending_work())

    def matched(self, request: Request) -> tuple[int, bool]:
        """Tokens after `request`'s computed ones the connector can supply, and whether it loads
        them asynchronously. (A connector's None, "ask later", is taken as none now.)"""
        tokens, load_async = self.connector.get_num_new_matched_tokens(
            request, request.num_computed_tokens)
        return tokens or 0, bool(load_async and tokens)

    def allocated(self, request: Request, num_external_tokens: int) -> None:
        """`request` holds the blocks for its external tokens (and its first chunk)."""
        self.connector.update_state_after_alloc(request, request.block_ids, num_external_tokens)
        self.num_loaded_tokens += num_external_tokens

    def park(self, request: Request, num_external_tokens: int) -> None:
        self.loading[request.request_id] = (request, num_external_tokens)

    def metadata(self, chunks: Sequence) -> KVConnectorMetadata:
        """The workers' metadata for a step running `chunks` (once per step, even an empty one:
        it carries the loads just admitted)."""
        return self.connector.build_connector_meta(chunks)

    def loaded_tokens(self, request: Request, first_token: int, num_tokens: int,
                      failed_blocks: set[int]) -> int:
        """Of the `num_tokens` loaded into `request` from its `first_token` on (block-aligned;
        the last block may be partial), those before its first failed block (all of them when
        none failed)."""
        first = first_token // self.block_size
        blocks = request.block_ids[first:-(-(first_token + num_tokens) // self.block_size)]
        good = next((i for i, b in enumerate(blocks) if b in failed_blocks), len(blocks))
        kept = min(num_tokens, good * self.block_size)
        self.num_loaded_tokens -= num_tokens - kept
        self.num_failed_blocks += len(blocks) - good
        if request.num_cached_tokens is not None:
            request.num_cached_tokens -= num_tokens - kept
        return kept

    def rolled_back(self, request: Request, failed_blocks: set[int]) -> bool:
        """Whether `request` holds a block that failed to load in this step; if so its computed
        tokens are cut back to that block (the step's result for it is discarded)."""
        first_failed = next((i for i, b in enumerate(request.block_ids) if b in failed_blocks),
                            None)
        if first_failed is None:
            return False
        keep = first_failed * self.block_size
        lost = request.num_computed_tokens - keep
        self.num_loaded_tokens -= lost
        self.num_failed_blocks += -(-lost // self.block_size)
        if request.num_cached_tokens is not None:
            request.num_cached_tokens = max(0, request.num_cached_tokens - lost)
        request.num_computed_tokens = keep
        return True

    def update(self, output: KVConnectorOutput) -> list[Request]:
        """Apply the workers' report: the parked requests whose loads are done, their loaded
        tokens now computed (up to a failed block), to run; the held blocks reported done, freed."""
        self.connector.update_connector_output(output)
        ready = []
        for request_id in output.finished_recving:
            if request_id in self.held and request_id not in self.loading:
                self.allocator.free(self.held.pop(request_id))  # aborted while loading
                continue
            request, num_tokens = self.loading.pop(request_id, (None, 0))
            if request is None:
                continue
            request.num_computed_tokens += self.loaded_tokens(
                request, request.num_computed_tokens, num_tokens, output.invalid_block_ids)
            ready.append(request)
        for request_id in output.finished_sending:
            if request_id in self.held:
                self.allocator.free(self.held.pop(request_id))
        return ready

    def finished(self, request: Request) -> bool:
        """`request` left (finished, aborted or failed): whether its blocks stay held (the
        caller then must not free them); the connector is told either way."""
        parked = self.loading.pop(request.request_id, None) is not None
        delay_free, request.kv_transfer_result = self.connector.request_finished(
            request, request.block_ids)
        if (parked or delay_free) and request.block_ids:
            self.held[request.request_id] = list(request.block_ids)
            return True
        return False

    def stats(self) -> dict[str, int]:
        return {"kv_connector_loaded_tokens": self.num_loaded_tokens,
                "kv_connector_failed_blocks": self.num_failed_blocks,
                "kv_connector_waiting_for_load": len(self.loading)}


def merged(first: KVConnectorOutput, second: KVConnectorOutput) -> KVConnectorOutput:
    """Two reports of one engine step (its batch, then its retries) as one."""
    return KVConnectorOutput(first.finished_sending | second.finished_sending,
                             first.finished_recving | second.finished_recving,
                             first.invalid_block_ids | second.invalid_block_ids)
