"""Verify mode: a graph step checked against the model as written, on the same batch and blocks.

With `CompilationConfig.verify`, the ModelRunner hands the first step of each descriptor that
runs on graphs (runtime mode piecewise or full), and every `verify_every`-th step it executes
when that one runs on graphs, to its `Verifier`. The verifier snapshots the cache blocks the
step touches (every layer's tensors), runs the step on its graphs, snapshots what the graphs
wrote, puts the blocks back, runs the same batch eagerly (`runner.model`: no compile, no
graphs, the same attention backend), snapshots what eager wrote, and puts the graph's writes
back: the caches, the persistent inputs and `runner.hidden_states` are then what they would be
without the check. It compares the logits (each request's last token) and the touched cache
blocks, records the result per descriptor, and above the tolerance finds where the two runs
part (kvgraph.runtime.verify_locate) and logs a warning or raises VerifyError.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvgraph.config import GraphMode
from kvgraph.errors import VerifyError
from kvgraph.forward_context import BatchDescriptor, KVLayerHooks
from kvgraph.runtime.graphs import graph_key
from kvgraph.runtime.step import Step, StepPlan
from kvgraph.runtime.verify_locate import difference, locate

logger = logging.getLogger(__name__)

# The largest difference accepted, relative to the eager values' scale, by the logits' dtype.
# Measured with inductor pieces against eager (piecewise, full_and_piecewise and full graphs,
# CPU), worst of logits and cache writes: the tiny Llama and DeepSeek MLA presets differ by
# 3e-7 in float32, 8e-3 in bfloat16, 1.3e-3 in float16; the 8-layer "small" Llama by 1.2e-6,
# 1.5e-2 and 1.7e-3 (MLA small bfloat16: 1.8e-2). Inductor computes fused pointwise code in
# float32 where eager rounds every op to the dtype, and the gap grows with depth, hence ~5x
# above the small models (~100x in float32). Float64 models measured 1.9e-7, not 1e-15: the
# example models compute RMSNorm and RoPE in float32, which inductor does not round alike.
DEFAULT_TOLERANCES = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 2e-2,
                      torch.bfloat16: 1e-1}
FALLBACK_TOLERANCE = 1e-1  # any other dtype: the coarsest of the above
MAX_FLIPS_KEPT = 8  # greedy-token changes kept per descriptor (the count is kept in full)


def default_tolerance(dtype: torch.dtype) -> float:
    """The tolerance verify uses for logits of `dtype` when `verify_tolerance` is unset."""
    return DEFAULT_TOLERANCES.get(dtype, FALLBACK_TOLERANCE)


class TouchedBlocks:
    """The cache blocks one step's requests use, in every cache tensor: read out, written back."""

    def __init__(self, kv_caches: dict, plan: StepPlan, device: torch.device):
        self.tensors: dict[int, tuple[str, torch.Tensor]] = {}
        for name, caches in kv_caches.items():
            for i, tensor in enumerate(caches):  # layers sharing a tensor copy it once
                self.tensors.setdefault(tensor.data_ptr(), (f"{name}[{i}]", tensor))
        blocks = np.unique(plan.batch.used_blocks).astype(np.int64)  # index_copy_ wants int64
        self.index = torch.as_tensor(blocks, device=device)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.tensors.values()]

    def read(self) -> list[torch.Tensor]:
        return [tensor.index_select(0, self.index) for _, tensor in self.tensors.values()]

    def write(self, saved: list[torch.Tensor]) -> None:
        for (_, tensor), blocks in zip(self.tensors.values(), saved):
            tensor.index_copy_(0, self.index, blocks)


@dataclass
class DescriptorRecord:
    """Every check of one descriptor: the worst differences seen, flips and failures."""

    checks: int = 0
    failures: int = 0
    max_abs: float = 0.0  # logits, absolute
    max_rel: float = 0.0  # logits, relative to the eager logits' scale
    cache_max_abs: float = 0.0
    cache_max_rel: float = 0.0
    token_flips: int = 0
    flips: list[dict] = field(default_factory=list)
    tolerance: float = 0.0
    passed: bool = True  # every check passed
    where: str | None = None  # the last failure's location

    def add(self, check: dict) -> None:
        self.checks += 1
        self.failures += not check["passed"]
        self.passed = self.passed and check["passed"]
        for name in ("max_abs", "max_rel", "cache_max_abs", "cache_max_rel"):
            setattr(self, name, max(getattr(self, name), check[name]))
        self.token_flips += len(check["flips"])
        self.flips = (self.flips + check["flips"])[:MAX_FLIPS_KEPT]
        self.tolerance = check["tolerance"]
        if check.get("where"):
            self.where = check["where"]["summary"]


