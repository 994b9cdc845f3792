"""Attention backends by name, and the default one for a device."""

from __future__ import annotations

import torch

from kvgraph.attention.backends.base import AttentionBackend, GraphSupport
from kvgraph.attention.backends.torch_native import TorchNativeBackend

_BACKENDS: dict[str, type] = {TorchNativeBackend.name: TorchNativeBackend}
_instances: dict[str, AttentionBackend] = {}


def register_attention_backend(backend_class: type) -> None:
    """Make `backend_class` selectable by its `name` (device kernels, tests)."""
    _BACKENDS[backend_class.name] = backend_class
    _instances.pop(backend_class.name, None)


def get_attention_backend(name: str | None, device: torch.device) -> AttentionBackend:
    """The backend called `name`, or the default for `device` when `name` is None."""
    name = name or TorchNativeBackend.name
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    if name not in _instances:
        _instances[name] = _BACKENDS[name]()
    return _instances[name]


__all__ = [
    "AttentionBackend",
    "GraphSupport",
    "TorchNativeBackend",
    "get_attention_backend",
    "register_attention_backend",
]
