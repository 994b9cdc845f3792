"""The building blocks both example models share: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# Rotary embedding lives with its scalings in rope.py; models import it from here too.
from .rope import RotaryEmbedding

__all__ = ["MLP", "RMSNorm", "RotaryEmbedding"]


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


class MLP(nn.Module):
    """The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`, HF parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
