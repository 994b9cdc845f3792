"""The example engine with freed memory kept in the process and without (`--keep-freed-memory`,
kvgraph.cpu.malloc_policy): prefill throughput and decode steps, engines side by side.

The allocator's setting is the whole process's, so each setting runs in an engine worker
process of its own (engine_worker.py, as vs_vllm.py runs kvgraph), built the same way but for
the flag; rounds alternate which goes first, and the worker not being timed is stopped for the
other's turn (quiet.py). A round times a prefill of 16 prompts of 64 tokens and a decode step at
batch 16 (the difference of two generations over 32 more tokens). One compute thread by
default. Prints medians and the kept/default ratio, writes JSON.

    python -m examples.benchmarks.freed_memory [--preset small] [--dtype float32] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from examples.benchmarks.engine_worker import Worker
from examples.benchmarks.quiet import paused, wait_until_quiet
from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS

SETTINGS = {"default": ["--no-keep-freed-memory"], "kept": ["--keep-freed-memory"]}
PREFILL_BATCH, PREFILL_LEN, DECODE_BATCH, DECODE_BASE, DECODE_STEPS = 16, 64, 16, 8, 32


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--kvgraph-arg", action="append", default=[], metavar="FLAG",
                        help="another engine flag for both workers")
    parser.add_argument("--json", default="freed_memory.json")
    return parser.parse_args(argv)


def measure_round(worker: Worker, vocab: int, round_: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(round_)
    prompts = torch.randint(vocab, (PREFILL_BATCH, PREFILL_LEN), generator=generator).tolist()
    seconds, _ = worker.generate(prompts, 1)
    short, _ = worker.generate(prompts[:DECODE_BATCH], DECODE_BASE)
    long, _ = worker.generate(prompts[:DECODE_BATCH], DECODE_BASE + DECODE_STEPS)
    return {"prefill_tok_s": PREFILL_BATCH * PREFILL_LEN / seconds,
            "decode_b16_ms": 1000 * (long - short) / DECODE_STEPS}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    settings = {"model": "llama", "dtype": args.dtype, "threads": args.threads,
                "max_model_len": 1024, "max_num_seqs": 16}
    workers = {}
    try:
        for name, flags in SETTINGS.items():
            workers[name] = Worker("kvgraph", [sys.executable, "-m",
                                               "examples.benchmarks.engine_worker"],
                                   {**settings, "kvgraph_args": ["--preset", args.preset,
                                                                 *flags, *args.kvgraph_arg]},
                                   None)
        vocab = PRESETS[args.preset]["vocab_size"]
        samples: dict[str, dict[str, list[float]]] = {}
        pids = {name: w.process.pid for name, w in workers.items()}
        for worker in workers.values():
            measure_round(worker, vocab, 0)  # first calls grow the allocators
        for round_ in range(args.rounds):
            order = list(workers) if round_ % 2 == 0 else list(workers)[::-1]
            for name in order:
                wait_until_quiet(list(pids.values()))
                with paused([pid for other, pid in pids.items() if other != name]):
                    row = measure_round(workers[name], vocab, round_ + 1)
                for metric, value in row.items():
                    samples.setdefault(metric, {}).setdefault(name, []).append(value)
    finally:
        for worker in workers.values():
            worker.close()
    results = {metric: {name: statistics.median(values) for name, values in by.items()}
               for metric, by in samples.items()}
    print(f"{args.preset} Llama, {args.dtype}, {args.threads} thread(s), {args.rounds} "
          "alternating rounds; medians")
    print(f"{'':16}{'default':>10}{'kept':>10}{'kept/default':>14}")
    for metric, by in results.items():
        print(f"{metric:16}{by['default']:>10.1f}{by['kept']:>10.1f}"
              f"{by['kept'] / by['default']:>14.3f}")
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args),
               "date": time.strftime("%Y-%m-%d"), "results": results, "samples": samples}
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
