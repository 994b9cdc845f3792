"""LayerHooks: a layer-by-layer connector's calls, as the attention ops make them.

An op knows its layer only by the cache tuple it was given (no layer name enters a traced
piece, so identical layers compile once); the hooks name the layer from its cache's address,
which holds for the runner's life.
"""

from __future__ import annotations

from typing import Any

import torch

from kvgraph.errors import KVCacheError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.base import KVConnectorBase


class LayerHooks:
    """Calls `connector.wait_for_layer_load` before each writing layer's attention and
    `save_kv_layer` after it (see kvgraph.forward_context.KVLayerHooks); counts the calls."""

    def __init__(self, connector: KVConnectorBase, kv_caches: dict[str, KVCache]):
        self.connector = connector
        self._layers = {cache[0].data_ptr(): (name, cache) for name, cache in kv_caches.items()
                        if cache}
        self.calls = 0

    def _layer(self, kv_cache: list[torch.Tensor]) -> tuple[str, KVCache]:
        layer = self._layers.get(kv_cache[0].data_ptr())
        if layer is None:
            raise KVCacheError(
                "an attention op ran on a KV cache the runner did not register with its KV "
                f"connector (shape {tuple(kv_cache[0].shape)}); caches must be the runner's own")
        return layer

    def before_attention(self, kv_cache: list[torch.Tensor]) -> None:
        self.calls += 1
        self.connector.wait_for_layer_load(self._layer(kv_cache)[0])

    def after_attention(self, kv_cache: list[torch.Tensor], attn_metadata: Any) -> None:
        self.calls += 1
        name, cache = self._layer(kv_cache)
        self.connector.save_kv_layer(name, cache, attn_metadata)
