"""Call mutating ops in place again after AOT functionalisation, on their base tensors.

AOTAutograd wraps a mutating custom op in `auto_functionalized_v2` and copies the results back
into the mutated graph inputs. For a KV cache that would mean a copy of the whole cache per
layer and step unless a later pass removes it; this pass removes it by construction: the op is
called directly on the bases and the copy-backs become self-copies, which are dropped.
"""

from __future__ import annotations

import operator
from typing import Collection

import torch
from torch import fx

from passes.op_match import op_name

_VIEW_SUFFIXES = ("_size", "_stride", "_storage_offset", "_slice_dim", "_slice_start",
                  "_slice_end", "_alias")


def _mutable_args(op: torch._ops.OpOverload) -> list[tuple[str, bool]]:
    """(name, is_list) of every argument the op writes to."""
    return [
        (arg.name, isinstance(arg.type, torch.ListType))
        for arg in op._schema.arguments
        if arg.alias_info is not None and arg.alias_info.is_write
    ]


def _base_of(kwargs: dict, bases: list, key: str) -> fx.Node | None:
    """The base a mutated argument is, or None when it is a view of one (left to inductor)."""
    if any(f"_{key}{suffix}" in kwargs for suffix in _VIEW_SUFFIXES):
        return None
    return bases[kwargs[f"_{key}_base_index"]]


def _inplace_call_args(node: fx.Node) -> dict | None:
    """The op's keyword arguments with every mutated argument set to its base tensor."""
    op, kwargs = node.args[0], dict(node.kwargs)
    bases = kwargs.pop("_all_bases")
    call = {k: v for k, v in kwargs.items() if not k.startswith("_")}
    for name, is_list in _mutable_args(op):
        if is_list:
            items = [_base_of(kwargs, bases, f"{name}_{i}") for i in range(kwargs[f"_{name}_length"])]
            if any(item is None for item in items):
                return None
            call[name] = items
        else:
            call[name] = _base_of(kwargs, bases, name)
            if call[name] is None:
                return None
    return call


def inplace_attention(graph: fx.Graph, op_names: Collection[str]) -> int:
    """Rewrite `auto_functionalized_v2` calls of `op_names` into direct in-place calls.

    Returns how many calls were rewritten. Calls whose mutated arguments are views, and ops
    that return values, are left for inductor's own reinplacing.
    """
    rewritten = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.higher_order.auto_functionalized_v2:
            continue
        op = node.args[0]
        if op_name(op) not in op_names or len(op._schema.returns) != 0:
            continue
        call = _inplace_call_args(node)
        if call is None:
            continue
        bases = node.kwargs["_all_bases"]
        with graph.inserting_before(node):
            graph.call_function(op, kwargs=call)
        for user in list(node.users):
            assert user.target is operator.getitem, f"unexpected user {user.format_node()}"
            # Output 0 is the op's (empty) result; output 1 + i is base i after the mutation.
            user.replace_all_uses_with(bases[user.args[1] - 1])
            graph.erase_node(user)
        graph.erase_node(node)
        rewritten += 1
    _drop_self_copies(graph)
    return rewritten


def _drop_self_copies(graph: fx.Graph) -> None:
    for node in list(graph.nodes):
        if node.target is torch.ops.aten.copy_.default and node.args[0] is node.args[1]:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
