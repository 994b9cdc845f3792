"""Where a verified step's graph and eager runs part: the first layer, the first piece, or graphs.

Runs only after a failed check, so it may be slow. It reruns the step's batch, each time on the
cache blocks as they were before the step: eagerly (the model as written), compiled without
graphs, and, when those two agree, on the step's graphs. An attention probe
(`ForwardContext.probe`) records every attention call's inputs and output, named by layer;
during the compiled run every compiled piece is swapped for a recorder that also runs the
piece's FX code (after the passes) on copies of the same inputs.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from kvgraph.attention.layer_base import attention_layers
from kvgraph.config import GraphMode
from kvgraph.forward_context import BatchDescriptor
from kvgraph.runtime.platforms.base import has_storage

# The inputs each attention op hands a probe, by name.
INPUT_NAMES = {"unified_attention": ("query", "key", "value"),
               "unified_mla_attention": ("q_latent", "q_pe", "kv_c", "k_pe"),
               "encoder_attention": ("query", "key", "value")}
# View ops an FX output may be reached through (see `_allocated`).
VIEWS = ("view", "reshape", "flatten", "unflatten", "view.default", "_unsafe_view.default")


def difference(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """The largest absolute difference, and it relative to `want`'s scale (its largest finite
    magnitude). Equal values (NaN included) differ by 0; a value that is NaN on one side only,
    or a shape mismatch, differs by infinity."""
    if got.shape != want.shape:
        return float("inf"), float("inf")
    got, want = got.double(), want.double()
    same = (got == want) | (got.isnan() & want.isnan())
    delta = torch.where(same, 0.0, (got - want).abs()).nan_to_num(nan=float("inf"))
    worst = float(delta.max()) if delta.numel() else 0.0
    finite = want[want.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    return worst, worst / scale if scale else (0.0 if worst == 0 else float("inf"))


@dataclass
class AttentionCall:
    """One attention op call: its layer, its inputs and output (real tokens, copied), and the
    storage of each input (which piece produced it)."""

    layer: str
    op: str
    inputs: list[torch.Tensor]
    out: torch.Tensor
    storages: list[int]


class Probe:
    """Records every attention call of a forward; a layer's cache tensors name the layer.

    Layers that share one cache (kv sharing) are told apart by call order, in module order.
    """

    def __init__(self, model: torch.nn.Module, num_tokens: int):
        self.names: dict[int | None, list[str]] = {}
        for name, layer in attention_layers(model).items():
            cache = getattr(layer, "kv_cache", ())
            self.names.setdefault(cache[0].data_ptr() if cache else None, []).append(name)
        self.num_tokens = num_tokens
        self.calls: list[AttentionCall] = []
        self.paused = False  # a piece's FX reference run is not the forward being probed
        self._seen: Counter = Counter()

    def __call__(self, op: str, kv_cache: list[torch.Tensor], inputs: tuple[torch.Tensor, ...],
                 out: torch.Tensor) -> None:
        if self.paused:
            return
        key = kv_cache[0].data_ptr() if kv_cache else None
        names, seen = self.names.get(key, []), self._seen[key]
        self._seen[key] += 1
        layer = names[seen] if seen < len(names) else f"{op} call {len(self.calls)}"
        n = self.num_tokens
        copies = [t[:n].clone() for t in inputs]
        storages = [t.untyped_storage().data_ptr() for t in inputs]
        self.calls.append(AttentionCall(layer, op, copies, out[:n].clone(), storages))


class PieceRecorder:
    """Stands in for one compiled piece: runs its FX code on copies of the inputs, then the
    piece itself, and logs both outputs and the storages the piece's outputs live in."""

    def __init__(self, piece: Any, original: Callable, probe: Probe, shared: set[int],
                 log: list):
        self.piece, self.original, self.probe, self.shared, self.log = (
            piece, original, probe, shared, log)
        self.compared = compared_outputs(piece.graph_module)

    def __call__(self, *args: Any) -> Any:
        # Caches and weights are not copied: pieces never change weights, and a piece holding
        # attention rewrites its layer's new slots before reading them.
        copies = [a.clone() if isinstance(a, torch.Tensor)
                  and a.untyped_storage().data_ptr() not in self.shared else a for a in args]
        self.probe.paused = True
        try:
            reference = self.piece.graph_module(*copies)
        finally:
            self.probe.paused = False
        result = self.original(*args)
        self.log.append((self.piece.name, _tensors(result), _tensors(reference),
                         [c for c, value in zip(self.compared, _flat(result))
                          if isinstance(value, torch.Tensor)]))
        return result


def _flat(value: Any) -> list[Any]:
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _flat(item)]
    return [value]


def _tensors(value: Any) -> list[torch.Tensor]:
    return [leaf for leaf in _flat(value) if isinstance(leaf, torch.Tensor)]


def first_divergence(want: list[AttentionCall], got: list[AttentionCall],
                     tolerance: float) -> dict | None:
    """The first attention call of `got` whose inputs (or, failing that, output) differ from
    `want`'s by more than `tolerance` of their scale; None when every call agrees."""
    for index, (expected, call) in enumerate(zip(want, got)):
        previous = want[index - 1].layer if index else None
        if expected.layer != call.layer or len(call.inputs) != len(expected.inputs):
            return {"layer": call.layer, "index": index, "part": "order", "previous": previous}
        rels = [difference(g, w)[1] for g, w in zip(call.inputs, expected.inputs)]
        worst = max(range(len(rels)), key=rels.__getitem__)
        if rels[worst] > tolerance:
            names = INPUT_NAMES.get(call.op, ())
            return {"layer": call.layer, "index": index, "part": "inputs", "rel": rels[worst],
                    "input": names[worst] if worst < len(names) else str(worst),
                    "storage": call.storages[worst], "previous": previous}
        out_rel = difference(call.out, expected.out)[1]
        if out_rel > tolerance:
            return {"layer": call.layer, "index": index, "part": "output", "rel": out_rel,
                    "previous": previous}
    if len(want) != len(got):
        return {"layer": None, "index": min(len(want), len(got)), "part": "count",
                "previous": None}
    return None


