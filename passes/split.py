"""Split a graph at named ops: each op call becomes its own piece, the code between them others."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

from torch import fx
from torch.fx.passes.split_module import split_module

from passes.op_match import is_op_call


@dataclass(frozen=True)
class Piece:
    """One submodule of a split graph, in execution order."""

    name: str
    graph_module: fx.GraphModule
    is_splitting_op: bool


@dataclass(frozen=True)
class SplitGraph:
    split_module: fx.GraphModule
    pieces: tuple[Piece, ...]


def split_at_attention(gm: fx.GraphModule, op_names: Collection[str]) -> SplitGraph:
    """Split `gm` so every call of an op in `op_names` is a piece of its own."""
    partition_of: dict[fx.Node, int] = {}
    partition = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_op_call(node, op_names):
            partition += 1
            partition_of[node] = partition
            partition += 1
        else:
            partition_of[node] = partition

    # tuple_return: every piece returns a tuple, as compiled and cache-loaded builds both do.
    split = split_module(gm, None, lambda node: partition_of[node], keep_original_order=True,
                         tuple_return=True)
    names = {name for name, _ in split.named_children()}
    pieces = []
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target in names:
            submodule = getattr(split, node.target)
            has_op = any(is_op_call(n, op_names) for n in submodule.graph.nodes)
            pieces.append(Piece(node.target, submodule, has_op))
    return SplitGraph(split, tuple(pieces))
