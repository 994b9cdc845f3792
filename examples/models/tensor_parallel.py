"""Tensor parallelism for the example models, applied from outside their code (gpt-fast's way).

    model = Llama.from_hf(config, state_dict, tp=kvgraph.distributed.tensor_parallel_group())

does it all: `shard_model` swaps each rank's linears for parallel ones and sets the local head
counts of the model's kvgraph attention layers; the HF loader then cuts each full tensor to
this rank's part (hf_layout.py). What is cut, and how, is the one table `SPLITS` (vLLM's rules),
by HF linear name: attention projections by heads (Llama's KV heads replicated when there are
fewer than ranks), MLP projections by columns, the projections back into the residual stream
(`o_proj`, `down_proj`) by rows, all-reduced; everything else (embeddings, lm_head, norms, MLA's
latent projections) is replicated. A merged linear (`qkv_proj`, `gate_up_proj`) is cut part by
part under the same rules: rank r holds `[q_r, k_r, v_r]`. At size 1 nothing changes: the same
modules, no collectives.

The models read their head counts from their kvgraph layers, or infer them from the shapes of
their (now local) projections, so setting the layers' counts is all their forward needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

import kvgraph
from kvgraph.distributed import TensorParallelGroup, all_reduce
from kvgraph.cpu.linear_packing import LinearPacking, linear_packing
from kvgraph.cpu.packed_linear import module_linear

from .layers import MergedLinear


@dataclass(frozen=True)
class Split:
    """How one HF linear is cut across ranks: along `dim` (0: its outputs, the column-parallel
    cut; 1: its inputs, the row-parallel one) into the `units` that the config field of that
    name counts (heads, or single features), each rank taking whole units. With `replicate`,
    fewer units than ranks is allowed: each unit is then held by world_size // units ranks."""

    dim: int
    units: str
    replicate: bool = False


# Each HF linear that is cut, by the last part of its HF module name (a merged linear's parts
# by theirs); every other one is replicated.
SPLITS: dict[str, Split] = {
    "q_proj": Split(0, "num_attention_heads"),      # Llama, and MLA with a full-rank query
    "k_proj": Split(0, "num_key_value_heads", replicate=True),
    "v_proj": Split(0, "num_key_value_heads", replicate=True),
    "o_proj": Split(1, "num_attention_heads"),
    "q_b_proj": Split(0, "num_attention_heads"),    # MLA: the per-head up-projections
    "kv_b_proj": Split(0, "num_attention_heads"),
    "gate_proj": Split(0, "intermediate_size"),
    "up_proj": Split(0, "intermediate_size"),
    "down_proj": Split(1, "intermediate_size"),
}


def shard_units(units: int, rank: int, world_size: int) -> tuple[int, int]:
    """`(first, count)`: the units (heads) rank `rank` holds of `units` over `world_size` ranks.

    An even share when `world_size` divides `units`; else one unit, `rank // (world_size //
    units)`, which is replication (the caller has checked `units` divides `world_size`).
    """
    if units >= world_size:
        count = units // world_size
        return rank * count, count
    return rank // (world_size // units), 1


def check_units(what: str, units: int, world_size: int, replicate: bool = False) -> None:
    """A ValueError unless `units` (named `what`) can be shared out over `world_size` ranks."""
    if units % world_size == 0 or (replicate and world_size % units == 0):
        return
    also = ", nor is it a multiple of it (which would replicate them)" if replicate else ""
    raise ValueError(f"tensor-parallel size {world_size} does not divide {what} ({units}){also}; "
                     f"choose a tensor-parallel size that does")