def token_flips(graph: torch.Tensor, eager: torch.Tensor, tolerance: float) -> list[dict]:
    """Rows whose greedy token changed, each with eager's top-1/top-2 margin: a `near_tie` is
    a margin a difference within `tolerance` of the logits' scale could overturn."""
    if eager.shape[-1] < 2:
        return []
    top = eager.double().topk(2, dim=-1)
    graph_tokens = graph.argmax(-1)
    scale = float(eager.double().abs().max()) or 1.0
    flips = []
    for row in torch.nonzero(graph_tokens != top.indices[:, 0]).flatten().tolist():
        margin = float(top.values[row, 0] - top.values[row, 1])
        flips.append({"row": row, "eager_token": int(top.indices[row, 0]),
                      "graph_token": int(graph_tokens[row]), "eager_margin": margin,
                      "near_tie": margin <= 2 * tolerance * scale})
    return flips


def compare(graph: torch.Tensor, eager: torch.Tensor, graph_cache: list, eager_cache: list,
            names: list[str], tolerance: float) -> dict:
    """One check: logits and touched cache blocks, graph against eager."""
    max_abs, max_rel = difference(graph, eager)
    cache = [(*difference(g, e), name) for g, e, name in zip(graph_cache, eager_cache, names)]
    cache_abs, cache_rel, cache_worst = max(cache, key=lambda c: c[1], default=(0.0, 0.0, None))
    return {"max_abs": max_abs, "max_rel": max_rel, "cache_max_abs": cache_abs,
            "cache_max_rel": cache_rel, "cache_worst": cache_worst, "tolerance": tolerance,
            "flips": token_flips(graph, eager, tolerance),
            "passed": max_rel <= tolerance and cache_rel <= tolerance}


