"""Binding each attention layer to its KV cache tuple, with every check a caller can act on."""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import nn

from kvgraph.devices import same_device
from kvgraph.errors import KVCacheError
from kvgraph.kv_cache.spec import KVCache, KVCacheLayer


def layer_index(layer_name: str) -> int:
    """The layer number in a dotted layer name (`model.layers.20.self_attn.attn` -> 20)."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise KVCacheError(
            f"cannot tell the layer index of {layer_name!r}: expected exactly one integer "
            f"component in the dotted name, found {numbers}. Pass kv_caches as a dict by name."
        )
    return numbers[0]


def bind_kv_cache(
    layers: Mapping[str, nn.Module],
    kv_caches: Mapping[str, Sequence[torch.Tensor]] | Sequence[Sequence[torch.Tensor]],
    shared_kv_cache_layers: Mapping[str, str] | None = None,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> dict[str, KVCache]:
    """Set each attention layer's `kv_cache` to its tuple; return the tuples by layer name.

    `layers` maps layer names to modules; entries that are not kvgraph attention layers, and
    layers that keep no cache, are skipped. `kv_caches` is a dict by layer name, or a list whose
    i-th entry belongs to the cache-owning layer with the i-th smallest layer index.
    `shared_kv_cache_layers` maps a layer to an earlier layer whose very tuple it reuses; such
    a layer only reads it (the target's writes serve both), as does a layer built with
    `kv_sharing_target_layer_name`. Bind before the model is compiled: a compiled graph keeps
    whether each layer writes.
    `device` and `dtype`, when given, are checked too. Nothing is bound unless all checks pass.
    """
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise KVCacheError(f"dtype: expected a torch.dtype (e.g. torch.float16), got {dtype!r}")
    cache_layers = _cache_layers(layers)
    sharing = _sharing(cache_layers, shared_kv_cache_layers or {})
    shared = _resolve_sharing(cache_layers, sharing)
    owners = [name for name in cache_layers if name not in shared]
    by_name = _caches_by_name(owners, shared, kv_caches)

    expected_device = torch.device(device) if device is not None else None
    bound: dict[str, KVCache] = {}
    for name in owners:
        cache = _checked_cache(name, cache_layers[name], by_name[name], expected_device, dtype)
        expected_device = cache[0].device
        bound[name] = cache
    _check_no_cache_bound_twice(bound)
    for name, target in shared.items():
        bound[name] = bound[target]
    for name, cache in bound.items():
        cache_layers[name].kv_cache = cache
    for name, target in sharing.items():
        cache_layers[name].kv_sharing_target_layer_name = target  # its op now only reads
    return bound


def _cache_layers(layers: Mapping[str, nn.Module]) -> dict[str, KVCacheLayer]:
    cache_layers = {}
    for name, layer in layers.items():
        if not isinstance(layer, KVCacheLayer):
            continue
        if layer.layer_name != name:
            raise KVCacheError(
                f"layers[{name!r}] is the attention layer named {layer.layer_name!r}; "
                f"key the dict by each layer's layer_name"
            )
        if layer.needs_kv_cache:
            cache_layers[name] = layer
    return cache_layers


def _sharing(cache_layers: Mapping[str, KVCacheLayer], given: Mapping[str, str]
             ) -> dict[str, str]:
    """Who shares whose cache: what the layers declared at construction, plus `given`."""
    sharing = {name: layer.kv_sharing_target_layer_name for name, layer in cache_layers.items()
               if layer.kv_sharing_target_layer_name is not None}
    for name, target in given.items():
        declared = sharing.setdefault(name, target)
        if declared != target:
            raise KVCacheError(
                f"shared_kv_cache_layers[{name!r}] = {target!r}, but the layer was built with "
                f"kv_sharing_target_layer_name={declared!r}"
            )
    return sharing


def _model_order(cache_layers: Mapping[str, KVCacheLayer]) -> dict[str, tuple[int, int]]:
    """A sort key per layer: layer index when every name has one, then position in the dict."""
    try:
        return {name: (layer_index(name), i) for i, name in enumerate(cache_layers)}
    except KVCacheError:
        return {name: (0, i) for i, name in enumerate(cache_layers)}


def _resolve_sharing(
    cache_layers: Mapping[str, KVCacheLayer], shared: dict[str, str]
) -> dict[str, str]:
    """Map each sharing layer to the layer that owns the tuple it reuses, checking the chain."""
    for name, target in shared.items():
        for role, layer in (("layer", name), ("target", target)):
            if layer not in cache_layers:
                raise KVCacheError(
                    f"shared_kv_cache_layers[{name!r}] = {target!r}: {role} {layer!r} is not an "
                    f"attention layer that keeps a KV cache; known: {sorted(cache_layers)}"
                )
    owners = {}
    for name in shared:
        chain = [name]
        while chain[-1] in shared:
            chain.append(shared[chain[-1]])
            if chain[-1] in chain[:-1]:
                raise KVCacheError(f"KV cache sharing forms a cycle: {' -> '.join(chain)}")
        owners[name] = chain[-1]
    order = _model_order(cache_layers)
    for name, target in shared.items():
        if order[target] >= order[name]:
            raise KVCacheError(
                f"layer {name!r} shares the cache of {target!r}, which does not come earlier in "
                f"the model; a layer may only reuse an earlier layer's cache"
            )
    return owners


def _caches_by_name(
    owners: list[str],
    shared: Mapping[str, str],
    kv_caches: Mapping[str, Sequence[torch.Tensor]] | Sequence[Sequence[torch.Tensor]],
) -> Mapping[str, Sequence[torch.Tensor]]:
    if isinstance(kv_caches, Mapping):
        for name in kv_caches:
            if name in shared:
                raise KVCacheError(
                    f"a cache was given for {name!r}, which shares the cache of {shared[name]!r}; "
                    f"drop its entry"
                )
            if name not in owners:
                raise KVCacheError(
                    f"a cache was given for unknown layer {name!r}; attention layers that keep "
                    f"their own cache: {owners}"
                )
        missing = [name for name in owners if name not in kv_caches]
        if missing:
            raise KVCacheError(f"no KV cache given for layer(s) {missing}")
        return kv_caches
    ordered = sorted(owners, key=layer_index)
    if len(kv_caches) != len(ordered):
        raise KVCacheError(
            f"kv_caches has {len(kv_caches)} entries, but {len(ordered)} layers keep their own "
            f"cache, in layer-index order: {ordered}"
        )
    return dict(zip(ordered, kv_caches))


def _check_no_cache_bound_twice(bound: Mapping[str, KVCache]) -> None:
    """Two owning layers on one tensor would both write it: sharing must be declared."""
    owner_of: dict[int, str] = {}
    for name, cache in bound.items():
        for tensor in cache:
            other = owner_of.setdefault(tensor.untyped_storage().data_ptr(), name)
            if other != name:
                raise KVCacheError(
                    f"layers {other!r} and {name!r} were given the same cache tensor; both would "
                    f"write it. To share a cache, declare it: shared_kv_cache_layers="
                    f"{{{name!r}: {other!r}}} or Attention(kv_sharing_target_layer_name=...)"
                )


def _checked_cache(
    name: str,
    layer: KVCacheLayer,
    cache: Sequence[torch.Tensor],
    device: torch.device | None,
    dtype: torch.dtype | None,
) -> KVCache:
    """`cache` as a tuple, after checking it against the layer's spec; a KVCacheError if not."""
    if not isinstance(cache, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in cache):
        raise KVCacheError(
            f"layer {name!r}: a KV cache is a tuple of tensors, got {type(cache).__name__}"
        )
    expected_len = len(layer.kv_cache_spec(1, torch.float32).tensor_names)
    if len(cache) != expected_len:
        raise KVCacheError(f"layer {name!r}: expected {expected_len} cache tensors, got {len(cache)}")
    first = cache[0]
    if first.dim() < 2:
        raise KVCacheError(f"layer {name!r}: cache tensors are [num_blocks, block_size, ...], "
                           f"got shape {tuple(first.shape)}")
    spec = layer.kv_cache_spec(first.shape[1], dtype or first.dtype)
    for tensor_name, shape, tensor in zip(spec.tensor_names, spec.shapes(first.shape[0]), cache):
        where = f"layer {name!r} {tensor_name}"
        if tuple(tensor.shape) != shape:
            raise KVCacheError(f"{where}: expected shape {shape}, got {tuple(tensor.shape)}")
        if tensor.dtype != spec.dtype:
            raise KVCacheError(f"{where}: expected dtype {spec.dtype}, got {tensor.dtype}")
        if device is not None and not same_device(tensor.device, device):
            raise KVCacheError(f"{where}: expected device {device}, got {tensor.device}")
        if not tensor.is_contiguous():
            raise KVCacheError(f"{where}: must be contiguous (stride {tensor.stride()})")
        device = tensor.device
    storages = {t.untyped_storage().data_ptr() for t in cache}
    if len(storages) != len(cache):
        raise KVCacheError(f"layer {name!r}: the cache tensors must be separate allocations, "
                           f"not views of one tensor")
    return tuple(cache)
