"""Steps timed through the example engine's `generate`, as served (sampling, detokenizing).

A decode step is the difference between generating S + steps and S tokens, over steps: the
first S tokens absorb the prefill, so what remains is whole-batch decode steps. Shared by the
benchmarks that compare engine settings in one process (startup_gc, engine_graph_modes,
huge_pages).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from examples.engine import SamplingParams, add_engine_args

PROMPT_LEN = 64
PREFILL_SEQS = 16


def engine_parser(description: str, rounds: int, json: str) -> argparse.ArgumentParser:
    """The engine's flags plus the decode-timing ones these benchmarks share."""
    parser = add_engine_args(argparse.ArgumentParser(description=description))
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--decode-base", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--json", default=json)
    return parser


def generate_s(engine, prompts: list[list[int]], tokens: int) -> float:
    """Seconds for one greedy `generate` of `tokens` per prompt, end-of-sequence ignored."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.generate(prompts, params)
    return time.perf_counter() - start


def decode_step_ms(engine, prompts: list[list[int]], base: int, steps: int) -> float:
    """One decode step of the batch `prompts`, in ms (see the module docstring)."""
    short = generate_s(engine, prompts, base)
    return 1e3 * (generate_s(engine, prompts, base + steps) - short) / steps


def random_prompts(rng: random.Random, vocab: int, count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_LEN token ids drawn from [2, vocab)."""
    return [[rng.randrange(2, vocab) for _ in range(PROMPT_LEN)] for _ in range(count)]


def alternating_step_ms(engines: dict, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Median ms per engine of a decode step at each of `args.batch_sizes` and of a prefill of
    PREFILL_SEQS prompts, in `args.rounds` rounds that alternate the engines' order."""
    rng = random.Random(0)
    vocab = next(iter(engines.values())).runner.model.config.vocab_size
    decode = {b: random_prompts(rng, vocab, b) for b in args.batch_sizes}
    prefill = random_prompts(rng, vocab, PREFILL_SEQS)
    for engine in engines.values():
        generate_s(engine, decode[max(args.batch_sizes)], 2)  # warm-up
    names = list(engines)
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            engine, row = engines[name], samples[name]
            for batch, prompts in decode.items():
                row.setdefault(f"decode b={batch} (ms)", []).append(
                    decode_step_ms(engine, prompts, args.decode_base, args.decode_steps))
            row.setdefault(f"prefill {PREFILL_SEQS}x{PROMPT_LEN} (ms)", []).append(
                1e3 * generate_s(engine, prefill, 1))
    return {name: {what: statistics.median(s) for what, s in row.items()}
            for name, row in samples.items()}