class Verifier:
    """One runner's verify mode (see the module docstring): which steps to check, the checks,
    and the per-descriptor table `stats()` reports."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.records: dict[str, DescriptorRecord] = {}
        self.steps = 0  # steps the runner executed, checked or not
        if not runner.config.graph_mode.has_graphs:
            logger.warning("kvgraph: verify is on, but graph_mode %r runs no graphs, so there is "
                           "nothing to check against eager", runner.config.graph_mode.value)

    def wants(self, step: Step) -> bool:
        """Whether `step` is checked: the first graph step of its descriptor, or every
        `verify_every`-th executed step that runs on graphs."""
        self.steps += 1
        mode = step.plan.runtime_mode
        if not mode.has_graphs:
            return False
        every = self.runner.config.verify_every
        return (graph_key(mode, step.plan.descriptor) not in self.records
                or bool(every and self.steps % every == 0))

    def run(self, step: Step, kv_hooks: KVLayerHooks | None = None) -> torch.Tensor:
        """Run `step` on its graphs, check it against eager; its (the graph's) logits.

        `kv_hooks` (a layer-by-layer KV connector's) see the graph run only: it is the step's."""
        runner, plan = self.runner, step.plan
        blocks = TouchedBlocks(runner.kv_caches, plan, runner.device)
        before = blocks.read()
        hidden = runner._run(step, kv_hooks=kv_hooks)
        logits = runner.model.compute_logits(hidden[step.logits_indices])
        graph_cache = blocks.read()
        saved_hidden = None
        try:
            blocks.write(before)
            eager_step = runner._prepare(plan.batch, GraphMode.NONE,
                                         BatchDescriptor(plan.batch.num_tokens))
            eager_hidden = runner._run(eager_step, runner.model)
            eager = runner.model.compute_logits(eager_hidden[eager_step.logits_indices])
            eager_cache = blocks.read()
            tolerance = runner.config.verify_tolerance or default_tolerance(eager.dtype)
            check = compare(logits, eager, graph_cache, eager_cache, blocks.names, tolerance)
            if not check["passed"]:
                saved_hidden = hidden.clone()  # locating replays the graphs into `hidden`
                where = locate(runner, plan, blocks, before, eager_cache, tolerance)
                where["summary"] = where_summary(where, graph_key(plan.runtime_mode,
                                                                  plan.descriptor))
                check["where"] = where
        finally:
            blocks.write(graph_cache)
            runner._prepare(plan.batch, plan.runtime_mode, plan.descriptor)
            if saved_hidden is not None:
                hidden.copy_(saved_hidden)
            runner.hidden_states = hidden
        self._record(graph_key(plan.runtime_mode, plan.descriptor), check)
        return logits

    def _record(self, key: str, check: dict) -> None:
        record = self.records.setdefault(key, DescriptorRecord())
        record.add(check)
        dump = getattr(self.runner, "_dump", None)
        if dump is not None:
            dump.runtime_json("verify", {**self.stats(), "last": {"descriptor": key, **check}})
        if check["passed"]:
            logger.debug("kvgraph: verify: %s matches eager (logits %.2e of their scale)", key,
                         check["max_rel"])
            return
        message = failure_message(key, check)
        if self.runner.config.verify_action == "raise":
            raise VerifyError(message)
        logger.warning("%s", message)

    def stats(self) -> dict[str, Any]:
        """The per-descriptor table and totals (what `runner.stats()["verify"]` holds)."""
        records = self.records.values()
        return {"enabled": True, "checks": sum(r.checks for r in records),
                "failures": sum(r.failures for r in records),
                "token_flips": sum(r.token_flips for r in records),
                "descriptors": {key: dataclasses.asdict(r) for key, r in self.records.items()}}


def disabled_stats() -> dict[str, Any]:
    """`runner.stats()["verify"]` with verify off: the same keys, nothing checked."""
    return {"enabled": False, "checks": 0, "failures": 0, "token_flips": 0, "descriptors": {}}


def failure_message(key: str, check: dict) -> str:
    """A failed check as one message: the descriptor, the differences, the flips, where."""
    text = (f"kvgraph: verify: {key} differs from eager: logits by {check['max_abs']:.3g} "
            f"({check['max_rel']:.2e} of their scale), cache writes by "
            f"{check['cache_max_abs']:.3g} ({check['cache_max_rel']:.2e}"
            f"{', worst in ' + check['cache_worst'] if check['cache_max_rel'] else ''}); "
            f"tolerance {check['tolerance']:.1e}")
    flips = check["flips"]
    if flips:
        ties = sum(f["near_tie"] for f in flips)
        margins = ", ".join(f"{f['eager_margin']:.3g}" for f in flips[:MAX_FLIPS_KEPT])
        text += (f"; the greedy token changed in {len(flips)} row(s) (eager top-1/top-2 "
                 f"margins {margins}: {ties} near-tie(s), {len(flips) - ties} not)")
    where = check.get("where")
    return text + (f"; where: {where['summary']}" if where else "")


def where_summary(report: dict, key: str) -> str:
    """`verify_locate.locate`'s report on descriptor `key` as one sentence, for a log line."""
    if report["part"] == "not reproduced":
        return ("the difference did not reproduce when the batch was run again (a "
                "nondeterministic kernel, or state outside the step's cache blocks)")
    parts = []
    if report["part"] == "graphs":
        parts.append(f"compiled without graphs matches eager, so the graphs of {key} (capture "
                     "or replay) are where they part")
    layer = report["layer"]
    piece = f" (piece {layer['piece']})" if layer and layer.get("piece") else ""
    if layer is None and report.get("probed", True):
        parts.append("the model has no attention call to compare, so no layer can be named")
    elif layer is None:
        parts.append("no attention call was seen in the replay (a device's full graph runs "
                     "attention without Python), so no layer can be named")
    elif layer["part"] == "inputs":
        after = f"after {layer['previous']}" if layer["previous"] else "before any attention"
        parts.append(f"the first layer whose inputs differ is {layer['layer']} (its "
                     f"{layer['input']} by {layer['rel']:.2e} of its scale): the difference "
                     f"arises {after}, in the code computing its inputs{piece}")
    elif layer["part"] == "output":
        parts.append(f"{layer['layer']} gets the same inputs but its attention output differs "
                     f"(by {layer['rel']:.2e} of its scale): the attention op itself")
    elif layer["part"] == "after":
        parts.append(f"every attention layer agrees: the difference arises after the last one, "
                     f"{layer['previous']}{piece}")
    else:
        parts.append(f"the runs call attention differently from call {layer['index']} on "
                     f"({layer['part']})")
    if report["part"] == "compiled":
        first = report["piece_differs_from_fx"]
        parts.append(
            f"piece {first['piece']}'s compiled output differs from its FX code by "
            f"{first['rel']:.2e} of its scale (the piece compiler or its build)" if first else
            "no piece's compiled output differs from its FX code, so the traced graph itself "
            "differs from the model as written (code that traces differently, e.g. a "
            "torch.compiler.is_compiling() branch, or an FX pass)")
    return "; ".join(parts)
