"""Tensor-parallel check: collectives captured in every graph mode, parity and decode latency.

World size 1: one process, torch.distributed over a FileStore (nccl on CUDA, gloo on the CPU).
kvgraph's collectives are the identity at TP size 1, so each decoder layer's output is
all-reduced over the size-1 group by torch's functional collective directly: a real
all-reduce (and its wait) in the traced graph, which every graph mode compiles and captures.
World size 2 (two devices; always on the CPU, with gloo): two spawned ranks, each with its
shard of the model (`Llama.from_preset(..., tp=...)`), whose row-parallel linears all-reduce.

Per world size and graph mode: the graph holds `_c10d_functional.all_reduce` and `wait_tensor`
(read off a debug dump of the traced graph), which graphs were captured and replayed, greedy
logits against an unsharded eager reference (each step fed the reference's token, so one
near-tie flip cannot cascade; tolerance by dtype as in verify mode), every rank's logits
bitwise equal, and the median decode-step time per batch size. Prints a table, writes JSON
after every row; exits non-zero when a check fails.

    python -m examples.benchmarks.tensor_parallel --device cuda        # 1b, bf16, inductor
    python -m examples.benchmarks.tensor_parallel --device cpu         # tiny, fp32, eager pieces
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.multiprocessing as mp

import kvgraph
from examples.benchmarks.decode_runner import WARMUP_STEPS, decode
from examples.benchmarks.tensor_parallel_rank import make_runner, rank_modes, spawned_rank
from examples.benchmarks.timing import machine, write_json
from examples.engine.tp_launch import Rendezvous, rank_device
from examples.models.llama import PRESETS, Llama
from kvgraph.config_checks import PIECE_COMPILERS
from kvgraph.runtime.verify import default_tolerance, token_flips
from kvgraph.runtime.verify_locate import difference

MODES = ["eager", "none", "piecewise", "full_decode_only", "full_and_piecewise", "full"]
DEFAULT_MODES = ["none", "piecewise", "full_decode_only", "full_and_piecewise", "full"]
DEVICE_DEFAULTS = {
    "cpu": {"preset": "tiny", "dtype": "float32", "piece_compiler": "eager"},
    "cuda": {"preset": "1b", "dtype": "bfloat16", "piece_compiler": "inductor"},
}
POLL_S = 0.2  # between looks for the spawned ranks' results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default: 1b (cuda), tiny")
    parser.add_argument("--dtype", help="default: bfloat16 (cuda), float32")
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=MODES)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2], choices=[1, 2])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--parity-steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0, help="the model's random weights")
    parser.add_argument("--piece-compiler", choices=PIECE_COMPILERS,
                        help="default: inductor (cuda), eager")
    parser.add_argument("--cache-dir", default=None, help="kvgraph's compile cache")
    parser.add_argument("--json", default="tensor_parallel.json")
    args = parser.parse_args(argv)
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.torch_dtype = getattr(torch, args.dtype)
    # Room for the longest run: prompt, warm-up and timed (or parity) steps, a spare token.
    args.max_len = args.prompt_len + WARMUP_STEPS + max(args.steps, args.parity_steps) + 2
    return args


# --- the reference, the world sizes, the judging ---------------------------------------------

def reference_logits(args) -> dict[int, list[torch.Tensor]]:
    """Greedy logits per batch size of the unsharded model run eagerly, without collectives."""
    device = rank_device(args.device, Rendezvous(0, 1, 0, 1))
    model = Llama.from_preset(args.preset, dtype=args.torch_dtype, device=device, seed=args.seed)
    runner = make_runner(args, model, "eager", device)
    try:
        return {batch: [x.cpu() for x in decode(runner, batch, args, args.parity_steps).logits]
                for batch in args.batch_sizes}
    finally:
        runner.close()
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the ranks need the memory more than this process


def world_size_one(args, store_dir: str, reference) -> Iterator[dict[str, Any]]:
    """Each mode's row at TP size 1, in this process."""
    rendezvous = Rendezvous(0, 1, 0, 1, os.path.join(store_dir, "store-1"))
    for result in rank_modes(args, rendezvous, store_dir, reference):
        yield judge(args, 1, [result], reference)


