"""The attention layers models use: they own a layer's KV cache and call kvgraph's ops."""

from __future__ import annotations

import torch

from kvgraph.attention import ops  # noqa: F401  (registers torch.ops.kvgraph.*)
from kvgraph.errors import KVCacheError
from kvgraph.attention.layer_base import AttentionLayerBase
from kvgraph.kv_cache.spec import AttentionSpec, KVCacheSpec, MLASpec

ATTENTION_TYPES = ("decoder", "encoder_only")


def _check_bound(layer: AttentionLayerBase) -> None:
    if len(layer.kv_cache) == 0:
        raise KVCacheError(
            f"attention layer {layer.layer_name!r} has no KV cache bound; allocate caches with "
            f"kvgraph.allocate_kv_caches and bind them with kvgraph.bind_kv_cache first"
        )


class Attention(AttentionLayerBase):
    """Multi-head attention over a paged `(key_cache, value_cache)`; MHA, GQA and MQA.

    `attn_type="encoder_only"` attends bidirectionally within each request's new tokens and
    keeps no cache (a `sliding_window` w then lets token i see token j when |i - j| < w).
    `kv_sharing_target_layer_name` makes the layer read that earlier layer's cache without
    writing it; its own keys and values are then unused. The call is the same in eager and
    graph mode; the cache tuple set by `bind_kv_cache` is read from `self.kv_cache` and
    mutated in place.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None,
        layer_name: str,
        sliding_window: int | None = None,
        attn_type: str = "decoder",
        kv_sharing_target_layer_name: str | None = None,
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"{layer_name}: num_heads ({num_heads}) must be a multiple of num_kv_heads "
                f"({num_kv_heads})"
            )
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"{layer_name}: sliding_window must be >= 1, got {sliding_window}")
        if attn_type not in ATTENTION_TYPES:
            raise ValueError(f"{layer_name}: attn_type must be one of {ATTENTION_TYPES}")
        if attn_type == "encoder_only" and kv_sharing_target_layer_name is not None:
            raise ValueError(f"{layer_name}: an encoder-only layer keeps no cache, so it cannot "
                             f"share {kv_sharing_target_layer_name!r}'s")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale, self.sliding_window = scale, sliding_window
        self.layer_name, self.attn_type = layer_name, attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec | None:
        if self.attn_type == "encoder_only":
            return None
        return AttentionSpec(block_size, self.num_kv_heads, self.head_size, dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`[T, num_heads*head_size]`, `[T, num_kv_heads*head_size]` x2 -> `[T, num_heads*head_size]`."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        out = torch.empty_like(query)
        if self.attn_type == "encoder_only":
            torch.ops.kvgraph.encoder_attention(query, key, value, out, self.scale,
                                                self.sliding_window or -1)
        else:
            _check_bound(self)
            torch.ops.kvgraph.unified_attention(
                query, key, value, self.kv_cache, out, self.scale, self.sliding_window or -1,
                self.kv_sharing_target_layer_name is None,
            )
        return out.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name!r}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
            f"head_size={self.head_size}, window={self.sliding_window}, type={self.attn_type}"
            + (f", shares={self.kv_sharing_target_layer_name!r}"
               if self.kv_sharing_target_layer_name else "")
        )


class MLAAttention(AttentionLayerBase):
    """Multi-head latent attention over a paged `(kv_c_cache, k_pe_cache)`.

    Queries arrive already absorbed into the latent space; the output stays in it (the model
    applies the value up-projection). Scores are `q_latent·kv_c + q_pe·k_pe`.
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float,
                 layer_name: str, kv_sharing_target_layer_name: str | None = None):
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.scale, self.layer_name = scale, layer_name
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.kv_cache: tuple[torch.Tensor, ...] = ()

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        return MLASpec(block_size, self.kv_lora_rank, self.rope_dim, dtype)

    def forward(self, q_latent: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                k_pe: torch.Tensor) -> torch.Tensor:
        """`[T,H,L]`, `[T,H,R]`, `[T,L]`, `[T,R]` -> `[T,H,L]`."""
        _check_bound(self)
        out = torch.empty_like(q_latent)
        torch.ops.kvgraph.unified_mla_attention(
            q_latent, q_pe, kv_c, k_pe, self.kv_cache, out, self.scale,
            self.kv_sharing_target_layer_name is None,
        )
        return out

    def extra_repr(self) -> str:
        return (
            f"{self.layer_name!r}, heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, "
            f"rope_dim={self.rope_dim}"
        )
