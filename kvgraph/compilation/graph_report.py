"""What the debug dump says about FX graphs: node tables, what a pass changed, how a split flows."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from kvgraph.attention.op_names import ATTENTION_OPS
from passes.op_match import is_op_call
from passes.split import SplitGraph

def _kv_cache_arg(node: fx.Node) -> Any:
    """The `kv_cache` argument of an attention op call, found by its schema's name."""
    op = getattr(node.target, "default", node.target)  # an overload packet, or an overload
    names = [argument.name for argument in op._schema.arguments]
    if "kv_cache" not in names:
        return ()
    index = names.index("kv_cache")
    return node.args[index] if len(node.args) > index else node.kwargs.get("kv_cache", ())


def kv_cache_placeholders(gm: fx.GraphModule) -> set[str]:
    """The placeholders that are KV cache tensors: those an attention op gets as its cache."""
    names = set()
    for node in gm.graph.nodes:
        if not is_op_call(node, ATTENTION_OPS):
            continue
        caches = _kv_cache_arg(node)
        for value in caches if isinstance(caches, (list, tuple)) else ():
            if isinstance(value, fx.Node) and value.op == "placeholder":
                names.add(value.name)
    return names


def _value_of(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _shape_and_dtype(value: Any) -> tuple[str, str]:
    if isinstance(value, torch.Tensor):
        return "[" + ", ".join(str(d) for d in value.shape) + "]", str(value.dtype).split(".")[-1]
    if isinstance(value, (list, tuple)):
        parts = [_shape_and_dtype(v) for v in value]
        return "(" + ", ".join(p[0] for p in parts) + ")", ", ".join(dict.fromkeys(p[1] for p in parts))
    if isinstance(value, torch.SymInt):
        return str(value), "SymInt"
    return ("", type(value).__name__) if value is not None else ("", "")


def _target(node: fx.Node) -> str:
    if node.op in ("call_function", "call_method") and callable(node.target):
        return fx.node._get_qualified_name(node.target)
    return str(node.target)


def node_table(gm: fx.GraphModule) -> str:
    """A markdown table of every node: op, target, shape, dtype, and whether it is a KV cache."""
    caches = kv_cache_placeholders(gm)
    rows = ["| # | node | op | target | shape | dtype | KV cache |", "|---|---|---|---|---|---|---|"]
    for number, node in enumerate(gm.graph.nodes):
        shape, dtype = _shape_and_dtype(_value_of(node))
        target = _target(node).replace("|", "\\|")
        rows.append(f"| {number} | {node.name} | {node.op} | `{target}` | {shape} | {dtype} | "
                    f"{'yes' if node.name in caches else ''} |")
    return "\n".join(rows) + "\n"


def node_signatures(gm: fx.GraphModule) -> dict[str, str]:
    """Each node's name and what it computes (op, target, inputs): what a pass diff compares."""
    return {node.name: f"{node.op} {_target(node)} {node.args} {node.kwargs}"
            for node in gm.graph.nodes}


def pass_summary(before: dict[str, str], gm: fx.GraphModule) -> dict[str, Any]:
    """What a pass did to a graph, from the node signatures before it: nodes removed, added and
    changed (same name, other target or inputs), by name."""
    after = node_signatures(gm)
    removed = [name for name in before if name not in after]
    added = [name for name in after if name not in before]
    changed = [name for name in after if name in before and after[name] != before[name]]
    return {"nodes_before": len(before), "nodes_after": len(after), "removed": removed,
            "added": added, "changed": changed}


def _source(node: Any, piece_of: dict[fx.Node, str]) -> str:
    """Which piece (or "input") a value of the split module comes from."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        node = node.args[0]
    if isinstance(node, fx.Node):
        return piece_of.get(node, "input" if node.op == "placeholder" else node.name)
    return "constant"


def split_report(split: SplitGraph, fingerprints: dict[str, str]) -> dict[str, Any]:
    """The split: each piece in order, whether it is attention, where its inputs come from, who
    reads its outputs, and which earlier identical piece's builds it shares."""
    piece_of = {node: node.target for node in split.split_module.graph.nodes
                if node.op == "call_module"}
    readers: dict[str, list[str]] = {name: [] for name in piece_of.values()}
    first_of: dict[str, str] = {}
    pieces = []
    for node in split.split_module.graph.nodes:
        if node.op == "output":
            for value in fx.node.map_aggregate(node.args[0], lambda v: v) or ():
                source = _source(value, piece_of)
                if source in readers and "output" not in readers[source]:
                    readers[source].append("output")
        if node.op != "call_module":
            continue
        sources = list(dict.fromkeys(_source(a, piece_of) for a in node.all_input_nodes))
        for source in sources:
            if source in readers:
                readers[source].append(node.target)
        pieces.append({"name": node.target, "inputs_from": sources})
    kinds = {piece.name: piece for piece in split.pieces}
    for entry in pieces:
        piece = kinds[entry["name"]]
        fingerprint = fingerprints.get(entry["name"])
        entry.update(
            kind="attention" if piece.is_splitting_op else "compute",
            nodes=sum(1 for n in piece.graph_module.graph.nodes
                      if n.op not in ("placeholder", "output")),
            outputs_to=readers[entry["name"]],
            same_as=first_of.setdefault(fingerprint, entry["name"]) if fingerprint else None,
        )
        if entry["same_as"] == entry["name"]:
            entry["same_as"] = None
        if piece.is_splitting_op:
            entry["op"] = next(_target(n) for n in piece.graph_module.graph.nodes
                               if is_op_call(n, ATTENTION_OPS) or n.op == "call_function")
    compute = [p for p in pieces if p["kind"] == "compute"]
    return {"pieces": pieces, "attention_pieces": len(pieces) - len(compute),
            "compute_pieces": len(compute),
            "unique_compute_pieces": len({fingerprints.get(p["name"]) for p in compute})}
