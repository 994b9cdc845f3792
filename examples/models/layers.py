"""The building blocks both example models share: RMSNorm, rotary embedding, SwiGLU MLP, and
the merged linear that runs several HF projections as one matmul."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

# Rotary embedding lives with its scalings in rope.py; models import it from here too.
from .rope import RotaryEmbedding

__all__ = ["MLP", "MergedLinear", "Part", "RMSNorm", "RotaryEmbedding"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale, computed in float32 as HF Llama does."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


@dataclass(frozen=True)
class Part:
    """One HF linear inside a `MergedLinear`: its name (`q_proj`), its full output features, and
    the slice of them this module holds (all of them unless tensor parallelism cut it)."""

    name: str
    features: int
    shard: slice

    @property
    def size(self) -> int:
        """The output features of this part held here."""
        return self.shard.stop - self.shard.start


class MergedLinear(nn.Linear):
    """Several HF linears that read the same input, run as one matmul (vLLM's merged q/k/v and
    gate/up): the output is the parts' outputs concatenated in order, split after the matmul
    into its parts. The HF checkpoint keeps the parts as separate tensors; the loader puts
    each in its rows (hf_layout.py).

    `parts`: HF name -> full output features, in output order. `shards`: the slice of each
    part's features held here (a tensor-parallel rank's share); None holds them all.
    """

    def __init__(self, in_features: int, parts: Mapping[str, int], bias: bool = True, *,
                 shards: Mapping[str, slice] | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        shards = shards or {}
        merged = tuple(Part(name, features, shards.get(name, slice(0, features)))
                       for name, features in parts.items())
        for part in merged:
            if not 0 <= part.shard.start < part.shard.stop <= part.features:
                raise ValueError(f"{type(self).__name__}: {part.name}'s shard {part.shard} is "
                                 f"not inside 0..{part.features}")
        super().__init__(in_features, sum(p.size for p in merged), bias, device=device,
                         dtype=dtype)
        self.parts = merged

    def part_rows(self) -> Iterator[tuple[Part, slice]]:
        """Each part with the rows (output features) of this module's weight it fills."""
        start = 0
        for part in self.parts:
            yield part, slice(start, start + part.size)
            start += part.size

    def cut(self, merged: torch.Tensor) -> torch.Tensor:
        """This module's rows of a merged tensor (weight or bias) holding every part whole."""
        rows, start = [], 0
        for part in self.parts:
            rows.append(merged[start + part.shard.start:start + part.shard.stop])
            start += part.features
        return torch.cat(rows)

    def extra_repr(self) -> str:
        parts = ", ".join(f"{p.name} {p.shard.start}:{p.shard.stop} of {p.features}"
                          for p in self.parts)
        return f"{super().extra_repr()}, parts [{parts}]"


class MLP(nn.Module):
    """The SwiGLU feed-forward block, `down(silu(gate(x)) * up(x))`, gate and up as one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size},
            bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, -1)  # equal parts, also when sharded
        return self.down_proj(F.silu(gate) * up)
