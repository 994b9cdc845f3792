"""kvgraph's opaque attention ops: what a traced graph calls and the compiler splits at.

Each op mutates exactly its cache tuple and `out`, returns nothing, and reads the per-step
metadata from the forward context, so models keep a plain `forward(input_ids, positions)`.

In piecewise graphs the ops run outside the graphs once per layer per step, so their host cost
multiplies by the depth. They are therefore defined with `torch.library.Library` directly
(`torch.library.custom_op` adds ~15 us of dispatch per call), and the shape checks, a pure
function of the shapes, run once per distinct set of shapes, not per call.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvgraph.attention.backends import get_attention_backend
from kvgraph.attention.metadata import AttentionMetadata
from kvgraph.errors import BatchError, ForwardContextError
from kvgraph.forward_context import AttentionProbe, KVLayerHooks, get_forward_context


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(tensor.shape)}")


def _check_heads(num_heads: int, num_kv_heads: int) -> None:
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"query has {num_heads} heads and key {num_kv_heads}: expected num_heads to be a "
            f"multiple of num_kv_heads"
        )


def _check_cache(kv_cache: list[torch.Tensor], block_shapes: tuple[tuple[int, ...], ...],
                 metadata: AttentionMetadata) -> None:
    """Rows match the layer, and every tensor is `[num_blocks, metadata.block_size, ...]` alike."""
    got = tuple(tuple(t.shape[2:]) for t in kv_cache)
    expected = tuple(shape[1:] for shape in block_shapes)
    if got != expected:
        raise ValueError(
            f"kv_cache: expected {len(expected)} tensors [num_blocks, block_size, *row] with rows "
            f"{expected}, got rows {got}"
        )
    leading = {tuple(t.shape[:2]) for t in kv_cache}
    num_blocks = kv_cache[0].shape[0]
    if leading != {(num_blocks, metadata.block_size)}:
        raise ValueError(
            f"kv_cache: expected every tensor to be [num_blocks, block_size={metadata.block_size}"
            f", ...] with one num_blocks (a block id must address the same slots in each), got "
            f"leading dims {[tuple(t.shape[:2]) for t in kv_cache]}"
        )


# Shape signatures already checked: the checks depend on nothing else, so a signature that
# passed once always passes. Bounded, because shapes follow the batch's padded token count.
_checked: set[tuple] = set()
_MAX_CHECKED = 4096


def _check_once(signature: tuple, check: Callable[[], None]) -> None:
    if signature not in _checked:
        check()
        if len(_checked) >= _MAX_CHECKED:
            _checked.clear()
        _checked.add(signature)


def _metadata(num_tokens: int) -> tuple[AttentionMetadata, str | None, AttentionProbe | None,
                                        KVLayerHooks | None]:
    """The step's metadata, attention backend name, probe and KV hooks (see ForwardContext)."""
    context = get_forward_context()
    metadata = context.attn_metadata
    if metadata is None:
        raise ForwardContextError(
            "the forward context has no attn_metadata; attention needs one (build it with "
            "kvgraph.build_attention_metadata)")
    if metadata.slot_mapping.shape[0] != num_tokens:
        raise BatchError(
            f"the batch has {num_tokens} tokens but its slot_mapping has "
            f"{metadata.slot_mapping.shape[0]}; metadata and inputs must describe the same batch"
        )
    return metadata, context.attn_backend, context.probe, context.kv_hooks


_library = torch.library.Library("kvgraph", "DEF")  # kept alive: it owns the registrations
_library.define(
    "unified_attention(Tensor query, Tensor key, Tensor value, Tensor(a!)[] kv_cache, "
    "Tensor(b!) out, float scale, SymInt sliding_window=-1, bool write_kv=True) -> ()")
_library.define(
    "unified_mla_attention(Tensor q_latent, Tensor q_pe, Tensor kv_c, Tensor k_pe, "
    "Tensor(a!)[] kv_cache, Tensor(b!) out, float scale, bool write_kv=True) -> ()")
_library.define(
    "encoder_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) out, float scale, "
    "SymInt sliding_window=-1) -> ()")


