"""The example engine's token budget (tokens per step): prefill throughput against decode stalls.

A larger budget prefills more tokens in one step (larger matmuls, the weights read fewer
times), and makes each step that carries a prompt's chunk longer for the requests decoding
beside it. One engine per budget (same model and flags otherwise, no prefix caching), built in
one process; rounds alternate the budgets' order, and each round times, per budget:
- prefill: SEQS prompts of LEN tokens, max_tokens 1: prompt tokens per second;
- stall: DECODES requests decoding, then one prompt of --long-prompt tokens admitted; the
  longest step until it has its first token (what the decoding requests wait between two
  tokens) and the median decode-only step before it.
Prints medians and writes JSON; the engine's default budget for the device is
its platform's `default_max_num_tokens` (kvgraph/runtime/platforms/cpu.py).

    python -m examples.benchmarks.token_budget --model ~/.cache/kvgraph-bench/llama-small \
        [--budgets 256 512 1024 2048] [--threads 2] [--rounds 6]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any, Sequence

import torch

from examples.benchmarks.engine_steps import generate_s
from examples.benchmarks.timing import machine, write_json
from examples.engine import LLMEngine, SamplingParams, add_engine_args, build_engine
from examples.models import MODELS


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = add_engine_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    parser.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--prefill", type=int, nargs=2, default=[32, 64], metavar=("SEQS", "LEN"))
    parser.add_argument("--decodes", type=int, default=8, help="requests decoding in the stall")
    parser.add_argument("--long-prompt", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", default="token_budget.json")
    parser.set_defaults(max_model_len=2048, enable_prefix_caching=False)
    args = parser.parse_args(argv)
    if min(args.budgets) < 1 or args.rounds < 1 or args.decodes < 1:
        parser.error("--budgets, --rounds and --decodes must be >= 1")
    if args.long_prompt >= args.max_model_len:
        parser.error(f"--long-prompt {args.long_prompt} must be below --max-model-len "
                     f"{args.max_model_len}")
    return args


def make_engine(args: argparse.Namespace, budget: int) -> LLMEngine:
    return build_engine(argparse.Namespace(**{**vars(args), "max_num_tokens": budget}),
                        MODELS)[0]


def stall_ms(engine: LLMEngine, decodes: list[list[int]], long_prompt: list[int]
             ) -> dict[str, float]:
    """The longest step while `long_prompt` is prefilled beside `decodes`, and the median
    decode-only step before it (ms)."""
    longest = engine.runner.limits.max_model_len - max(map(len, decodes))
    forever = SamplingParams(max_tokens=min(256, longest), temperature=0.0, ignore_eos=True)
    running = [engine.add_request(p, forever) for p in decodes]
    while any(r.num_uncomputed_tokens > 1 for r in running):  # their prefills
        engine.step()
    decode_s = []
    for _ in range(8):
        start = time.perf_counter()
        engine.step()
        decode_s.append(time.perf_counter() - start)
    long = engine.add_request(long_prompt, SamplingParams(max_tokens=1, temperature=0.0))
    stall_s = []
    while not long.output_token_ids:
        start = time.perf_counter()
        engine.step()
        stall_s.append(time.perf_counter() - start)
    for request in running:
        engine.abort(request.request_id)
    return {"decode_step_ms": 1e3 * statistics.median(decode_s), "stall_ms": 1e3 * max(stall_s),
            "stall_steps": float(len(stall_s))}


def time_round(engine: LLMEngine, prompts: dict[str, Any]) -> dict[str, float]:
    prefill = prompts["prefill"]
    return {"prefill_tok_s": sum(map(len, prefill)) / generate_s(engine, prefill, 1),
            **stall_ms(engine, prompts["decodes"], prompts["long"])}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    engines = {budget: make_engine(args, budget) for budget in args.budgets}
    rng = random.Random(args.seed)
    vocab = next(iter(engines.values())).runner.vocab_size or 256
    seqs, length = args.prefill
    prompts = {"prefill": [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(seqs)],
               "decodes": [[rng.randrange(2, vocab) for _ in range(16)]
                           for _ in range(args.decodes)],
               "long": [rng.randrange(2, vocab) for _ in range(args.long_prompt)]}
    for engine in engines.values():
        time_round(engine, prompts)  # warm-up: the first step of each size
    samples: dict[int, list[dict[str, float]]] = {budget: [] for budget in engines}
    for round_index in range(args.rounds):
        order = args.budgets if round_index % 2 == 0 else args.budgets[::-1]
        for budget in order:
            samples[budget].append(time_round(engines[budget], prompts))
    medians = {budget: {what: statistics.median(r[what] for r in rows) for what in rows[0]}
               for budget, rows in samples.items()}
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args),
               "date": time.strftime("%Y-%m-%d"), "medians": medians, "samples": samples}
    mode = next(iter(engines.values())).runner.config.graph_mode.value
    print(f"{args.model}, {args.dtype}, {torch.get_num_threads()} thread(s), graph mode {mode}, "
          f"{args.rounds} interleaved rounds, medians; prefill {seqs}x{length}, stall: "
          f"{args.decodes} decoding + one prompt of {args.long_prompt}")
    print(f"{'budget':>8}{'prefill tok/s':>15}{'decode step ms':>16}{'stall ms':>10}"
          f"{'stall steps':>13}")
    for budget, row in medians.items():
        print(f"{budget:>8}{row['prefill_tok_s']:>15.0f}{row['decode_step_ms']:>16.2f}"
              f"{row['stall_ms']:>10.1f}{row['stall_steps']:>13.0f}")
    for engine in engines.values():
        engine.runner.close()
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
