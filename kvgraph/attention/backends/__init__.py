"""Attention backends by name, and the default one for a device."""

from __future__ import annotations

import torch

from kvgraph.attention.backends.base import AttentionBackend
from kvgraph.attention.backends.torch_native import TorchNativeBackend

_BACKENDS: dict[str, type] = {TorchNativeBackend.name: TorchNativeBackend}
_instances: dict[str, AttentionBackend] = {}


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend called `name`, or the default for `device` when `name` is None."""
    name = name or TorchNativeBackend.name
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    if name not in _instances:
        _instances[name] = _BACKENDS[name]()
    return _instances[name]


__all__ = ["AttentionBackend", "TorchNativeBackend", "get_attention_backend"]
