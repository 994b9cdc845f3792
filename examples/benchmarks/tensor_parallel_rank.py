"""What one rank of the tensor-parallel check runs: its model, a runner per graph mode, the
forced-token parity run, timed decode, and the collectives its traced graphs hold.

The driver (`examples.benchmarks.tensor_parallel`) runs these in its own process at TP size 1
and in two spawned processes at size 2.
"""

from __future__ import annotations

import os
import re
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

import kvgraph
from examples.benchmarks.decode_runner import WARMUP_STEPS, Requests, decode
from examples.benchmarks.timing import median_ms
from examples.engine.tp_launch import Rendezvous, join_group, leave_group, rank_device
from examples.models.llama import Llama

# Seconds a collective (the model's, kvgraph's agreement checks) waits for a peer: above a
# cold inductor compile of the 1b model, which one rank may finish before the other.
DIST_TIMEOUT_S = 180.0
COLLECTIVE_OP = re.compile(r"`torch\.ops\._c10d_functional\.(\w+)`")


class ReducedLayer(nn.Module):
    """A decoder layer whose output is all-reduced over `group`: at size 1 a sum of one, so the
    same values, but a real collective that the compiled graph and its captures must hold."""

    def __init__(self, layer: nn.Module, group: torch.distributed.ProcessGroup):
        super().__init__()
        self.layer, self.group = layer, group

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(self.layer(positions, hidden), "sum", self.group)


def build_model(args, device: str, tp: kvgraph.distributed.TensorParallelGroup) -> Llama:
    """This rank's model: its shard at TP size > 1; at size 1 the whole model, every layer's
    output all-reduced (kvgraph's own all_reduce is the identity there)."""
    if tp.world_size > 1:
        return Llama.from_preset(args.preset, dtype=args.torch_dtype, device=device,
                                 seed=args.seed, tp=tp)
    model = Llama.from_preset(args.preset, dtype=args.torch_dtype, device=device, seed=args.seed)
    model.model.layers = nn.ModuleList(ReducedLayer(layer, tp.group)
                                       for layer in model.model.layers)
    return model


def make_runner(args, model: nn.Module, mode: str, device: str,
                dump: str | None = None) -> kvgraph.ModelRunner:
    """A runner for `mode` sized for the whole run. Its graphs cover each decode batch and
    each batch's prefill, so full_and_piecewise replays piecewise graphs too."""
    max_batch = max(args.batch_sizes)
    sizes = sorted({*args.batch_sizes, *(b * args.prompt_len for b in args.batch_sizes)})
    cache = {"cache_dir": args.cache_dir} if args.cache_dir else {}  # else kvgraph's default
    config = kvgraph.CompilationConfig(
        graph_mode=mode, piece_compiler=args.piece_compiler, capture_sizes=tuple(sizes),
        max_num_tokens=sizes[-1], debug_dump_path=dump, **cache)
    block_size = kvgraph.ModelRunner.default_block_size(device)
    blocks_per_seq = -(-args.max_len // block_size)
    return kvgraph.ModelRunner(model, config, num_blocks=max_batch * blocks_per_seq + 1,
                               block_size=block_size, max_num_seqs=max_batch, device=device,
                               max_model_len=blocks_per_seq * block_size)


def forced_decode(runner: kvgraph.ModelRunner, batch: int, args,
                  reference: list[torch.Tensor]) -> list[torch.Tensor]:
    """The logits of the prefill and of each decode step, each step fed the token the
    reference chose (so a near-tie flip changes one row, not every later one); on the CPU."""
    requests = Requests(runner, batch, args.prompt_len)
    logits = [requests.logits.cpu()]
    for chosen in reference[:-1]:
        requests.logits = chosen  # next_chunks appends each row's argmax: the reference's token
        requests.logits = runner.execute(requests.next_chunks())
        logits.append(requests.logits.cpu())
    return logits


def collective_counts(dump: str) -> dict[str, int]:
    """How many nodes of each `_c10d_functional` op this rank's traced graphs hold (every
    Dynamo graph of its dump: more than one is a graph break, counted as `dynamo_graphs`)."""
    counts: dict[str, int] = {}
    # With torch.distributed initialised, each rank dumps into rank_<r>/ of the path.
    own = Path(dump, f"rank_{kvgraph.distributed.tp_rank()}")
    tables = sorted(own.glob("compile-*/*-dynamo-nodes.md"))
    for table in tables:
        for op in COLLECTIVE_OP.findall(table.read_text()):
            counts[op] = counts.get(op, 0) + 1
    return {**counts, "dynamo_graphs": len(tables)}


def graphs_replayed(runner: kvgraph.ModelRunner) -> list[str]:
    """The kinds of graph ("full", "piecewise") this runner's steps replayed."""
    ran = {key.split(":")[0] for key in runner.stats()["hits"]}
    return sorted(ran & {"full", "piecewise"})


def run_mode(args, model: nn.Module, mode: str, device: str, dump: str,
             reference: dict[int, list[torch.Tensor]]) -> dict[str, Any]:
    """One graph mode on this rank: capture, forced-token parity run, timed greedy decode."""
    runner = make_runner(args, model, mode, device, dump)
    try:
        summary = runner.capture()
        result = {"mode": mode, "ran_as": runner.config.graph_mode.value,
                  "graphs": summary["graphs"], "capture_failed": summary["failed"],
                  "logits": {}, "ms": {}}
        for batch in args.batch_sizes:
            result["logits"][batch] = forced_decode(runner, batch, args, reference[batch])
            timed = decode(runner, batch, args, WARMUP_STEPS + args.steps)
            result["ms"][batch] = median_ms(timed.step_s[WARMUP_STEPS:])
        result["replayed"] = graphs_replayed(runner)
    finally:
        runner.close()  # one model, one runner: the next mode's is built on the same model
    result["collectives"] = collective_counts(dump)  # eager traces nothing: no graphs
    return result


def rank_modes(args, rendezvous: Rendezvous, dump_root: str,
               reference: dict[int, list[torch.Tensor]]) -> Iterator[dict[str, Any]]:
    """Join the group, then each mode's result in turn (an error is a result: kvgraph raises
    it on every rank, so the ranks stay in step); leave the group after the last."""
    device = rank_device(args.device, rendezvous)
    tp = join_group(rendezvous, device, DIST_TIMEOUT_S)
    try:
        model = build_model(args, device, tp)
        for mode in args.modes:
            dump = os.path.join(dump_root, f"ws{tp.world_size}-{mode}")
            try:
                yield run_mode(args, model, mode, device, dump, reference)
            except Exception as error:  # noqa: BLE001 - reported in the row, next mode runs
                traceback.print_exc()
                yield {"mode": mode, "error": f"{type(error).__name__}: {error}"}
    finally:
        leave_group()


def spawned_rank(rank: int, args, rendezvous: Rendezvous, out_dir: str,
                 reference: dict[int, list[torch.Tensor]]) -> None:
    """A spawned rank's life: each mode's result saved as `<mode>-rank<r>.pt` once done."""
    for result in rank_modes(args, rendezvous.with_rank(rank), out_dir, reference):
        path = Path(out_dir, f"{result['mode']}-rank{rank}.pt")
        torch.save(result, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)  # whole, or not there for the parent
