"""How a model says what kvgraph's CPU weight transforms may do to each module's weight.

A model declares it with one attribute, `linear_packing = LinearPacking.X` (on the class or the
instance; LINEAR where it declares none); the transforms (`packed_linear.pack_linear_weights`,
`small_batch_linear.use_small_batch_linear`) record on a `READS_THROUGH_LINEAR` module the
kernel they chose, its `linear_kernel`, which its forward passes on through
`packed_linear.module_linear`. See `kvgraph.cpu.packed_linear` for the whole contract.
"""

from __future__ import annotations

import enum

from torch import nn


class LinearPacking(enum.Enum):
    """What the weight transforms may do to a module's weight: a model's declaration, the
    module's `linear_packing` attribute (LINEAR where it has none)."""

    LINEAR = "linear"  # an nn.Linear keeping its forward may be swapped for a kvgraph one
    READS_THROUGH_LINEAR = "reads through linear"  # forward calls module_linear: packed in place
    PLAIN = "plain"  # the model reads the weight as a matrix: left as it is


class LinearKernel(enum.Enum):
    """The kernel that runs a `READS_THROUGH_LINEAR` module's weight, recorded on it by the
    transforms (its `linear_kernel` attribute; TORCH where they chose none)."""

    TORCH = "F.linear"
    TILES = "kvgraph's tile kernel"
    ONEDNN = "oneDNN's packed linear"
    SMALL_BATCH = "kvgraph's small-batch kernel"


def linear_packing(module: nn.Module, path: str = "") -> LinearPacking:
    """`module`'s declared `LinearPacking` (LINEAR where it declares none); a TypeError, naming
    the module by `path` where given, for anything else."""
    packing = getattr(module, "linear_packing", LinearPacking.LINEAR)
    if not isinstance(packing, LinearPacking):
        name = f"{path} ({type(module).__name__})" if path else type(module).__name__
        raise TypeError(f"{name}.linear_packing: expected a LinearPacking ("
                        f"{', '.join(p.name for p in LinearPacking)}), got {packing!r}; declare "
                        f"it as e.g. `linear_packing = LinearPacking.PLAIN`")
    return packing


def declared_packings(model: nn.Module) -> dict[nn.Module, LinearPacking]:
    """Every module of `model` with its `LinearPacking`: all checked before a transform changes
    anything."""
    return {module: linear_packing(module, path) for path, module in model.named_modules()}


def keeps_linear_forward(module: nn.Module) -> bool:
    """Whether `module` is an `nn.Linear` running `nn.Linear`'s forward: a subclass with a
    forward of its own reads its weight itself, so swapping the module would lose that."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def linear_kernel(module: nn.Module) -> LinearKernel:
    """The kernel the transforms recorded on `module` (TORCH where they recorded none)."""
    return getattr(module, "linear_kernel", LinearKernel.TORCH)
