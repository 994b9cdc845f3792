"""A whole decode step of the `small` Llama on the CPU with each attention backend, interleaved.

Two runners in one process (piecewise graphs, inductor pieces, the same weights and prompts):
`cpu_paged` and `torch_native`. After each prefills its batch, their decode steps alternate, so
a shared machine's load falls on both alike; one thread. Prints median step times and the
ratio, checks both chose the same greedy tokens, writes JSON.

    python -m examples.benchmarks.cpu_attention_step [--steps 20] [--batch-sizes 1 16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from examples.benchmarks.decode_runner import Requests, make_runner
from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS, Llama

BACKENDS = ("cpu_paged", "torch_native")
PROMPT_LEN = 64
WARMUP_STEPS = 2


def runner_args(backend: str, args: argparse.Namespace) -> SimpleNamespace:
    """What `decode_runner.make_runner` reads."""
    return SimpleNamespace(preset=args.preset, torch_dtype=getattr(torch, args.dtype),
                           device=torch.device("cpu"), batch_sizes=args.batch_sizes,
                           prompt_len=PROMPT_LEN, cache_dir=args.cache_dir,
                           piece_compiler=args.piece_compiler, attn_backend=backend,
                           max_len=PROMPT_LEN + WARMUP_STEPS + args.steps + 2)


def measure(runners: dict, batch: int, steps: int) -> dict[str, Any]:
    requests = {name: Requests(runner, batch, PROMPT_LEN) for name, runner in runners.items()}
    seconds: dict[str, list[float]] = {name: [] for name in runners}
    for step in range(WARMUP_STEPS + steps):
        order = list(runners) if step % 2 == 0 else list(reversed(runners))
        for name in order:
            chunks = requests[name].next_chunks()
            start = time.perf_counter()
            requests[name].logits = runners[name].execute(chunks)
            if step >= WARMUP_STEPS:
                seconds[name].append(time.perf_counter() - start)
    tokens = {name: r.generated() for name, r in requests.items()}
    ms = {name: 1000 * statistics.median(s) for name, s in seconds.items()}
    return {"batch": batch, "ms": ms, "speedup": ms["torch_native"] / ms["cpu_paged"],
            "same_tokens": bool(torch.equal(*tokens.values()))}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--piece-compiler", default="inductor")
    parser.add_argument("--cache-dir", default=None, help="kvgraph's compile cache")
    parser.add_argument("--json", default="cpu_attention_step.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    weights = Llama.from_preset(args.preset).hf_state_dict()
    runners = {}
    for name in BACKENDS:
        runners[name] = make_runner(runner_args(name, args), "piecewise", weights)
        runners[name].capture()
    with torch.no_grad():
        rows = [measure(runners, batch, args.steps) for batch in args.batch_sizes]
    print(f"\n{args.preset} Llama, {args.dtype}, piecewise, {args.piece_compiler} pieces, one "
          f"thread, median ms per decode step over {args.steps} interleaved steps")
    for row in rows:
        print(f"b={row['batch']:<4} cpu_paged {row['ms']['cpu_paged']:8.2f}  torch_native "
              f"{row['ms']['torch_native']:8.2f}  speedup {row['speedup']:.2f}x  same tokens: "
              f"{row['same_tokens']}")
    payload = {"machine": machine(torch.device("cpu")), "threads": 1, "preset": args.preset,
               "dtype": args.dtype, "rows": rows}
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
