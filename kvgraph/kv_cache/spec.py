"""KV cache specs and allocation: the shape of each layer's cache tuple, and the tensors."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Protocol, runtime_checkable

import torch

from kvgraph.errors import KVCacheError

KVCache = tuple[torch.Tensor, ...]


class KVCacheSpec:
    """The shape of one layer's cache: a tuple of `num_blocks`-first tensors of one dtype.

    Subclasses are frozen dataclasses with `block_size` and `dtype` fields.
    """

    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise KVCacheError(f"block_size must be >= 1, got {self.block_size}")
        if not self.dtype.is_floating_point:
            raise KVCacheError(f"a KV cache dtype must be floating point, got {self.dtype}")
        if min(d for shape in self.block_shapes() for d in shape) < 1:
            raise KVCacheError(f"every dimension of {self} must be >= 1")

    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The shape of one block of each tensor of the tuple (without `num_blocks`)."""
        raise NotImplementedError

    @property
    def tensor_names(self) -> tuple[str, ...]:
        raise NotImplementedError

    def shapes(self, num_blocks: int) -> tuple[tuple[int, ...], ...]:
        return tuple((num_blocks, *shape) for shape in self.block_shapes())

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block takes across every tensor of the tuple."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return sum(math.prod(shape) for shape in self.block_shapes()) * element_size

    def allocate(self, num_blocks: int, device: torch.device | str) -> KVCache:
        """One separate, zeroed allocation per tensor of the tuple."""
        return tuple(
            torch.zeros(shape, dtype=self.dtype, device=device) for shape in self.shapes(num_blocks)
        )


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Standard attention (MHA/GQA/MQA): `(key_cache, value_cache)`."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        shape = (self.block_size, self.num_kv_heads, self.head_size)
        return (shape, shape)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return ("key_cache", "value_cache")


@dataclass(frozen=True)
class MLASpec(KVCacheSpec):
    """Multi-head latent attention: `(kv_c_cache, k_pe_cache)`."""

    block_size: int
    kv_lora_rank: int
    rope_dim: int
    dtype: torch.dtype

    def block_shapes(self) -> tuple[tuple[int, ...], ...]:
        return ((self.block_size, self.kv_lora_rank), (self.block_size, self.rope_dim))

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return ("kv_c_cache", "k_pe_cache")


@runtime_checkable
class KVCacheLayer(Protocol):
    """What binding needs of an attention layer (kvgraph.attention.layer_base implements it)."""

    layer_name: str
    kv_cache: KVCache
    kv_sharing_target_layer_name: str | None

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec | None: ...

    @property
    def needs_kv_cache(self) -> bool: ...


def allocate_kv_caches(
    specs: Mapping[str, KVCacheSpec], num_blocks: int, device: torch.device | str
) -> dict[str, KVCache]:
    """Allocate each layer's cache tuple: separate tensors, `num_blocks` first, zeroed."""
    if num_blocks < 1:
        raise KVCacheError(f"num_blocks must be >= 1, got {num_blocks}")
    return {name: spec.allocate(num_blocks, device) for name, spec in specs.items()}

