"""The module base of kvgraph's attention layers, and finding a model's layers and cache specs."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from kvgraph.errors import KVCacheError
from kvgraph.kv_cache.spec import KVCache, KVCacheSpec


class AttentionLayerBase(nn.Module):
    """A module that owns one layer's KV cache tuple, bound by `bind_kv_cache`."""

    layer_name: str
    kv_cache: KVCache
    # The layer whose cache this one reads without writing (vLLM's KV sharing), or None.
    kv_sharing_target_layer_name: str | None = None

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec | None:
        """The spec of this layer's cache, or None when the layer keeps no cache."""
        raise NotImplementedError

    @property
    def needs_kv_cache(self) -> bool:
        return self.kv_cache_spec(1, torch.float32) is not None


def attention_layers(model: nn.Module) -> dict[str, AttentionLayerBase]:
    """Every kvgraph attention layer of `model`, by layer name, in module order."""
    layers: dict[str, AttentionLayerBase] = {}
    for module_path, module in model.named_modules():
        if isinstance(module, AttentionLayerBase):
            if module.layer_name in layers:
                raise KVCacheError(
                    f"two attention layers share the layer_name {module.layer_name!r} (the second "
                    f"at {module_path!r}); every layer needs its own name"
                )
            layers[module.layer_name] = module
    return layers


def kv_cache_specs(
    model: nn.Module,
    block_size: int,
    dtype: torch.dtype,
    shared_kv_cache_layers: Mapping[str, str] | None = None,
) -> dict[str, KVCacheSpec]:
    """One spec per attention layer that keeps its own cache, by layer name.

    Layers that keep no cache (encoder-only) and layers that reuse another layer's cache (built
    with `kv_sharing_target_layer_name` or named in `shared_kv_cache_layers`) get no spec, so
    nothing is allocated for them.
    """
    shared = shared_kv_cache_layers or {}
    specs = {}
    for name, layer in attention_layers(model).items():
        spec = layer.kv_cache_spec(block_size, dtype)
        sharing = name in shared or layer.kv_sharing_target_layer_name is not None
        if spec is not None and not sharing:
            specs[name] = spec
    return specs
