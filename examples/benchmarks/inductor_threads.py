"""Inductor's CPU pieces built for the threads they run on against pieces built for one thread.

Inductor decides at build time which loops run in parallel, for `torch.get_num_threads()`
threads, and builds for one thread without OpenMP; the compile cache keys CPU builds by that
count (`cpu_threads`). This measures what the key is worth: two example engines of the same
checkpoint (or preset) in one process, both run on `--threads` threads, one with pieces built
for them, one with pieces built serially (`torch._inductor.config.cpp.threads = 1`), timed in
rounds alternating which goes first: a prefill of SEQS prompts of LEN tokens, and decode steps
at batch 1 and SEQS (generating 1 + STEPS tokens against 1, the difference over STEPS).
Ratios parallel/serial below 1 (time) or above 1 (tokens/s): the parallel build is better.

    python -m examples.benchmarks.inductor_threads --model ~/.cache/kvgraph-bench/llama-small
    python -m examples.benchmarks.inductor_threads --preset tiny --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Sequence

import torch
from torch._inductor import config as inductor_config

from examples.benchmarks.timing import machine, write_json
from examples.engine import LLMEngine, SamplingParams, build_engine
from examples.engine.engine_args import add_engine_args
from examples.models import MODELS

KINDS = ("serial", "parallel")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prefill", type=int, nargs=2, default=[16, 64], metavar=("SEQS", "LEN"))
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", default="inductor_threads.json")
    parser.set_defaults(threads=2, max_model_len=1024, enable_prefix_caching=False)
    return parser.parse_args(argv)


def make_engine(args: argparse.Namespace, dtype: str, kind: str) -> LLMEngine:
    """The example engine, its pieces built serially or for the threads it runs on."""
    engine_args = argparse.Namespace(**{**vars(args), "dtype": dtype})
    with inductor_config.patch({"cpp.threads": 1 if kind == "serial" else -1}):
        return build_engine(engine_args, MODELS)[0]


def time_round(engine: LLMEngine, prompts: list[list[int]], steps: int) -> dict[str, float]:
    """Prefill tokens/s and decode step milliseconds at batch 1 and len(prompts)."""
    def generate(batch: list[list[int]], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        engine.generate(batch, params)
        return time.perf_counter() - start

    row = {"prefill_tok_s": sum(map(len, prompts)) / generate(prompts, 1)}
    for batch in (prompts[:1], prompts):
        step_s = (generate(batch, 1 + steps) - generate(batch, 1)) / steps
        row[f"decode_b{len(batch)}_ms"] = 1e3 * step_s
    return row


def measure(args: argparse.Namespace, dtype: str) -> dict[str, Any]:
    engines = {kind: make_engine(args, dtype, kind) for kind in KINDS}
    seqs, length = args.prefill
    generator = torch.Generator().manual_seed(args.seed)
    vocab = engines["serial"].runner.vocab_size or 256
    prompts = torch.randint(1, vocab, (seqs, length), generator=generator).tolist()
    for engine in engines.values():
        time_round(engine, prompts, 2)  # warm-up: first steps of each size
    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for round_index in range(args.rounds):
        for kind in KINDS if round_index % 2 == 0 else KINDS[::-1]:
            samples[kind].append(time_round(engines[kind], prompts, args.steps))
    medians = {kind: {what: statistics.median(r[what] for r in rows) for what in rows[0]}
               for kind, rows in samples.items()}
    for engine in engines.values():
        engine.runner.close()
    return {"dtype": dtype, "medians": medians, "samples": samples,
            "ratio": {what: medians["parallel"][what] / medians["serial"][what]
                      for what in medians["serial"]}}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args),
               "date": time.strftime("%Y-%m-%d"), "results": []}
    print(f"{args.model}, run on {args.threads} threads, {args.rounds} interleaved rounds, "
          "medians")
    print(f"{'dtype':<10}{'what':<16}{'serial':>10}{'parallel':>10}{'par/serial':>12}")
    for dtype in args.dtypes:
        row = measure(args, dtype)
        payload["results"].append(row)
        write_json(args.json, payload)
        for what, ratio in row["ratio"].items():
            print(f"{dtype:<10}{what:<16}{row['medians']['serial'][what]:>10.2f}"
                  f"{row['medians']['parallel'][what]:>10.2f}{ratio:>12.2f}", flush=True)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
