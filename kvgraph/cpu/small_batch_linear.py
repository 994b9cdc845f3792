"""A decode step's few rows through a linear layer on the CPU: kvgraph's small-batch kernel.

An fp32 `nn.Linear` becomes a `SmallBatchLinear`: batches of a decode step's few rows
(`small_batch_max_rows()`: 16 with AVX-512, 48 with AVX2 only) run `kvgraph_cpu::small_batch_linear`
(small_batch_linear.cpp among the CPU kernels), which reads the weight once per call where MKL
copies it first; larger ones run `F.linear` as before. So do bf16 linears that oneDNN cannot
pack (`kvgraph.cpu.packed_linear`), their larger batches widened to fp32 for MKL (torch's own bf16
matmul is several times slower there). A module declaring `LinearPacking.READS_THROUGH_LINEAR`
keeps its class and gets the kernel recorded instead (`linear_kernel`), which its
`module_linear` call passes on (`kvgraph.cpu.packed_linear`).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from kvgraph.cpu.linear_packing import (LinearKernel, LinearPacking, declared_packings,
                                        keeps_linear_forward)
from kvgraph.cpu.packed_linear import can_pack, dtype_name
from kvgraph.cpu.tile_weights import is_tile_packed, linear_kernel_loaded

logger = logging.getLogger(__name__)


def _small_batch_linear_fake(x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@functools.cache  # builds (or loads) the kernels once; registering a fake twice is an error
def small_batch_kernel_loaded() -> bool:
    """Whether `kvgraph_cpu::small_batch_linear` is loaded (the CPU kernels build on first use);
    False, logged once, where they cannot be built."""
    return linear_kernel_loaded("small_batch_linear", _small_batch_linear_fake,
                                "fp32 linears run F.linear")


def small_batch_max_rows() -> int:
    """The most rows a small-batch call runs in kvgraph's kernel here (more go to `F.linear`):
    where the measured gain ends for this build's vectors; 0 without the kernels, or where they
    were built without AVX2 and FMA."""
    if not small_batch_kernel_loaded():
        return 0
    return torch.ops.kvgraph_cpu.small_batch_linear_max_rows()


class SmallBatchLinear(nn.Module):
    """A CPU `nn.Linear` (fp32, or bf16 where oneDNN has no bf16 kernels; same weight, same
    layout) whose batches of up to `small_batch_max_rows()` rows run kvgraph's small-batch
    kernel (more rows: MKL, bf16 widened to fp32): the module `use_small_batch_linear` puts in
    its place."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.weight = source.weight
        self.bias = source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kvgraph_cpu.small_batch_linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, small-batch kernel")


def small_batch_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes whose plain linears run the small-batch kernel: fp32, and bf16 where oneDNN
    cannot pack it (then torch's own bf16 matmul would run them, far slower)."""
    return (torch.float32,) + (() if can_pack(torch.bfloat16) else (torch.bfloat16,))


def use_small_batch_linear(model: nn.Module) -> int:
    """Make every CPU `nn.Linear` of `model` keeping its forward whose weight is plain and of a
    `small_batch_dtypes()` dtype a `SmallBatchLinear`, and record the kernel (`linear_kernel`)
    on each such module declaring `LinearPacking.READS_THROUGH_LINEAR`, in place; returns how
    many. `PLAIN` modules are left alone. Weights are not touched, so this may come before or
    after loading them (and after `pack_linear_weights`, whose packed weights are not plain).
    None where the CPU kernels cannot be built (logged)."""
    packings = declared_packings(model)
    dtypes = small_batch_dtypes()

    def takes_kernel(module: nn.Module) -> bool:
        # Tiles are strided tensors too: a module packed into them keeps the tile kernel.
        weight = getattr(module, "weight", None)
        return (isinstance(weight, torch.Tensor) and weight.layout == torch.strided
                and not is_tile_packed(weight) and weight.device.type == "cpu"
                and weight.dtype in dtypes)

    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in list(parent.named_children())
               if packings[child] is LinearPacking.LINEAR and keeps_linear_forward(child)
               and takes_kernel(child)]
    readers = [m for m in model.modules()
               if packings[m] is LinearPacking.READS_THROUGH_LINEAR and takes_kernel(m)]
    if not (linears or readers) or not small_batch_kernel_loaded():
        return 0
    for parent, name, child in linears:
        setattr(parent, name, SmallBatchLinear(child))
    for module in readers:
        module.linear_kernel = LinearKernel.SMALL_BATCH
    weights = [c.weight for *_, c in linears] + [m.weight for m in readers]
    logger.info("kvgraph: %d linears (%s) run the small-batch kernel at up to %d rows",
                len(weights), ", ".join(sorted({dtype_name(w.dtype) for w in weights})),
                small_batch_max_rows())
    return len(weights)
