"""Attention backends by name, loaded on first use, and the default one.

A backend module is imported only when its backend is first asked for, so `import kvgraph`
loads no kernels (and no device library) that the process never uses.
"""

from __future__ import annotations

import importlib

import torch

from kvgraph.attention.backends.base import (
    AttentionBackend,
    AttentionPlan,
    GraphSupport,
    StepLengths,
)

DEFAULT_BACKEND = "torch_native"
# name -> "module:class", imported on first use; register_attention_backend adds classes.
_BACKENDS: dict[str, str | type] = {
    "torch_native": "kvgraph.attention.backends.torch_native:TorchNativeBackend",
    "cpu_paged": "kvgraph.attention.backends.cpu_paged:CPUPagedBackend",
    "triton": "kvgraph.attention.backends.triton:TritonBackend",
    "ascend": "kvgraph.attention.backends.ascend:AscendBackend",
}
_instances: dict[str, AttentionBackend] = {}


def register_attention_backend(backend_class: type[AttentionBackend]) -> None:
    """Make `backend_class` (an AttentionBackend subclass) selectable by its `name`."""
    _BACKENDS[backend_class.name] = backend_class
    _instances.pop(backend_class.name, None)


def _load(name: str) -> AttentionBackend:
    backend_class = _BACKENDS[name]
    if isinstance(backend_class, str):
        module, _, attribute = backend_class.partition(":")
        backend_class = getattr(importlib.import_module(module), attribute)
    return backend_class()


def get_attention_backend(name: str | None, device: torch.device | str) -> AttentionBackend:
    """The backend called `name` (None: the default), checked to run on `device`'s type."""
    name = name or DEFAULT_BACKEND
    backend = _instances.get(name)
    if backend is None:
        if name not in _BACKENDS:
            raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
        backend = _instances[name] = _load(name)
    # A string's type is read off it: torch.device('npu') needs torch_npu, never imported here.
    device_type = device.split(":")[0] if isinstance(device, str) else device.type
    device_types = backend.device_types
    if device_types is not None and device_type not in device_types:
        raise ValueError(f"attention backend {name!r} runs on {', '.join(device_types)}, not on "
                         f"{device_type}")
    return backend


__all__ = [
    "AttentionBackend",
    "AttentionPlan",
    "StepLengths",
    "DEFAULT_BACKEND",
    "GraphSupport",
    "get_attention_backend",
    "register_attention_backend",
]
