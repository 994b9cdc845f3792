"""kvgraph's own tile layouts for CPU linear weights, the kernels that read them, and where
those kernels run.

A weight in a tile layout is an ordinary tensor (a parameter, so a graph input: identical layers
still compile once), its outputs in column blocks of 16 whose rows are 64 bytes, the width of
an AVX-512 register:

- bf16 `[out / 16, in / 2, 16, 2]`: 16 outputs' weights for a pair of inputs a row, what
  AVX512-BF16's dot product and an AMX tile read (`kvgraph_cpu::bf16_linear`, bf16_linear.cpp),
  where the processor has AVX512-BF16; `in` a multiple of 32 (an AMX tile's depth).
- fp32 `[out / 16, in, 16]`: 16 outputs' weights for one input a row, read by fused
  multiply-adds (`kvgraph_cpu::fp32_linear`, fp32_linear.cpp), where it has AVX-512.

Both kernels share one loop (tile_matmul.h). `kvgraph.cpu.packed_linear` decides which weights
are packed, and into which layout.
"""

from __future__ import annotations

import functools
import logging

import torch

from kvgraph.cpu.build import KernelBuildError, load_kernels

logger = logging.getLogger(__name__)

# Outputs per column block; bf16 inputs per AMX tile row (a bf16 weight's `in` divides by it).
TILE_OUTPUTS, TILE_DEPTH = 16, 32


def _tile_linear_fake(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                      ) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0] * TILE_OUTPUTS)


def linear_kernel_loaded(op: str, fake, fallback: str) -> bool:
    """Whether kvgraph's CPU kernels are loaded (built on first use), with `op`'s fake kernel
    registered; False, logged with what runs instead (`fallback`), where they cannot be built."""
    try:
        load_kernels()
    except KernelBuildError as error:
        logger.warning("kvgraph: %s: %s", fallback, error)
        return False
    torch.library.register_fake(f"kvgraph_cpu::{op}", fake)
    return True


@functools.cache  # builds (or loads) the kernels once; registering a fake twice is an error
def bf16_tiles_usable() -> bool:
    """Whether bf16 weights pack into kvgraph's tile layout here: the CPU kernels build and the
    processor has AVX512-BF16 (then AMX too where Linux grants its tiles). False, logged once,
    otherwise."""
    if not linear_kernel_loaded("bf16_linear", _tile_linear_fake, "bf16 linears run oneDNN's"):
        return False
    level = torch.ops.kvgraph_cpu.bf16_linear_level()
    if level == 2:
        logger.info("kvgraph: bf16 linears run kvgraph's kernel (AVX512-BF16 and AMX)")
    elif level == 1:
        # Measured on a Zen 4 (docs/performance.md, "bf16 linears"): ahead of oneDNN's packed linear up to
        # 64 rows, level with it at prefill sizes, where both are bound by the same dot products.
        logger.info("kvgraph: bf16 linears run kvgraph's AVX512-BF16 kernel (no AMX here)")
    else:  # kvgraph.cpu.packed_linear says what runs them instead
        logger.info("kvgraph: no AVX512-BF16 here: bf16 weights do not take kvgraph's tiles")
    return level > 0


@functools.cache
def fp32_tiles_usable() -> bool:
    """Whether fp32 weights can pack into kvgraph's fp32 tile layout here: the CPU kernels build
    with AVX-512. False, logged once, otherwise."""
    if not linear_kernel_loaded("fp32_linear", _tile_linear_fake,
                                "fp32 linears run oneDNN's or MKL's"):
        return False
    usable = torch.ops.kvgraph_cpu.fp32_linear_level() > 0
    if not usable:
        logger.info("kvgraph: no fp32 tile kernel here (it needs AVX-512)")
    return usable


def is_tile_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` is in one of kvgraph's tile layouts: bf16 `[out / 16, in / 2, 16, 2]`
    or fp32 `[out / 16, in, 16]`."""
    if weight.dtype == torch.bfloat16:
        return weight.dim() == 4 and tuple(weight.shape[2:]) == (TILE_OUTPUTS, 2)
    return (weight.dtype == torch.float32 and weight.dim() == 3
            and weight.shape[2] == TILE_OUTPUTS)


def tile_packable(weight: torch.Tensor) -> bool:
    """Whether `weight` (`[out, in]`) can take its dtype's tile layout here: bf16 `[16 n, 32 k]`
    with AVX512-BF16, fp32 `[16 n, k]` with AVX-512."""
    out_features, in_features = weight.shape
    if out_features % TILE_OUTPUTS:
        return False
    if weight.dtype == torch.bfloat16:
        return in_features % TILE_DEPTH == 0 and bf16_tiles_usable()
    return weight.dtype == torch.float32 and fp32_tiles_usable()


def to_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A contiguous `[out, in]` weight that is `tile_packable`, in its dtype's tile layout."""
    out_features, in_features = weight.shape
    blocks = out_features // TILE_OUTPUTS
    if weight.dtype == torch.bfloat16:
        return (weight.view(blocks, TILE_OUTPUTS, in_features // 2, 2)
                .permute(0, 2, 1, 3).contiguous())
    return weight.view(blocks, TILE_OUTPUTS, in_features).transpose(1, 2).contiguous()


def from_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A tile-packed weight laid back as a plain `[out, in]` tensor (a copy)."""
    if weight.dtype == torch.bfloat16:
        blocks, pairs, outputs, _ = weight.shape
        return weight.permute(0, 2, 1, 3).reshape(blocks * outputs, pairs * 2)
    blocks, in_features, outputs = weight.shape
    return weight.transpose(1, 2).reshape(blocks * outputs, in_features)


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                ) -> torch.Tensor:
    """`F.linear` for a tile-packed weight, by its dtype's kernel."""
    if weight.dtype == torch.bfloat16:
        return torch.ops.kvgraph_cpu.bf16_linear(x, weight, bias)
    return torch.ops.kvgraph_cpu.fp32_linear(x, weight, bias)
