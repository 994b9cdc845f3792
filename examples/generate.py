"""Quick start: offline generation through the serving engine and kvgraph's graph modes.

    python examples/generate.py [--model llama|mla|PATH] [--preset small|tiny] [--graph-mode ...]

A few prompts go through the same continuous-batching engine the server uses (its scheduler,
paged KV cache blocks and sampler) and `kvgraph.ModelRunner`, in the graph mode of
`--graph-mode` (default the device's: full on the CPU, piecewise elsewhere; `eager` runs the
model as written). The example models'
weights are random, so their text is noise, but the path is the one a served model takes:
compile, capture, then replay per batch descriptor. `--model PATH` serves a local Hugging Face
checkpoint instead. The flags are checked before anything is built (examples/engine/preflight.py):
a mistake is one line on stderr and exit status 2.

`--tensor-parallel-size N` shards the model over N ranks: this process is rank 0 and spawns
the others, broadcasting each step's batch to them (see examples/serve.py). Under torchrun the
same flags work, every rank started by torchrun (rank 0 prints, the others follow it):

    torchrun --nproc-per-node 2 examples/generate.py --tensor-parallel-size 2 --preset tiny
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import Sequence

if __name__ == "__main__" and sys.stderr.isatty() and not {"-h", "--help"} & set(sys.argv):
    # Importing torch, Dynamo and kvgraph takes seconds; a person at a terminal hears first.
    print(f"{Path(sys.argv[0]).name}: starting (importing torch and kvgraph)", file=sys.stderr,
          flush=True)

from kvgraph.inspect import units

if __package__:
    from .engine import (EngineDeadError, LLMEngine, SamplingParams, add_engine_args,
                         build_engine, run_if_worker)
    from .engine.engine_core import STARTUP_ERRORS
    from .engine.flag_types import float_in, int_in, positive_int
    from .engine.preflight import preflight
    from .models import MODELS
else:  # run as `python examples/generate.py`: this folder, not the repo root, is on sys.path
    from engine import (EngineDeadError, LLMEngine, SamplingParams, add_engine_args,
                        build_engine, run_if_worker)
    from engine.engine_core import STARTUP_ERRORS
    from engine.flag_types import float_in, int_in, positive_int
    from engine.preflight import preflight
    from models import MODELS

PROG = Path(__file__).name
PROMPTS = (
    "The quick brown fox",
    "A paged KV cache keeps each sequence in fixed-size blocks, so",
    "Once upon a time",
    "Graphs are captured once and replayed for every batch of the same shape;",
)


def build_parser() -> argparse.ArgumentParser:
    """This script's flags: the engine's, kvgraph's and its own."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_args(parser, preset="small")
    parser.add_argument("--num-prompts", type=positive_int, default=len(PROMPTS),
                        help="how many of the built-in prompts to run, repeated as needed "
                        "(default %(default)s)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=16,
                        help="tokens generated per prompt (default %(default)s)")
    parser.add_argument("--temperature", type=float_in(0, sys.float_info.max), default=0.0,
                        help="0 is greedy")
    parser.add_argument("--top-k", type=int_in(0, 2**31 - 1), default=0, help="0 is off")
    parser.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=1.0,
                        help="nucleus sampling: the smallest set of tokens holding this much "
                        "probability (default 1: off)")
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # INFO: start-up says each stage (minutes on a cold compile cache), then the report follows.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    preflight(args, MODELS, PROG)  # a mistake: one line and exit status 2, before any build
    worker_exit = run_if_worker(args, MODELS)  # under torchrun, ranks > 0 follow rank 0 here
    if worker_exit is not None:
        return worker_exit
    if args.model in MODELS:
        print(f"model: the example {args.model!r} ({args.preset} preset) with random weights, so "
              "its text is noise: this demo shows the path, not the words (--model PATH "
              "generates from a local Hugging Face checkpoint)")
    try:
        engine, summary = build_engine(args, MODELS)
    # What only the build finds (weights that do not match the model, a model that does not
    # compile): one line, as serve.py says it, and exit status 1.
    except STARTUP_ERRORS as error:
        print(f"{PROG}: cannot start: {error}", file=sys.stderr)
        return 1
    try:
        report(engine, summary, args)
    except EngineDeadError as error:  # a tensor-parallel rank died
        print(f"generation stopped: {error}", file=sys.stderr)
        return 1
    finally:
        engine.close()  # with tensor parallelism: the other ranks stop too
    return 0


def report(engine: LLMEngine, summary: dict, args: argparse.Namespace) -> None:
    """Generate from the prompts and print what happened."""
    ranks = summary["tensor_parallel_size"]
    print(f"graph mode {summary['graph_mode']}"
          f"{f' on {ranks} tensor-parallel ranks' if ranks > 1 else ''}: compiled, then captured "
          f"{summary['descriptors']} batch descriptors ({summary['graphs']} graphs: one per "
          f"piece of each) in {summary['seconds']:.1f} s; they hold "
          f"{units.size(summary['graph_bytes'])}; {summary['threads']} compute "
          f"thread{'' if summary['threads'] == 1 else 's'}{' per rank' if ranks > 1 else ''} "
          "(--threads)")

    texts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_prompts)]
    prompts = [engine.tokenizer.encode(text) for text in texts]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    start = time.perf_counter()
    completions = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start

    for i, (text, completion) in enumerate(zip(texts, completions)):
        print(f"request {i}: prompt {text!r} ({len(completion.prompt_token_ids)} tokens) -> "
              f"{len(completion.token_ids)} tokens (finished: {completion.finish_reason.value})\n"
              f"  text {completion.text!r}\n  token ids {list(completion.token_ids)}")
    generated = sum(len(c.token_ids) for c in completions)
    stats = engine.stats()
    print(f"{args.model}/{args.preset} on {args.device}: {stats['steps']} steps, "
          f"{sum(map(len, prompts))} prompt tokens, {generated} generated in {elapsed:.2f} s "
          f"({generated / elapsed:.1f} tokens/s)")
    print("steps by how they ran (graph mode: batch descriptor):")
    for key, count in stats["runner"]["hits"].items():
        print(f"  {count:4d}  {key}")
    print(f"graph replays (one per piece of each step): {stats['runner']['graphs']['replays']}")
    if "spec_decode_drafts" in stats:
        print(f"speculative decoding: {stats['spec_decode_accepted_tokens']} of "
              f"{stats['spec_decode_draft_tokens']} draft tokens accepted, "
              f"{stats['spec_decode_mean_accepted_length']:.2f} tokens per verify chunk"
              + (f"; draft model {summary['draft']['model']}, "
                 f"{stats['spec_decode_draft_model_steps']} draft steps"
                 if summary.get("draft") else ""))


if __name__ == "__main__":
    sys.exit(main())
