"""TensorParallelKVConnector: rank 0's face of every tensor-parallel rank's KV connector.

Each rank's runner has its own worker-side connector, over its own shard of the caches (built
with its `tp_rank`), and the scheduler side stays with rank 0's engine. The engine speaks to a
runner's `kv_connector` (`output`, `transfer`) as it does with one rank; under tensor
parallelism that is this face: the step's metadata goes to every rank with the step (over the
step channel), and after each step that every rank ran, each rank's report comes back to rank 0
(`StepChannel.gather`, one small collective, only with a connector) and is merged
(kv_output_merge.py). The runner's `stats()["kv_connector"]` are rank 0's connector's
counts (each rank counts its own shard's).
"""

from __future__ import annotations

from typing import Any, Callable

from kvgraph.kv_transfer import KVConnectorMetadata, KVConnectorOutput
from kvgraph.kv_transfer.worker import WorkerConnector

from .kv_output_merge import KVOutputMerger
from .step_channel import StepChannel


class TensorParallelKVConnector:
    """What a TensorParallelRunner offers as `kv_connector` (see the module docstring).

    `local` is rank 0's worker-side connector; `transfer_everywhere(metadata)` runs a transfer
    without a forward on every rank (the runner's broadcast, then `collect`).
    """

    def __init__(self, local: WorkerConnector, channel: StepChannel,
                 transfer_everywhere: Callable[[KVConnectorMetadata], None]):
        self.local = local
        self._channel = channel
        self._transfer_everywhere = transfer_everywhere
        self._merger = KVOutputMerger(channel.world_size)
        self.output = KVConnectorOutput()  # the last step's report, every rank's merged

    def transfer(self, metadata: KVConnectorMetadata) -> KVConnectorOutput:
        """A step without a forward on every rank: only the connectors' loads and saves."""
        self._transfer_everywhere(metadata)
        return self.output

    def clear(self) -> None:
        """Before a step: a step that every rank refuses (BatchError) reports nothing."""
        self.output = KVConnectorOutput()

    def collect(self) -> None:
        """After a step that every rank ran: their reports, gathered here and merged."""
        self.output = self._merger.merge(self._channel.gather(self.local.output))


def report_to_rank_zero(runner: Any, channel: StepChannel) -> None:
    """A worker, after a step it ran: its connector's report to rank 0 (nothing without one)."""
    if runner.kv_connector is not None:
        channel.gather(runner.kv_connector.output)
