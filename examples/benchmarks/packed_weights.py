"""Packed against plain linear weights on the CPU: decode steps and prefill, runners side by side.

Per dtype, two runners of the same model and graph mode, one with `pack_linear_weights`
(kvgraph.cpu.packed_linear) applied to every linear, whatever its dtype, so fp32 is measured too,
one without; rounds alternate which goes first, and each round times a decode step per batch
size and a prefill step on both. One compute thread by default, since a shared machine's second core is not
ours to count on. Prints medians and the packed/plain ratio (below 1: packing is faster),
writes JSON.

    python -m examples.benchmarks.packed_weights                   # small, fp32 + bf16, b=1, 16
    python -m examples.benchmarks.packed_weights --dtypes bfloat16 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import kvgraph
from examples.benchmarks.decode_runner import Requests
from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS, Llama
from kvgraph.config_checks import PIECE_COMPILERS
from kvgraph.cpu.packed_linear import pack_linear_weights

KINDS = ("plain", "packed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--prefill", type=int, nargs=2, default=[16, 64], metavar=("SEQS", "LEN"),
                        help="the prefill step timed: SEQS prompts of LEN tokens")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    parser.add_argument("--graph-mode", default="piecewise")
    parser.add_argument("--piece-compiler", default="inductor", choices=PIECE_COMPILERS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="packed_weights.json")
    return parser.parse_args(argv)


def make_runner(args, dtype: torch.dtype, packed: bool) -> kvgraph.ModelRunner:
    model = Llama.from_preset(args.preset, dtype=dtype, seed=0)
    if packed:
        pack_linear_weights(model, dtypes=(dtype,))
    seqs, length = args.prefill
    max_num_tokens = max(seqs * length, max(args.batch_sizes))
    blocks_per_seq = -(-(length + args.rounds * (args.steps + 1) + 2) // 16)
    config = kvgraph.CompilationConfig(graph_mode=args.graph_mode,
                                       piece_compiler=args.piece_compiler,
                                       max_num_tokens=max_num_tokens)
    runner = kvgraph.ModelRunner(
        model, config, num_blocks=max(seqs, *args.batch_sizes) * blocks_per_seq + 1,
        block_size=16, max_num_seqs=max(seqs, *args.batch_sizes),
        max_model_len=blocks_per_seq * 16)
    runner.capture()
    return runner


def time_round(runner: kvgraph.ModelRunner, requests: dict[int, Requests], args
               ) -> dict[str, float]:
    """One round on one runner: `steps` decode steps per batch (median), one prefill step."""
    times = {}
    for batch, live in requests.items():
        steps = []
        for _ in range(args.steps):
            chunks = live.next_chunks()
            start = time.perf_counter()
            live.logits = runner.execute(chunks)
            steps.append(time.perf_counter() - start)
        times[f"decode b={batch}"] = statistics.median(steps)
    seqs, length = args.prefill
    times[f"prefill {seqs}x{length}"] = Requests(runner, seqs, length).prefill_s
    return times


def measure_dtype(args, dtype: torch.dtype) -> dict[str, Any]:
    """Both runners of one dtype, rounds alternating which goes first; medians in ms and the
    ratio, and whether their greedy tokens agree."""
    runners = {kind: make_runner(args, dtype, kind == "packed") for kind in KINDS}
    requests = {kind: {b: Requests(runners[kind], b, args.prefill[1]) for b in args.batch_sizes}
                for kind in KINDS}
    samples: dict[str, dict[str, list[float]]] = {kind: {} for kind in KINDS}
    for round_index in range(args.rounds):
        order = KINDS if round_index % 2 == 0 else KINDS[::-1]
        for kind in order:
            for what, seconds in time_round(runners[kind], requests[kind], args).items():
                samples[kind].setdefault(what, []).append(seconds)
    tokens_equal = all(requests["plain"][b].generated().equal(requests["packed"][b].generated())
                       for b in args.batch_sizes)
    for runner in runners.values():
        runner.close()
    medians = {kind: {what: 1e3 * statistics.median(s) for what, s in samples[kind].items()}
               for kind in KINDS}
    return {"dtype": str(dtype).removeprefix("torch."), "ms": medians, "tokens_equal": tokens_equal,
            "ratio": {what: medians["packed"][what] / medians["plain"][what]
                      for what in medians["plain"]}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args),
               "date": time.strftime("%Y-%m-%d"), "results": []}
    print(f"{args.preset} Llama, {args.graph_mode} ({args.piece_compiler} pieces), "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds; median ms")
    print(f"{'dtype':<10}{'what':<18}{'plain':>10}{'packed':>10}{'packed/plain':>14}{'tokens':>8}")
    for name in args.dtypes:
        row = measure_dtype(args, getattr(torch, name))
        payload["results"].append(row)
        write_json(args.json, payload)
        for what, ratio in row["ratio"].items():
            print(f"{name:<10}{what:<18}{row['ms']['plain'][what]:>10.2f}"
                  f"{row['ms']['packed'][what]:>10.2f}{ratio:>14.2f}"
                  f"{'equal' if row['tokens_equal'] else 'DIFFER':>8}", flush=True)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
