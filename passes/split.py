"""Split a graph at named ops: each op call becomes its own piece, the code between them others."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Collection

from torch import fx
from torch.fx.passes.split_module import split_module

from passes.collectives import keep_waits_with_collectives
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
    """Split `gm` so every call of an op in `op_names` is a piece of its own.

    A collective's `wait_tensor` goes with the collective: into its piece, or, when the
    collective is one of `op_names`, into that op's piece.
    """
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
    keep_waits_with_collectives(partition_of)

    # Every piece returns a tuple, as compiled and cache-loaded builds both do.
    split = split_module_tuple_return(gm, lambda node: partition_of[node])
    names = {name for name, _ in split.named_children()}
    pieces = []
    for node in split.graph.nodes:
        if node.op == "call_module" and node.target in names:
            submodule = getattr(split, node.target)
            has_op = any(is_op_call(n, op_names) for n in submodule.graph.nodes)
            pieces.append(Piece(node.target, submodule, has_op))
    return SplitGraph(split, tuple(pieces))


def split_module_tuple_return(gm: fx.GraphModule, split_callback: Callable[[fx.Node], int]
                              ) -> fx.GraphModule:
    """`split_module(..., keep_original_order=True)` where every piece returns a tuple.

    What `tuple_return=True` does on torch 2.13+, done here on every supported torch (2.11 and
    2.12 lack the keyword): a piece with one output returns it bare, so it is made to return
    `(value,)` and the parent reads element 0. Pieces with several outputs or none already
    return tuples.
    """
    split = split_module(gm, None, split_callback, keep_original_order=True)
    for node in list(split.graph.nodes):
        if node.op != "call_module":
            continue
        piece = split.get_submodule(node.target)
        (output,) = piece.graph.find_nodes(op="output")
        if isinstance(output.args[0], (tuple, list)):
            continue
        output.args = ((output.args[0],),)
        piece.recompile()
        with split.graph.inserting_after(node):
            first = split.graph.call_function(operator.getitem, (node, 0))
        node.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
    split.recompile()
    return split
