"""Decode-step latency of the Llama example: kvgraph per graph mode beside its baselines.

In one process, with the same weights and prompts: kvgraph in each graph mode (parity against
eager, then timed greedy decode steps; the host part of a step timed on its own), a plain
static-cache Llama under `torch.compile(mode="reduce-overhead")`, HF `generate` with a static
cache, and the memory-bandwidth bound. Prints a table of median decode-step times (rows: what;
columns: batch sizes), writes JSON. `--profile` instead prints torch.profiler's top ops of one
decode step per mode and batch size.

    python -m examples.benchmarks.decode_latency                  # CPU: small preset, b=1, 16
    python -m examples.benchmarks.decode_latency --device cuda    # GPU: 1b preset, bf16, b=1, 8, 64
    python -m examples.benchmarks.decode_latency --device cuda --profile --batch-sizes 1
    python -m examples.benchmarks.decode_latency --device npu     # Ascend: 1b-hd128, bf16, bound only
"""

from __future__ import annotations

import argparse
from typing import Any, Iterator

import torch

from examples.benchmarks import decode_baselines, decode_runner
from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS, Llama
from kvgraph.config_checks import PIECE_COMPILERS

MODES = ["eager", "none", "piecewise", "full_decode_only", "full_and_piecewise"]
DEFAULT_MODES = ["eager", "piecewise", "full_decode_only", "full_and_piecewise"]
BASELINES = ["static", "hf", "bound"]
# Per device type: what a run measures unless told otherwise.
DEVICE_DEFAULTS = {
    "cpu": {"preset": "small", "dtype": "float32", "batch_sizes": [1, 16]},
    "cuda": {"preset": "1b", "dtype": "bfloat16", "batch_sizes": [1, 8, 64]},
    # Ascend's fused attention runs head size 128 (not 1b's 64); the CUDA-graph baselines
    # do not apply there.
    "npu": {"preset": "1b-hd128", "dtype": "bfloat16", "batch_sizes": [1, 8, 64],
            "baselines": ["bound"]},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda[:i] or npu[:i]")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="default: small (cpu), 1b")
    parser.add_argument("--dtype", help="default: float32 (cpu), bfloat16")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="default: 1 16 (cpu), 1 8 64")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--parity-steps", type=int, default=4)
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=MODES)
    parser.add_argument("--baselines", nargs="*", choices=BASELINES,
                        help=f"default: {' '.join(BASELINES)} (npu: bound)")
    parser.add_argument("--piece-compiler", default="inductor", choices=PIECE_COMPILERS)
    parser.add_argument("--attn-backend", default=None, help="default: the platform's")
    parser.add_argument("--cache-dir", default=None, help="kvgraph's compile cache")
    parser.add_argument("--profile", action="store_true",
                        help="print the top ops of one decode step per mode instead of timing")
    parser.add_argument("--json", default="decode_latency.json")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    defaults = {"baselines": BASELINES, **DEVICE_DEFAULTS.get(args.device.type,
                                                               DEVICE_DEFAULTS["cuda"])}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.torch_dtype = getattr(torch, args.dtype)
    # Room for the longest run: prompt, warm-up and timed (or parity) steps, and a spare token.
    steps = decode_runner.WARMUP_STEPS + max(args.steps, args.parity_steps)
    args.max_len = args.prompt_len + steps + 2
    return args


def measure(args: argparse.Namespace, llama: Llama) -> Iterator[dict[str, Any]]:
    """Every requested row, in turn; kvgraph's first mode (eager by default) is the reference
    whose greedy tokens every other row is compared with."""
    weights = llama.hf_state_dict()
    reference: dict[int, decode_runner.Decoded] = {}
    for mode in args.modes:
        yield decode_runner.measure_mode(args, mode, weights, reference)
    if "bound" in args.baselines:  # cheap and never failing: before the compiled baselines
        yield decode_baselines.bound_row(args, llama)
    tokens = {batch: decoded.tokens for batch, decoded in reference.items()}
    if "static" in args.baselines:
        yield decode_baselines.static_row(args, llama, tokens)
    if "hf" in args.baselines:
        row = decode_baselines.hf_row(args, llama, tokens)
        if row is not None:
            yield row


def table_line(row: dict[str, Any], batches: list[int], key: str = "ms") -> str:
    """One row: its name, then its `key` (ms by default) per batch size."""
    return f"{row['name']:<28}" + "".join(f"{row[key][b]:>10.2f}" for b in batches)


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    """Median ms per decode step, one column per batch size; token agreement with eager."""
    print(f"\n{args.preset} Llama, {args.dtype}, {args.device}, prompt {args.prompt_len}, "
          f"pieces {args.piece_compiler}, median ms per decode step")
    batches = args.batch_sizes
    print(f"{'what':<28}" + "".join(f"{'b=' + str(b):>10}" for b in batches) + f"{'tokens':>9}")
    for row in sorted(rows, key=lambda r: "bytes" in r):  # the bound last
        matches = [m for m in row.get("token_match", {}).values() if m is not None]
        print(table_line(row, batches) + (f"{min(matches):>9.2f}" if matches else f"{'-':>9}"))
    for row in rows:
        if "host_ms" in row:
            print(table_line(row, batches, "host_ms") + "  host ms (plan + input fill)")
    for row in rows:
        if "prefill_tok_s" in row:
            print(table_line(row, batches, "prefill_tok_s") + "  prefill tokens/s (one step)")
    for row in rows:
        if row.get("graph_bytes"):
            print(f"{row['name']:<28}{row['graph_bytes'] / 2**20:>10.1f}  graph MiB, "
                  f"{row['graph_bytes_vs_largest']:.2f}x the largest descriptor's "
                  f"({row['graphs']} graphs, {row['capture_s']:.1f} s)")
    if args.modes:
        print(f"tokens: the smallest fraction of greedy tokens equal to kvgraph "
              f"{args.modes[0]}'s")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    llama = Llama.from_preset(args.preset, dtype=args.torch_dtype, device=args.device)
    payload = {"machine": machine(args.device), "args": vars(args), "complete": False,
               "results": []}
    if args.profile:
        weights = llama.hf_state_dict()
        rows = (decode_runner.profile_mode(args, mode, weights) for mode in args.modes)
    else:
        rows = measure(args, llama)
    for row in rows:
        payload["results"].append(row)
        payload.setdefault("attn_backend", row.get("attn_backend"))
        write_json(args.json, payload)  # after every row: a run cut short keeps what it measured
        if not args.profile:
            print(table_line(row, args.batch_sizes), flush=True)
    if not args.profile:
        print_table(args, payload["results"])
    payload["complete"] = True
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