def world_size_two(args, store_dir: str, reference) -> Iterator[dict[str, Any]]:
    """Each mode's row at TP size 2, from two spawned ranks, as soon as both have it."""
    rendezvous = Rendezvous(0, 2, 0, 2, os.path.join(store_dir, "store-2"))
    ranks = mp.start_processes(spawned_rank, args=(args, rendezvous, store_dir, reference),
                               nprocs=2, join=False, start_method="spawn")
    try:
        yield from rows_as_ranks_finish(args, ranks, store_dir, reference)
    finally:
        for process in ranks.processes:  # a run cut short leaves no rank behind
            if process.is_alive():
                process.kill()


def rows_as_ranks_finish(args, ranks: mp.ProcessContext, store_dir: str,
                         reference) -> Iterator[dict[str, Any]]:
    """Judge each mode once both ranks saved it; once a rank has failed, every mode without
    results gets a failed row naming why (the rank's traceback)."""
    pending, failure = list(args.modes), None
    while pending:
        paths = [Path(store_dir, f"{pending[0]}-rank{r}.pt") for r in range(2)]
        if all(path.exists() for path in paths):
            yield judge(args, 2, [torch.load(p, weights_only=False) for p in paths], reference)
            pending.pop(0)
        elif failure is not None:
            yield {"world_size": 2, "mode": pending.pop(0), "passed": False, "error": failure}
        else:
            try:
                if ranks.join(timeout=POLL_S):  # both exited: what is missing never comes
                    failure = "the ranks exited without this mode's results"
            except Exception as error:  # noqa: BLE001 - a rank raised or died: reported
                failure = f"{type(error).__name__}: {error}"


def logits_difference(results: list[dict], reference, tolerance: float
                      ) -> tuple[float, float, bool, int]:
    """Over every rank, batch and step: max |diff| and max relative diff against the reference,
    whether every greedy token equals the reference's, and the flips that are not near-ties."""
    max_abs = max_rel = 0.0
    equal, bad_flips = True, 0
    for result in results:
        for batch, steps in result["logits"].items():
            for got, want in zip(steps, reference[batch]):
                diff_abs, diff_rel = difference(got, want)
                max_abs, max_rel = max(max_abs, diff_abs), max(max_rel, diff_rel)
                equal = equal and torch.equal(got.argmax(-1), want.argmax(-1))
                flips = token_flips(got, want, tolerance)
                bad_flips += sum(not flip["near_tie"] for flip in flips)
    return max_abs, max_rel, equal, bad_flips


def ranks_equal(results: list[dict]) -> bool | None:
    """Whether every rank's logits are bitwise rank 0's (None for one rank)."""
    if len(results) < 2:
        return None
    first = results[0]["logits"]
    return all(torch.equal(a, b) for other in results[1:] for batch in first
               for a, b in zip(first[batch], other["logits"][batch]))


def judge(args, world_size: int, results: list[dict], reference) -> dict[str, Any]:
    """One row: the ranks' results checked against the reference and each other."""
    row: dict[str, Any] = {"world_size": world_size, "mode": results[0]["mode"]}
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        return {**row, "passed": False, "error": errors[0]}
    first = results[0]
    tolerance = default_tolerance(args.torch_dtype)
    max_abs, max_rel, equal, bad_flips = logits_difference(results, reference, tolerance)
    collectives = first["collectives"]
    mode = kvgraph.GraphMode(first["ran_as"])
    checks = {
        "logits": max_rel <= tolerance and bad_flips == 0,
        "ranks_equal": ranks_equal(results) is not False,
        "collectives_traced": not mode.compiles or
        (collectives.get("all_reduce", 0) > 0 and collectives.get("wait_tensor", 0) > 0),
        "graphs_replayed": not mode.has_graphs or (
            first["graphs"] > 0 and bool(first["replayed"]) and not first["capture_failed"]),
    }
    return {**row, "ran_as": first["ran_as"], "tokens_equal": equal, "max_abs_diff": max_abs,
            "max_rel_diff": max_rel, "tolerance": tolerance, "flips_not_near_tie": bad_flips,
            "ranks_equal": ranks_equal(results), "ms": first["ms"], "graphs": first["graphs"],
            "replayed": first["replayed"], "collectives": collectives, "checks": checks,
            "passed": all(checks.values())}