def unified_attention(query, key, value, kv_cache, out, scale, sliding_window=-1, write_kv=True):
    """Paged causal attention; `sliding_window` -1 means none. Shapes: see AttentionBackend.

    `write_kv=False` is a layer that reads another layer's cache: nothing is written, and its
    keys and values come from the cache alone (the target layer wrote this step's tokens).
    """
    metadata, backend, probe, kv_hooks = _metadata(query.shape[0])

    def check() -> None:
        num_tokens, num_heads, head_size = query.shape
        num_kv_heads = key.shape[1]
        _check_heads(num_heads, num_kv_heads)
        _check_shape("key", key, (num_tokens, num_kv_heads, head_size))
        _check_shape("value", value, (num_tokens, num_kv_heads, head_size))
        _check_shape("out", out, (num_tokens, num_heads, head_size))
        _check_cache(kv_cache, ((0, num_kv_heads, head_size),) * 2, metadata)

    _check_once(("attention", query.shape, key.shape, value.shape, out.shape,
                 *[t.shape for t in kv_cache], metadata.block_size), check)
    # A layer that reads another's cache writes nothing, so it has nothing to load or save.
    if kv_hooks is not None and write_kv:
        kv_hooks.before_attention(kv_cache)
    get_attention_backend(backend, query.device).forward(
        query, key, value, kv_cache, out, metadata, scale,
        sliding_window if sliding_window > 0 else None, write_kv,
    )
    if kv_hooks is not None and write_kv:
        kv_hooks.after_attention(kv_cache, metadata)
    if probe is not None:
        probe("unified_attention", kv_cache, (query, key, value), out)


def unified_mla_attention(q_latent, q_pe, kv_c, k_pe, kv_cache, out, scale, write_kv=True):
    """Paged causal MLA over the latent cache; the output is in the latent space.

    `write_kv=False`: the layer reads another layer's cache and writes nothing.
    """
    metadata, backend, probe, kv_hooks = _metadata(q_latent.shape[0])

    def check() -> None:
        num_tokens, num_heads, kv_lora_rank = q_latent.shape
        rope_dim = q_pe.shape[-1]
        _check_shape("q_pe", q_pe, (num_tokens, num_heads, rope_dim))
        _check_shape("kv_c", kv_c, (num_tokens, kv_lora_rank))
        _check_shape("k_pe", k_pe, (num_tokens, rope_dim))
        _check_shape("out", out, (num_tokens, num_heads, kv_lora_rank))
        _check_cache(kv_cache, ((0, kv_lora_rank), (0, rope_dim)), metadata)

    _check_once(("mla", q_latent.shape, q_pe.shape, kv_c.shape, k_pe.shape, out.shape,
                 *[t.shape for t in kv_cache], metadata.block_size), check)
    if kv_hooks is not None and write_kv:
        kv_hooks.before_attention(kv_cache)
    get_attention_backend(backend, q_latent.device).forward_mla(
        q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale, write_kv
    )
    if kv_hooks is not None and write_kv:
        kv_hooks.after_attention(kv_cache, metadata)
    if probe is not None:
        probe("unified_mla_attention", kv_cache, (q_latent, q_pe, kv_c, k_pe), out)


def encoder_attention(query, key, value, out, scale, sliding_window=-1):
    """Bidirectional attention within each request's new tokens; no KV cache.

    With `sliding_window` w > 0, token i sees token j of its request only when |i - j| < w.
    """
    metadata, backend, probe, _ = _metadata(query.shape[0])

    def check() -> None:
        num_tokens, num_heads, head_size = query.shape
        _check_heads(num_heads, key.shape[1])
        _check_shape("key", key, (num_tokens, key.shape[1], head_size))
        _check_shape("value", value, tuple(key.shape))
        _check_shape("out", out, (num_tokens, num_heads, head_size))

    _check_once(("encoder", query.shape, key.shape, value.shape, out.shape), check)
    get_attention_backend(backend, query.device).forward_encoder(
        query, key, value, out, metadata, scale, sliding_window if sliding_window > 0 else None
    )
    if probe is not None:
        probe("encoder_attention", [], (query, key, value), out)


def _returns_nothing(*args, **kwargs) -> None:
    """The ops' fake (meta) kernel: they return nothing, so tracing needs no shapes."""
    return None


for _op in (unified_attention, unified_mla_attention, encoder_attention):
    # CompositeExplicitAutograd: one kernel for every device; the backend picks the kernels.
    _library.impl(_op.__name__, _op, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvgraph::{_op.__name__}", _returns_nothing, lib=_library)
