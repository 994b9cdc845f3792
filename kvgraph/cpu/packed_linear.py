"""Linear weights packed once for the CPU's fast kernels, so no step repacks them.

torch's CPU linear hands oneDNN a plain `[out, in]` weight, and for bf16 and fp16 oneDNN
reorders it into its blocked layout (the one AMX and AVX-512 kernels read) on every call: a copy
of the whole weight per matmul per step. `pack_linear_weights(model)` packs each weight once, at
load:

- bf16, where the processor has AVX512-BF16 (and the weight is [16 n, 32 k]): kvgraph's own
  tile layout, a plain bf16 tensor `[out / 16, in / 2, 16, 2]` (`kvgraph.cpu.tile_weights`) read by
  `kvgraph_cpu::bf16_linear` (AVX512-BF16 dot products for a decode step's few rows, AMX tiles
  for more where the processor has AMX, dot products for every batch where it has not).
  torch's oneDNN linear costs ~35 us a call before any arithmetic, which a decode step of
  dozens of small matmuls feels (docs/performance.md, "bf16 linears").
- fp32, where it is packed (`packed_dtypes`) and the processor has AVX-512 (and the weight is
  [16 n, k]): kvgraph's fp32 tile layout `[out / 16, in, 16]`, read by `kvgraph_cpu::fp32_linear`.
- otherwise (fp16; bf16 without AVX512-BF16; fp32 without AVX-512): oneDNN's blocked layout,
  an opaque tensor (`layout=torch._mkldnn`) run by `kvgraph::packed_linear` through mkldnn's
  linear, where oneDNN has kernels for the dtype on this processor (`can_pack(dtype)`; on x86
  bf16 wants AVX-512 or AVX-NE-CONVERT: an AVX2-only CPU such as AMD Zen 3 has neither).
  Elsewhere the weights stay plain, said once in the log, and torch's matmul runs them.

A packed weight stays a parameter, so a graph input: identical layers still compile once.
(Inductor's `freezing` packs too, but makes each layer's weights constants of its own graph, so
each layer compiles anew.) Inductor lowers mkldnn's linear only on constant weights, so both
packed matmuls are ops of kvgraph's own, opaque to compilers like the attention ops; their fake
kernels give the output's shape.

How a model says how its linears may be packed: by one module attribute, `linear_packing`, a
`LinearPacking` (`kvgraph.cpu.linear_packing`; on the class or the instance). The default,
`LINEAR`, lets the transforms (`pack_linear_weights` and `use_small_batch_linear`) swap an
`nn.Linear` keeping its forward for a `PackedLinear` or a `SmallBatchLinear`. A module of its
own that reads its weight by `module_linear(x, self)` declares `READS_THROUGH_LINEAR`: its weight
is packed in place and it keeps its class, and the transforms record the kernel they chose in
the one attribute they own, `linear_kernel`, which `module_linear` passes on (traced code cannot
read a weight's layout: see `linear`). A module whose weight the model reads as a matrix
declares `PLAIN` and is left as it is. Any other value is a TypeError before anything changes.

fp32 weights stay plain (MKL's sgemm reads them as they are), except on AMD processors with
AVX-512, where kvgraph's fp32 tiles measured fastest, and oneDNN's packed fp32 linear next
(`packed_dtypes`); plain fp32 linears, and bf16 ones oneDNN cannot pack, run kvgraph's
small-batch kernel at a decode step's few rows (`kvgraph.cpu.small_batch_linear`).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from kvgraph.cpu.linear_packing import (LinearKernel, LinearPacking, declared_packings,
                                        keeps_linear_forward, linear_kernel)
from kvgraph.cpu.tile_weights import (fp32_tiles_usable, is_tile_packed, tile_linear, tile_packable,
                                  to_tiles)

logger = logging.getLogger(__name__)

# The dtypes packed everywhere by default: those whose plain matmul repacks the weight on every
# call. fp32 matmuls go to MKL's sgemm, which reads the plain weight as it is (see docs/performance.md),
# and are packed only where oneDNN's are faster (`packed_dtypes`).
PACKED_DTYPES = (torch.bfloat16, torch.float16)
CPUINFO = Path("/proc/cpuinfo")
# Rows oneDNN is told to expect when it chooses the packed layout: decode batches are small,
# and a layout chosen for them also serves prefill (measured: docs/performance.md, "Packed weights").
PACKING_BATCH_HINT = 16
TILE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}  # a PackedLinear's repr says which

_library = torch.library.Library("kvgraph", "FRAGMENT")  # ops.py owns the namespace
_library.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, SymInt out_features) -> Tensor")


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _packed_linear_fake(x, weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


# CompositeExplicitAutograd: the packed weight dispatches as MkldnnCPU, the input as CPU.
_library.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")
torch.library.register_fake("kvgraph::packed_linear", _packed_linear_fake, lib=_library)


def is_packed(weight: torch.Tensor) -> bool:
    """Whether `weight` is packed: oneDNN's opaque tensor or one of kvgraph's tile layouts."""
    return weight.layout == torch._mkldnn or is_tile_packed(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           kernel: LinearKernel | None = None) -> torch.Tensor:
    """`F.linear`, for a plain or a packed weight (a packed one knows its `[out, in]` shape), by
    `kernel`. None reads it from the weight's layout, which only eager code may do: torch
    2.11-2.13's fake tensors, which compilers trace with, do not keep oneDNN's layout, so a
    module's forward passes the kernel recorded on it (`module_linear`)."""
    if kernel is None:
        kernel = (LinearKernel.TILES if is_tile_packed(weight)
                  else LinearKernel.ONEDNN if weight.layout == torch._mkldnn
                  else LinearKernel.TORCH)
    if kernel is LinearKernel.TILES:
        return tile_linear(x, weight, bias)
    if kernel is LinearKernel.ONEDNN:
        return torch.ops.kvgraph.packed_linear(x, weight, bias, weight.shape[0])
    if kernel is LinearKernel.SMALL_BATCH:
        return torch.ops.kvgraph_cpu.small_batch_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def module_linear(x: torch.Tensor, module: nn.Module, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """`F.linear(x, module.weight, bias)` by the kernel the transforms recorded on `module`: how
    a `READS_THROUGH_LINEAR` module reads its weight. `bias` is the caller's (a row-parallel
    linear adds its own after the sum over ranks)."""
    return linear(x, module.weight, bias, linear_kernel(module))


# oneDNN's checks of the processor for its reduced-precision kernels (packing and matmul); without
# them `_reorder_linear_weight` raises, and torch's plain matmul serves the dtype.
ONEDNN_NEEDS = ("x86 bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, fp16 AVX-512-FP16 or "
                "AVX-NE-CONVERT")
_ONEDNN_DTYPE_CHECKS = {
    torch.bfloat16: lambda: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    torch.float16: lambda: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
}


def can_pack(dtype: torch.dtype | None = None) -> bool:
    """Whether this torch has oneDNN (every x86 and Arm CPU build of torch does) and, given a
    `dtype`, whether oneDNN packs weights of it on this processor."""
    if not torch.backends.mkldnn.is_available():
        return False
    check = _ONEDNN_DTYPE_CHECKS.get(dtype)
    return check is None or bool(check())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (`[out, in]`, on the CPU) packed once: its dtype's tile layout where
    `tile_packable` (kvgraph.cpu.tile_weights), else oneDNN's blocked layout."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        raise ValueError(f"pack_weight: expected a 2-D CPU weight, got {tuple(weight.shape)} on "
                         f"{weight.device}")
    weight = weight.detach().contiguous()
    if tile_packable(weight):
        return to_tiles(weight)
    if not can_pack(weight.dtype):
        raise ValueError(f"pack_weight: oneDNN cannot pack {dtype_name(weight.dtype)} weights "
                         f"on this processor ({_cpu_capability()}: {ONEDNN_NEEDS}); leave "
                         f"them plain (torch's matmul runs them)")
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_BATCH_HINT)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cpu_capability() -> str:
    return f"torch's CPU capability: {torch.backends.cpu.get_cpu_capability()}"


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight is packed: the module `pack_linear_weights` puts in its place."""

    def __init__(self, source: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = source.in_features, source.out_features
        self.weight = nn.Parameter(pack_weight(source.weight), requires_grad=False)
        self.bias = source.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)  # inference only: the op has no backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_tile_packed(self.weight):
            return tile_linear(x, self.weight, self.bias)
        return torch.ops.kvgraph.packed_linear(x, self.weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        layout = (f"{TILE_NAMES[self.weight.dtype]} tiles" if is_tile_packed(self.weight)
                  else "oneDNN")
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed ({layout})")


def cpu_vendor(cpuinfo: Path | None = None) -> str:
    """The processor's vendor as Linux names it ("GenuineIntel", "AuthenticAMD"), or "" where
    /proc/cpuinfo (or `cpuinfo`) does not say."""
    try:
        text = (cpuinfo or CPUINFO).read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            return value.strip()
    return ""


@functools.cache
def packed_dtypes() -> tuple[torch.dtype, ...]:
    """The dtypes `pack_linear_weights` packs by default here: bf16 and fp16 (their plain matmul
    repacks the weight on every call), and fp32 on an AMD processor with AVX-512. On a Zen 4
    kvgraph's fp32 tiles beat oneDNN's packed fp32 linear up to 64 rows (0.49x its time at 1
    row, 0.88x at 16) and matched it at prefill sizes, and oneDNN's beat both MKL's sgemm and
    kvgraph's small-batch kernel at every batch size, where on an Intel Xeon oneDNN's lost to
    both at a decode step's rows and the tiles have not run (docs/performance.md, "fp32 linears"): a rule
    from the processors measured, not a law."""
    amd_avx512 = (torch.backends.cpu.get_cpu_capability().startswith("AVX512")
                  and cpu_vendor() == "AuthenticAMD"
                  and (fp32_tiles_usable() or can_pack(torch.float32)))
    if amd_avx512:
        logger.info("kvgraph: fp32 linear weights are packed too (an AMD processor with "
                    "AVX-512), in %s", "kvgraph's fp32 tiles" if fp32_tiles_usable()
                    else "oneDNN's layout (kvgraph's fp32 kernel is not built)")
    return PACKED_DTYPES + ((torch.float32,) if amd_avx512 else ())


def pack_linear_weights(model: nn.Module, dtypes: tuple[torch.dtype, ...] | None = None) -> int:
    """Pack the weight of every CPU linear of `model` whose dtype is in `dtypes` (by default
    `packed_dtypes()`), in place; returns how many were packed.

    What each module may take is its `LinearPacking` (the module docstring): an `nn.Linear`
    keeping its forward becomes a `PackedLinear`; a `READS_THROUGH_LINEAR` module keeps its class,
    its weight packed in place and the kernel recorded (`linear_kernel`); a `PLAIN` one is left
    alone. Call after loading weights: a packed weight no longer takes `load_state_dict`.
    """
    packings = declared_packings(model)
    if not can_pack():
        logger.info("kvgraph: this torch has no oneDNN; linear weights stay unpacked")
        return 0
    dtypes = packed_dtypes() if dtypes is None else dtypes
    packed, unpackable = 0, {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            weight, packing = getattr(child, "weight", None), packings[child]
            if (not isinstance(weight, torch.Tensor) or weight.device.type != "cpu"
                    or weight.dtype not in dtypes or is_packed(weight)
                    or packing is LinearPacking.PLAIN):
                continue
            in_place = packing is LinearPacking.READS_THROUGH_LINEAR
            if not (in_place or keeps_linear_forward(child)):
                continue
            if not (tile_packable(weight) or can_pack(weight.dtype)):
                unpackable[weight.dtype] = unpackable.get(weight.dtype, 0) + 1
                continue
            if in_place:
                child.weight = nn.Parameter(pack_weight(weight), requires_grad=False)
                child.linear_kernel = (LinearKernel.TILES if is_tile_packed(child.weight)
                                       else LinearKernel.ONEDNN)
            else:
                setattr(parent, name, PackedLinear(child))
            packed += 1
    if unpackable:
        logger.warning("kvgraph: oneDNN cannot pack %s weights on this processor (%s: %s); they "
                       "stay plain (use_small_batch_linear gives bf16 ones kvgraph's kernel)",
                       ", ".join(f"{n} {dtype_name(d)}" for d, n in unpackable.items()),
                       _cpu_capability(), ONEDNN_NEEDS)
    logger.info("kvgraph: packed %d linear weights (%s)", packed,
                ", ".join(map(dtype_name, dtypes)) or "no dtype")
    return packed
