"""Decode steps with start-up objects frozen out of the garbage collector's scans, and without.

One engine (the example engine's defaults: small Llama, piecewise, one thread unless --threads),
built once; rounds alternate `gc.freeze()` (what `build_engine` does after start-up) and
`gc.unfreeze()`, and each round times a decode step of a batch as the engine serves it: prompts
generated to S and to S + --decode-steps tokens, the difference over --decode-steps. Prints
median step times and the ratio, and how long one full collection (`gc.collect()`) takes
either way: the pause a step meets when the collector's thresholds trigger one. Writes JSON.

    python -m examples.benchmarks.startup_gc [--batch-sizes 1 16] [--rounds 10]
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from typing import Any

import torch

from examples.benchmarks.timing import machine, write_json
from examples.benchmarks.engine_steps import decode_step_ms, engine_parser, random_prompts
from examples.engine import build_engine
from examples.models import MODELS

KINDS = ("frozen", "unfrozen")


def full_collection_ms(frozen: bool, repeats: int = 5) -> float:
    """Median time of one full `gc.collect()` with start-up objects frozen or not."""
    gc.freeze() if frozen else gc.unfreeze()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = engine_parser(__doc__.splitlines()[0], 10, "startup_gc.json").parse_args(argv)
    if args.threads is None:
        args.threads = 1
    engine, summary = build_engine(args, MODELS)
    rng = random.Random(0)
    vocab = engine.runner.model.config.vocab_size
    payload = {"machine": machine(torch.device("cpu")), "date": time.strftime("%Y-%m-%d"),
               "args": vars(args), "frozen_objects": gc.get_freeze_count(), "results": []}
    print(f"{args.preset} Llama, {summary['graph_mode']}, {summary['threads']} thread(s), "
          f"{payload['frozen_objects']} objects frozen at start-up; median decode step, ms")
    print(f"{'batch':>6}{'frozen':>10}{'unfrozen':>10}{'frozen/unfrozen':>17}")
    for batch in args.batch_sizes:
        prompts = random_prompts(rng, vocab, batch)
        decode_step_ms(engine, prompts, 2, 2)  # warm-up
        samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for round_index in range(args.rounds):
            for kind in KINDS if round_index % 2 == 0 else KINDS[::-1]:
                gc.freeze() if kind == "frozen" else gc.unfreeze()
                samples[kind].append(
                    decode_step_ms(engine, prompts, args.decode_base, args.decode_steps))
        ms = {kind: statistics.median(s) for kind, s in samples.items()}
        payload["results"].append({"batch": batch, "ms": ms, "ratio": ms["frozen"] / ms["unfrozen"]})
        write_json(args.json, payload)
        print(f"{batch:>6}{ms['frozen']:>10.2f}{ms['unfrozen']:>10.2f}"
              f"{ms['frozen'] / ms['unfrozen']:>17.2f}", flush=True)
    payload["full_collection_ms"] = {kind: full_collection_ms(kind == "frozen") for kind in KINDS}
    write_json(args.json, payload)
    print("one full collection: {frozen:.1f} ms frozen, {unfrozen:.1f} ms unfrozen".format(
        **payload["full_collection_ms"]))
    gc.freeze()
    engine.runner.close()
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