class ParallelLinear(nn.Linear):
    """A linear holding one rank's part of a full `[out_features, in_features]` weight: the
    `shard` (a slice) of its dim `dim`, of `full_features`; `in_features`/`out_features` are
    the local sizes. `shard` None: an even share by rank."""

    dim: ClassVar[int]

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 tp: TensorParallelGroup, shard: slice | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        sizes = [out_features, in_features]
        full = sizes[self.dim]
        if shard is None:
            check_units(f"{type(self).__name__}'s {('out', 'in')[self.dim]}_features", full,
                        tp.world_size)
            share = full // tp.world_size
            shard = slice(tp.rank * share, (tp.rank + 1) * share)
        if not 0 <= shard.start < shard.stop <= full:
            raise ValueError(f"{type(self).__name__}: shard {shard} is not inside 0..{full}")
        sizes[self.dim] = shard.stop - shard.start
        super().__init__(sizes[1], sizes[0], bias, device=device, dtype=dtype)
        self.tp, self.shard, self.full_features = tp, shard, full

    @classmethod
    def from_linear(cls, linear: nn.Linear, tp: TensorParallelGroup,
                    shard: slice | None = None) -> ParallelLinear:
        """This rank's part of `linear`, its weights cut from it (a meta linear gives a meta one)."""
        with torch.device("meta"):  # no initialisation to run: every parameter is replaced
            new = cls(linear.in_features, linear.out_features, linear.bias is not None, tp=tp,
                      shard=shard, dtype=linear.weight.dtype)
        for name, full in linear.named_parameters(recurse=False):
            part = new.cut(name, full.detach()).clone(memory_format=torch.contiguous_format)
            setattr(new, name, nn.Parameter(part, requires_grad=full.requires_grad))
        if linear_packing(linear) is LinearPacking.PLAIN:  # read as a matrix, cut or whole
            new.linear_packing = LinearPacking.PLAIN
        return new

    def cut(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full tensor of parameter `name` ("weight" or "bias")."""
        if name == "bias" and self.dim == 1:
            return full  # a row-parallel bias is added once, after the reduce
        return full.narrow(self.dim if name == "weight" else 0, self.shard.start,
                           self.shard.stop - self.shard.start)

    def full_shape(self, name: str) -> torch.Size:
        """The shape of parameter `name` before it was cut."""
        shape = list(getattr(self, name).shape)
        dim = self.dim if name == "weight" else 0
        if name == "weight" or self.dim == 0:
            shape[dim] = self.full_features
        return torch.Size(shape)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {('out', 'in')[self.dim]} {self.shard.start}:"
                f"{self.shard.stop} of {self.full_features}, rank {self.tp.rank} of "
                f"{self.tp.world_size}")


class ColumnParallelLinear(ParallelLinear):
    """A linear split by output features: this rank's outputs, nothing exchanged."""

    dim = 0


class MergedColumnParallelLinear(MergedLinear):
    """A merged linear holding one rank's share of each part, concatenated: rank r computes
    `[q_r, k_r, v_r]` (a replicated part whole), nothing exchanged."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = True, *,
                 tp: TensorParallelGroup, shards: dict[str, slice],
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__(in_features, parts, bias, shards=shards, device=device, dtype=dtype)
        self.tp = tp

    @classmethod
    def from_merged(cls, linear: MergedLinear, tp: TensorParallelGroup,
                    shards: dict[str, slice]) -> MergedColumnParallelLinear:
        """This rank's part of the whole merged `linear`, its weights cut from it."""
        parts = {part.name: part.features for part in linear.parts}
        with torch.device("meta"):  # no initialisation to run: every parameter is replaced
            new = cls(linear.in_features, parts, linear.bias is not None, tp=tp, shards=shards,
                      dtype=linear.weight.dtype)
        for name, full in linear.named_parameters(recurse=False):
            setattr(new, name, nn.Parameter(new.cut(full.detach()),
                                            requires_grad=full.requires_grad))
        return new

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank {self.tp.rank} of {self.tp.world_size}"


class RowParallelLinear(ParallelLinear):
    """A linear split by input features: each rank's partial product, summed over the ranks
    (`kvgraph.distributed.all_reduce`); the bias is added once, after the sum."""

    dim = 1

    # Its weight may be packed in place (kvgraph.cpu.packed_linear): forward reads it through
    # module_linear, the bias left for after the sum.
    linear_packing = LinearPacking.READS_THROUGH_LINEAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = all_reduce(module_linear(x, self), self.tp)
        return out if self.bias is None else out + self.bias


def shard_model(model: nn.Module, tp: TensorParallelGroup) -> nn.Module:
    """Shard `model` (in place; also returned) for rank `tp.rank` of `tp.world_size`.

    The linears named in `SPLITS` become parallel ones holding this rank's part of their weights
    (cut from them: a model on the meta device stays there, for the loader to fill), and every
    kvgraph attention layer gets the local head counts. `model.config` gives the unit counts. A
    size that does not fit the model is a ValueError before anything changes; size 1 changes
    nothing.
    """
    if tp.world_size == 1:
        return model
    sharded = (ParallelLinear, MergedColumnParallelLinear)
    if any(isinstance(m, sharded) for m in model.modules()):
        raise ValueError(f"{type(model).__name__} is already sharded")
    plan = _plan_linears(model, tp)
    heads = _plan_heads(model, tp)
    for path, new in plan.items():
        parent, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
    for layer, counts in heads.items():
        for attr, count in counts.items():
            setattr(layer, attr, count)
    return model


def _shard(model: nn.Module, split: Split, full: int, tp: TensorParallelGroup) -> slice:
    """The slice of `full` features that rank `tp.rank` holds under `split` (checked)."""
    units = getattr(model.config, split.units)
    check_units(f"{type(model).__name__}'s {split.units}", units, tp.world_size, split.replicate)
    assert full % units == 0, (full, units)  # the config built these shapes
    first, count = shard_units(units, tp.rank, tp.world_size)
    size = full // units
    return slice(first * size, (first + count) * size)


def _plan_merged(model: nn.Module, module: MergedLinear, tp: TensorParallelGroup
                 ) -> MergedColumnParallelLinear | None:
    """A merged linear's parallel replacement, each part cut by its `SPLITS` rule (a part
    without one whole); None when no part is cut."""
    shards = {}
    for part in module.parts:
        split = SPLITS.get(part.name)
        if split is not None:
            # A merged linear concatenates outputs, so only output-dim (column) cuts compose.
            assert split.dim == 0, (part.name, split)
            shards[part.name] = _shard(model, split, part.features, tp)
    return MergedColumnParallelLinear.from_merged(module, tp, shards) if shards else None


def _plan_linears(model: nn.Module, tp: TensorParallelGroup
                  ) -> dict[str, ParallelLinear | MergedColumnParallelLinear]:
    """Each linear cut by `SPLITS`, by module path, with its parallel replacement (checked)."""
    plan: dict[str, ParallelLinear | MergedColumnParallelLinear] = {}
    for path, module in model.named_modules():
        if isinstance(module, MergedLinear):
            if (merged := _plan_merged(model, module, tp)) is not None:
                plan[path] = merged
            continue
        split = SPLITS.get(path.rpartition(".")[2])
        if split is None or not isinstance(module, nn.Linear):
            continue
        full = (module.out_features, module.in_features)[split.dim]
        parallel = ColumnParallelLinear if split.dim == 0 else RowParallelLinear
        plan[path] = parallel.from_linear(module, tp, _shard(model, split, full, tp))
    return plan


def _plan_heads(model: nn.Module, tp: TensorParallelGroup) -> dict[nn.Module, dict[str, int]]:
    """The local head counts of each kvgraph attention layer (KV heads may be replicated)."""
    plan: dict[nn.Module, dict[str, int]] = {}
    for name, layer in kvgraph.attention_layers(model).items():
        counts = {"num_heads": (layer.num_heads, False)}
        if isinstance(layer, kvgraph.Attention):
            counts["num_kv_heads"] = (layer.num_kv_heads, True)
        plan[layer] = {}
        for attr, (units, replicate) in counts.items():
            check_units(f"{name}.{attr}", units, tp.world_size, replicate)
            plan[layer][attr] = shard_units(units, tp.rank, tp.world_size)[1]
    return plan
