"""WorkerConnector: a runner's worker-side KV connector, registered once and driven around each
step, with the counts `ModelRunner.stats()` reports."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
)
from kvgraph.kv_transfer.layer_hooks import LayerHooks


def disabled_stats() -> dict[str, Any]:
    """A runner without a connector: nothing was called."""
    return {"connector": None, "layerwise": False, "steps": 0, "layer_hook_calls": 0}


class WorkerConnector:
    """Calls the worker side of `connector` around each step (see KVConnectorBase)."""

    def __init__(self, connector: KVConnectorBase, kv_caches: dict[str, KVCache],
                 graph_mode_change: str | None = None):
        if connector.role is not KVConnectorRole.WORKER:
            raise ConfigError("kv_connector", f"a runner takes a KV connector built for the "
                              f"worker role, got one for the {connector.role.value} role")
        connector.register_kv_caches(kv_caches)
        self.connector = connector
        self.hooks = LayerHooks(connector, kv_caches) if connector.layerwise else None
        self.output = KVConnectorOutput()  # the last step's report
        self.steps = 0
        self.graph_mode_change = graph_mode_change  # how this connector changed the graph mode

    @contextlib.contextmanager
    def step(self, metadata: KVConnectorMetadata | None, attn_metadata: Any
             ) -> Iterator[LayerHooks | None]:
        """Around one step's forward: bind its metadata and start its loads; yield the layer
        hooks its attention ops call (None for a whole-request connector); then wait for its
        saves (not when the forward raised: its caches are in doubt) and collect its report."""
        connector = self.connector
        connector.bind_connector_metadata(metadata if metadata is not None
                                          else KVConnectorMetadata())
        try:
            connector.start_load_kv(attn_metadata)
            yield self.hooks
            connector.wait_for_save()
        finally:
            sending, recving = connector.get_finished(set())
            self.output = KVConnectorOutput(set(sending or ()), set(recving or ()),
                                            set(connector.get_block_ids_with_load_errors()))
            connector.clear_connector_metadata()
            self.steps += 1

    def transfer(self, metadata: KVConnectorMetadata) -> KVConnectorOutput:
        """A step without a forward: only the connector's loads and saves (an engine whose
        requests all wait for their blocks still has to drive those loads)."""
        with self.step(metadata, None):
            pass
        return self.output

    def stats(self) -> dict[str, Any]:
        return {"connector": self.connector.name, "layerwise": self.connector.layerwise,
                "steps": self.steps, "layer_hook_calls": self.hooks.calls if self.hooks else 0,
                **({"graph_mode_change": self.graph_mode_change}
                   if self.graph_mode_change else {}),
                **self.connector.stats()}

    def close(self) -> None:
        self.connector.close()
