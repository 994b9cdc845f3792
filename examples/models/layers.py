"""The building blocks both example models share: RMSNorm, rotary embedding, SwiGLU MLP."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" (GPT-NeoX, HF Llama) layout.

    The angles are computed from `positions` on every call rather than kept in a buffer, so the
    module holds no state: nothing to load, and nothing to re-create after meta-device building.
    """

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dimension, got {head_dim}")
        self.head_dim, self.theta = head_dim, theta

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`[T]` positions -> cos and sin, each `[T, 1, head_dim]` in float32."""
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device).float()
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        angles = positions.float()[:, None] * inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotate each `[T, heads, head_dim]` tensor of `xs` by its token's position."""
        cos, sin = self.cos_sin(positions)
        return tuple(
            x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype) for x in xs
        )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"


class MLP(nn.Module):
    """The SwiGLU feed-forward block: `down(silu(gate(x)) * up(x))`, HF parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
