"""CPU weights moved into memory Linux backs with transparent huge pages, once at load.

A CPU decode step is bound by reading the weights from memory, and with 4 KiB pages it reads
them across one page-table entry per 4 KiB: 25,000 entries for the small Llama's 98 MB of fp32,
far more than the TLB holds, so the walks the misses cost slow the stream. In 2 MiB pages the
same weights take 47 entries. Measured on a 2-core AMD EPYC Zen 3 VM, one thread, alternating
in one process (`examples/benchmarks/huge_pages.py`; docs/performance.md, "Huge pages"): summing the fp32
weights took 0.85x the time, the small-batch kernel's pass over them at one row 0.92x, and the
example engine's fp32 decode step 0.92x (batch 1) and 0.95x (batch 16); bf16 (half the bytes)
and prefill (bound by arithmetic) were unchanged.

torch's allocator asks for huge pages only when `THP_MEM_ALLOC_ENABLE=1` is set before its
first allocation, for everything it allocates. `use_huge_pages(model)` instead copies the
model's CPU parameters into one anonymous mapping advised `MADV_HUGEPAGE` (Linux then
backs it with huge pages as it faults in, where `/sys/kernel/mm/transparent_hugepage/enabled`
is `always` or `madvise`) and frees the old storage parameter by parameter, so loading peaks at
the model plus its largest parameter. The parameters stay parameters (graph inputs), each at a
64-byte boundary: identical layers still compile once.
"""

from __future__ import annotations

import logging
import math
import mmap
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# Each parameter starts on a cache line (and so meets every kernel's alignment assumption).
ALIGNMENT = 64
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@dataclass(frozen=True)
class HugePageWeights:
    """What `use_huge_pages` did: parameters and bytes moved, or why none were."""

    parameters: int
    nbytes: int
    reason: str | None = None


def thp_unavailable_reason(setting_file: Path = THP_SETTING) -> str | None:
    """Why this machine gives a mapping no transparent huge pages, or None if it does."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return f"transparent huge pages are Linux's (this is {sys.platform})"
    try:
        setting = setting_file.read_text()
    except OSError as e:
        return f"cannot read {setting_file} ({e.strerror})"
    if "[never]" in setting:
        return f"{setting_file} is 'never'"
    return None


def _movable(tensor: torch.Tensor) -> bool:
    # Packed oneDNN weights (opaque layout) and meta tensors have no bytes to copy.
    return tensor.device.type == "cpu" and tensor.layout == torch.strided and tensor.numel() > 0


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def use_huge_pages(model: nn.Module, setting_file: Path = THP_SETTING) -> HugePageWeights:
    """Move every CPU parameter of `model` into one huge-page-advised mapping, in place.

    Values, dtypes, shapes, `requires_grad` and ties between modules are kept (a parameter two
    modules share stays one); each becomes contiguous. Call after the weights are loaded (and
    packed, see `kvgraph.cpu.packed_linear`), before the model is compiled or captured: a captured
    CPU graph checks that its inputs did not move.
    """
    reason = thp_unavailable_reason(setting_file)
    params = {id(p): p for p in model.parameters() if _movable(p)}
    if reason is None and not params:
        reason = "the model has no CPU parameters"
    if reason is not None:
        logger.info("kvgraph: weights stay in 4 KiB pages: %s", reason)
        return HugePageWeights(0, 0, reason)
    try:
        tensors = huge_page_tensors([(p.shape, p.dtype) for p in params.values()])
    except OSError as e:  # before anything moved: the model is as it was
        reason = f"mapping {len(params)} parameters' memory failed ({e})"
        logger.warning("kvgraph: weights stay in 4 KiB pages: %s", reason)
        return HugePageWeights(0, 0, reason)
    holders = _holders(model, params)
    count = len(params)
    for key, data in zip(list(params), tensors):
        p = params.pop(key)  # the last reference once its modules hold the copy
        data.copy_(p.detach())
        moved = nn.Parameter(data, requires_grad=p.requires_grad)
        moved.__dict__.update(p.__dict__)  # attributes a loader may have set on it
        for module, name in holders[key]:
            module._parameters[name] = moved
        del p
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    logger.info("kvgraph: %d parameters (%.1f MiB) moved into huge-page memory",
                count, nbytes / 2**20)
    return HugePageWeights(count, nbytes)


def huge_page_tensors(layouts: Sequence[tuple[Sequence[int], torch.dtype]]
                      ) -> list[torch.Tensor]:
    """Zeroed contiguous CPU tensors of these shapes and dtypes, in one anonymous mapping
    advised `MADV_HUGEPAGE` (Linux faults its pages in as they are first written)."""
    offsets, size = [], 0
    for shape, dtype in layouts:
        offsets.append(size)
        size = _aligned(size + math.prod(shape) * dtype.itemsize, ALIGNMENT)
    # MAP_PRIVATE: an anonymous shared mapping is shmem, which follows another THP setting.
    arena = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    arena.madvise(mmap.MADV_HUGEPAGE)
    memory = torch.frombuffer(arena, dtype=torch.uint8)  # its views keep the mapping alive
    start = -memory.data_ptr() % HUGE_PAGE
    return [memory[start + offset:start + offset + math.prod(shape) * dtype.itemsize]
            .view(dtype).view(tuple(shape)) for offset, (shape, dtype) in zip(offsets, layouts)]


def _holders(model: nn.Module, params: dict[int, nn.Parameter]
             ) -> dict[int, list[tuple[nn.Module, str]]]:
    """The modules and attribute names holding each of `params` (a tied one has several)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {key: [] for key in params}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) in holders:
                holders[id(p)].append((module, name))
    return holders
