"""Recognising calls of a named custom op in an FX graph, whatever form the target takes."""

from __future__ import annotations

from typing import Collection

import torch
from torch import fx


def op_name(target: object) -> str | None:
    """`namespace::op` of an op packet or overload target; None for anything else."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    return None


def is_op_call(node: fx.Node, names: Collection[str]) -> bool:
    """Whether `node` calls one of the ops `names` (packet or any overload, as Dynamo and AOT emit)."""
    return node.op == "call_function" and op_name(node.target) in names


def op_exists(name: str) -> bool:
    """Whether `namespace::op` names an op registered with torch now."""
    namespace, _, op = name.partition("::")
    try:
        getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return False
    return True