def _allocated(node: Any) -> bool:
    """Whether an FX output is a fresh, unwritten buffer (or a view of one): the `out` an
    attention op later fills, whose values before that are whatever the memory held."""
    if not isinstance(node, torch.fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if "empty" in str(name):
        return True
    return name in VIEWS and bool(node.args) and _allocated(node.args[0])


def compared_outputs(gm: torch.fx.GraphModule) -> list[bool]:
    """For each (flattened) output of a piece, whether its values are results to compare."""
    (output,) = gm.graph.find_nodes(op="output")
    flat = torch.fx.node.map_arg(output.args[0], lambda node: node)
    nodes = list(flat) if isinstance(flat, (tuple, list)) else [flat]
    return [not _allocated(node) for node in nodes]


def _first_piece(log: list, tolerance: float) -> dict | None:
    """The first piece call whose compiled outputs differ from its FX code's."""
    for name, outputs, reference, compared in log:
        rels = [difference(o, r)[1] for o, r, c in zip(outputs, reference, compared) if c]
        if len(outputs) != len(reference) or any(r > tolerance for r in rels):
            return {"piece": name, "rel": max(rels, default=float("inf"))}
    return None


@contextlib.contextmanager
def recording(pieces: list, probe: Probe, shared: set[int], log: list) -> Iterator[None]:
    """Every piece in `pieces` replaced by a PieceRecorder for the block's duration."""
    originals = [(piece, piece.holder[piece.key]) for piece in pieces]
    for piece, original in originals:
        piece.holder[piece.key] = PieceRecorder(piece, original, probe, shared, log)
    try:
        yield
    finally:
        for piece, original in originals:
            piece.holder[piece.key] = original


def _storages(tensors: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if has_storage(t)}


def locate(runner: Any, plan: Any, blocks: Any, before: list, eager_cache: list,
           tolerance: float) -> dict:
    """Where the graph step `plan` parts from eager (see the module docstring): which run
    first differs (`part`: "compiled", "graphs" or "not reproduced"), its first differing
    attention layer and the piece that computed that layer's inputs (`layer`), and the first
    piece whose compiled output differs from its FX code (`piece_differs_from_fx`).

    `blocks.write(before)` puts the step's cache blocks back before each run; `eager_cache` is
    what the eager run wrote. The caller puts the graph's writes back afterwards.
    """
    batch, n = plan.batch, plan.batch.num_tokens
    pieces = list(getattr(getattr(runner._forward, "backend", None), "pieces", []))
    shared = _storages(t for caches in runner.kv_caches.values() for t in caches)
    shared |= _storages([*runner.model.parameters(), *runner.model.buffers()])
    log: list = []

    def rerun(mode: GraphMode, descriptor: BatchDescriptor, forward: Callable,
              record: bool = False) -> dict:
        blocks.write(before)
        step = runner._prepare(batch, mode, descriptor)
        probe = Probe(runner.model, n)
        with recording(pieces, probe, shared, log) if record else contextlib.nullcontext():
            hidden = runner._run(step, forward, probe)  # replayed when `mode` has graphs
        logits = runner.model.compute_logits(hidden[step.logits_indices])
        cache = max((difference(g, w)[1] for g, w in zip(blocks.read(), eager_cache)),
                    default=0.0)
        return {"logits": logits, "cache": cache, "calls": probe.calls, "hidden": hidden}

    eager = rerun(GraphMode.NONE, BatchDescriptor(n), runner.model)
    run = rerun(GraphMode.NONE, BatchDescriptor(n), runner._forward, record=True)
    report: dict[str, Any] = {"part": "compiled",
                              "piece_differs_from_fx": _first_piece(log, tolerance)}
    producers = {t.untyped_storage().data_ptr(): name for name, outs, *_ in log for t in outs}
    layer = first_divergence(eager["calls"], run["calls"], tolerance)
    if layer is None and max(difference(run["logits"], eager["logits"])[1],
                             run["cache"]) <= tolerance:
        # Compiled without graphs agrees: the graphs themselves are where the runs part.
        run = rerun(plan.runtime_mode, plan.descriptor, runner._forward)
        # A device's full graph replays attention without Python: no call to compare.
        report["probed"] = bool(run["calls"]) or not eager["calls"]
        layer = (first_divergence(eager["calls"], run["calls"], tolerance)
                 if report["probed"] else None)
        apart = max(difference(run["logits"], eager["logits"])[1], run["cache"]) > tolerance
        report["part"] = "graphs" if layer or apart else "not reproduced"
        producers = {}
    if (layer is None and report["part"] != "not reproduced" and eager["calls"]
            and report.get("probed", True)):
        layer = {"layer": None, "part": "after", "previous": eager["calls"][-1].layer,
                 "storage": run["hidden"].untyped_storage().data_ptr()}
    if layer is not None:
        whole = next((p.name for p in pieces if p.is_whole_graph), None)
        layer["piece"] = producers.get(layer.pop("storage", None)) or whole
    report["layer"] = layer
    return report
