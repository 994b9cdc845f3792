"""Platforms by device type, one per process: stateless; graph pools belong to runners."""

from __future__ import annotations

import torch

from kvgraph.errors import PlatformError
from kvgraph.runtime.platforms.base import DeviceGraph, Platform

_platforms: dict[str, Platform] = {}


def get_platform(device: torch.device | str) -> Platform:
    """The platform of `device` (`cpu`, `cuda[:i]`, `npu[:i]`)."""
    # Not torch.device(): without torch_npu loaded, torch does not know the "npu" type.
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if device_type not in _platforms:
        if device_type == "cpu":
            from kvgraph.runtime.platforms.cpu import CPUPlatform as make_platform
        elif device_type == "cuda":
            from kvgraph.runtime.platforms.cuda import cuda_platform as make_platform
        elif device_type == "npu":
            from kvgraph.runtime.platforms.npu import npu_platform as make_platform
        else:
            raise PlatformError(f"no kvgraph platform for device {device!r}; have cpu, cuda, npu")
        _platforms[device_type] = make_platform()
    return _platforms[device_type]


__all__ = ["DeviceGraph", "Platform", "get_platform"]
