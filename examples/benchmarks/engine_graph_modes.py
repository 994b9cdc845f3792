"""The example engine in each graph mode, side by side in one process: decode steps and prefill.

One engine per mode (same model, weights and flags otherwise: the engine's defaults, one
thread unless --threads, no prefix caching), built in one process; rounds alternate the order of the modes, and
each round times, per mode, a decode step at each batch size (prompts generated to S and to
S + --decode-steps tokens, the difference over --decode-steps: sampling and detokenizing
included, as served) and a prefill of 16 prompts of 64 tokens. Prints medians and each mode's
time relative to eager, writes JSON. The issue's bar: every graph mode at least as fast as eager.

    python -m examples.benchmarks.engine_graph_modes [--modes eager piecewise full] \
        [--dtype bfloat16] [--rounds 6]
"""

from __future__ import annotations

import time
from typing import Any

import torch

from examples.benchmarks.timing import machine, write_json
from examples.benchmarks.engine_steps import alternating_step_ms, engine_parser
from examples.engine import build_engine
from examples.models import MODELS


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = engine_parser(__doc__.splitlines()[0], 6, "engine_graph_modes.json")
    parser.add_argument("--modes", nargs="+", default=["eager", "piecewise", "full"])
    args = parser.parse_args(argv)
    args.threads = args.threads or 1
    args.enable_prefix_caching = False  # the rounds repeat their prompts: compute them each time
    engines = {}
    for mode in args.modes:
        args.graph_mode = mode
        engines[mode] = build_engine(args, MODELS)[0]
    medians = alternating_step_ms(engines, args)
    base = "eager" if "eager" in medians else args.modes[0]
    payload = {"machine": machine(torch.device("cpu")), "date": time.strftime("%Y-%m-%d"),
               "args": vars(args), "ms": medians,
               "relative": {mode: {what: ms / medians[base][what] for what, ms in row.items()}
                            for mode, row in medians.items()}}
    write_json(args.json, payload)
    print(f"{args.preset} Llama, {args.dtype}, {args.threads} thread(s), {args.rounds} rounds; "
          f"median ms (x {base}'s time)")
    whats = list(medians[base])
    print(f"{'mode':<20}" + "".join(f"{w:>26}" for w in whats))
    for mode, row in medians.items():
        print(f"{mode:<20}" + "".join(
            f"{row[w]:>16.2f} ({payload['relative'][mode][w]:.2f}x)" for w in whats))
    for engine in engines.values():
        engine.runner.close()
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