def table_line(row: dict[str, Any], batches: list[int]) -> str:
    """One row of the printed table."""
    start = f"{row['world_size']:>3} {row['mode']:<20}"
    if "error" in row:
        return start + f" FAIL  {row['error'].splitlines()[0][:100]}"
    ms = "".join(f"{row['ms'][b]:>9.2f}" for b in batches)
    ranks = {None: "-", True: "yes", False: "NO"}[row["ranks_equal"]]
    return (start + f"{row['ran_as']:<20}{str(row['tokens_equal']):>7}"
            f"{row['max_abs_diff']:>11.2e}{row['max_rel_diff']:>10.2e}{ranks:>7}" + ms +
            f"{row['graphs']:>8}"
            f"{row['collectives'].get('all_reduce', 0):>7}"
            f"  {'pass' if row['passed'] else 'FAIL ' + str(row['checks'])}")


def header(args) -> str:
    batches = "".join(f"{'ms b=' + str(b):>9}" for b in args.batch_sizes)
    return (f"{'ws':>3} {'mode':<20}{'ran as':<20}{'tokens':>7}{'max|diff|':>11}{'rel':>10}"
            f"{'ranks':>7}" + batches + f"{'graphs':>8}{'allred':>7}  result")


def skipped_world_sizes(args) -> dict[int, str]:
    """The world sizes asked for that this machine cannot run, each with why."""
    devices = torch.cuda.device_count() if args.device == "cuda" else None  # the CPU: any
    return {size: f"{devices} CUDA device(s), {size} are needed" for size in args.world_sizes
            if devices is not None and devices < size}


def rows(args, workdir: str, world_sizes: list[int]) -> Iterator[dict[str, Any]]:
    """Every row: the reference first, then each world size's modes."""
    reference = reference_logits(args)
    if 1 in world_sizes:
        yield from world_size_one(args, workdir, reference)
    if 2 in world_sizes:
        yield from world_size_two(args, workdir, reference)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    skipped = skipped_world_sizes(args)
    payload = {"machine": machine(torch.device(args.device)), "args": vars(args),
               "complete": False, "passed": True, "skipped": skipped, "results": []}
    if args.device == "cuda":
        payload["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        print(f"NCCL {payload['nccl']}, {torch.cuda.device_count()} CUDA device(s)")
    for size, why in skipped.items():
        print(f"world size {size} skipped: {why}")
    print(f"{args.preset} Llama, {args.dtype}, {args.device}, pieces {args.piece_compiler}, "
          f"prompt {args.prompt_len}, median ms per decode step\n{header(args)}", flush=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvgraph-tp-check-") as workdir:
        for row in rows(args, workdir, [s for s in args.world_sizes if s not in skipped]):
            payload["results"].append(row)
            payload["passed"] = payload["passed"] and row["passed"]
            write_json(args.json, payload)  # after every row: a run cut short keeps its rows
            print(table_line(row, args.batch_sizes), flush=True)
    payload.update(complete=True, seconds=time.perf_counter() - start)
    write_json(args.json, payload)
    print(f"{'all checks passed' if payload['passed'] else 'A CHECK FAILED'}; wrote {args.json}")
    return payload


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
