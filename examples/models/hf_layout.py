"""Where each tensor of a Hugging Face checkpoint lives in an example model.

The models' module trees are HF's except for merged linears (`qkv_proj` holds HF's `q_proj`,
`k_proj` and `v_proj` as rows of one weight) and tensor-parallel cuts (a rank holds a slice of
each full tensor). `hf_tensors` maps every HF name onto its slot: the parameter, the rows of it
the tensor fills, the full (HF) shape, and how this rank's part is cut from the full tensor. The
loader, the seeded initialisation and the HF-named export all go through it, so none of them
knows which linears are merged or sharded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .layers import MergedLinear
from .tensor_parallel import ParallelLinear


@dataclass(frozen=True)
class HFTensor:
    """One HF tensor's slot: rows `rows` of `param` (all of it when None); `full_shape` is its
    HF (unsharded) shape and `cut` takes this rank's part of a tensor of that shape."""

    param: nn.Parameter
    full_shape: torch.Size
    rows: slice | None = None
    cut: Callable[[torch.Tensor], torch.Tensor] = lambda full: full

    @property
    def target(self) -> torch.Tensor:
        """The model's tensor this HF tensor fills (a view of the parameter for a merged part)."""
        return self.param if self.rows is None else self.param[self.rows]

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of `full`, the HF tensor `name`; a ValueError if its shape is not
        the HF one (checked before cutting: a wrong shape could still hold this rank's slice)."""
        if full.shape != self.full_shape:
            which = "unsharded shape" if self.full_shape != self.target.shape else "shape"
            raise ValueError(f"{name}: expected the {which} {tuple(self.full_shape)}, "
                             f"got {tuple(full.shape)}")
        return self.cut(full)


def _merged_parts(path: str, leaf: str, module: MergedLinear, param: nn.Parameter
                  ) -> dict[str, HFTensor]:
    """The HF tensors of a merged linear's parameter `leaf`: one per part, a sibling module."""
    parent = path.rpartition(".")[0]
    tensors = {}
    for part, rows in module.part_rows():
        full_shape = torch.Size([part.features, *param.shape[1:]])
        tensors[f"{parent}.{part.name}.{leaf}"] = HFTensor(
            param, full_shape, rows, lambda full, shard=part.shard: full[shard])
    return tensors


def hf_tensors(model: nn.Module, remove_duplicate: bool = False) -> dict[str, HFTensor]:
    """Every HF tensor of `model` by HF name, in the model's parameter order (merged parts in
    their order). A tied parameter appears under each of its names, as in HF's state dict,
    unless `remove_duplicate`, which keeps its first."""
    tensors: dict[str, HFTensor] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if remove_duplicate and id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{path}.{leaf}" if path else leaf
            if isinstance(module, MergedLinear):
                tensors |= _merged_parts(path, leaf, module, param)
            elif isinstance(module, ParallelLinear):
                tensors[name] = HFTensor(param, module.full_shape(leaf),
                                         cut=lambda full, m=module, leaf=leaf: m.cut(leaf, full))
            else:
                tensors[name] = HFTensor(param, param.shape)
    return tensors


def merged_names(model: nn.Module) -> list[str]:
    """The module-tree names of the merged parameters, which HF checkpoints do not have."""
    return [f"{path}.{leaf}" for path, module in model.named_modules()
            if isinstance(module, MergedLinear) for leaf, _ in module.named_parameters()]
