"""Device identity: two devices are the same when their type and index are.

`torch.device("cuda") != torch.device("cuda:0")`, while tensors always report an index
(`cuda:0`); an index-less device means the device module's current one.
"""

from __future__ import annotations

import os
import sys

import torch


def _current_index(device_type: str) -> int:
    if device_type == "cpu":
        return 0
    if device_type == "npu" and "torch_npu" not in sys.modules:
        return 0  # never import torch_npu to compare devices (see kvgraph.runtime.platforms.npu)
    module = getattr(torch, device_type, None)
    current = getattr(module, "current_device", None)
    return int(current()) if current is not None else 0


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` with its index filled in (the current one of its type when it has none)."""
    device = torch.device(device)
    if device.index is not None:
        return device
    return torch.device(device.type, _current_index(device.type))


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether `a` and `b` name one device (`cuda` and `cuda:0` do when 0 is current)."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.index == b.index:
        return True
    return canonical_device(a) == canonical_device(b)


def memory_bytes(device: torch.device) -> int | None:
    """All the memory `device` has (the machine's RAM for the CPU); None when unknown."""
    if device.type == "cpu":
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    properties = getattr(getattr(torch, device.type, None), "get_device_properties", None)
    return None if properties is None else int(properties(device).total_memory)
