"""Remove views, reshapes, expands and slices that return their input's exact shape."""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

_SHAPE_METHODS = {"view", "reshape", "expand", "contiguous"}
_SHAPE_FUNCTIONS = {
    torch.reshape,
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.slice.Tensor,
}


def _value(node: object) -> torch.Tensor | None:
    """The fake tensor a node produces (Dynamo stores `example_value`, AOT stores `val`)."""
    if not isinstance(node, fx.Node):
        return None
    value = node.meta.get("example_value", node.meta.get("val"))
    return value if isinstance(value, torch.Tensor) else None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dim() != b.dim() or a.dtype != b.dtype:
        return False
    pairs = list(zip(a.shape, b.shape)) + list(zip(a.stride(), b.stride()))
    return all(statically_known_true(x == y) for x, y in pairs)


def _is_shape_op(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _SHAPE_METHODS
    return node.op == "call_function" and node.target in _SHAPE_FUNCTIONS


def noop_elimination(gm: fx.GraphModule) -> None:
    """Replace each shape op whose output has its input's shape and strides by the input."""
    for node in list(gm.graph.nodes):
        if not _is_shape_op(node) or not node.args:
            continue
        source, out = node.args[0], _value(node)
        source_value = _value(source)
        if out is None or source_value is None or not _same_layout(source_value, out):
            continue
        node.replace_all_uses_with(source)
        gm.graph.erase_node(node)
