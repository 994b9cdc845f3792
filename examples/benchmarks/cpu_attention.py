"""CPU attention, one thread: the C++ `cpu_paged` backend against `torch_native`, interleaved.

One call = write the step's keys/values into the paged cache and attend (as in a model step),
beside SDPA on dense tensors of the same sizes (no cache: a reference point, not a backend),
with the `small` Llama's heads (8 query, 2 KV, head_dim 64), block size 16, shuffled block
tables; decode b=1 and b=16 and causal prefill, fp32 and bf16. Each case is first checked
against SDPA on dense tensors; then every round times each backend once, in alternating order,
so a busy (shared) machine slows both alike; the table shows medians and the ratio.

    python -m examples.benchmarks.cpu_attention [--rounds 15] [--json cpu_attention.json]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from examples.benchmarks.attention_kernels import Case, backend_call, make_inputs, sdpa_call
from examples.benchmarks.timing import machine, write_json
from kvgraph.attention.backends import get_attention_backend

BACKENDS = ("cpu_paged", "torch_native")
SMALL_HEADS = dict(heads=8, kv_heads=2, head_dim=64)
CASES = [Case("decode", 1, 256, **SMALL_HEADS), Case("decode", 1, 1024, **SMALL_HEADS),
         Case("decode", 16, 256, **SMALL_HEADS), Case("prefill", 1, 512, **SMALL_HEADS),
         Case("prefill", 16, 64, **SMALL_HEADS)]
SMOKE_CASES = [Case("decode", 2, 40, **SMALL_HEADS), Case("prefill", 1, 24, **SMALL_HEADS)]
CALLS_PER_ROUND_MS = 20  # each timed sample repeats a call for about this long


def calls_for(fn) -> int:
    """How many calls make one sample of about CALLS_PER_ROUND_MS."""
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return max(1, int(CALLS_PER_ROUND_MS / 1000 / max(seconds, 1e-6)))


def measure(case: Case, dtype: torch.dtype, rounds: int) -> dict[str, Any]:
    inputs = make_inputs(case, dtype, torch.device("cpu"))
    calls = {name: backend_call(name, case, inputs) for name in BACKENDS}
    sdpa = sdpa_call(case, inputs)
    expected = sdpa().float()
    diffs = {name: (fn().float() - expected).abs().max().item() for name, fn in calls.items()}
    calls["sdpa_dense"] = sdpa  # a reference point: dense tensors, nothing gathered or written
    repeats = {name: calls_for(fn) for name, fn in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for round_index in range(rounds):
        order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
        for name in order:
            start = time.perf_counter()
            for _ in range(repeats[name]):
                calls[name]()
            samples[name].append((time.perf_counter() - start) / repeats[name])
    ms = {name: 1000 * statistics.median(s) for name, s in samples.items()}
    return {"case": case.name, "dtype": str(dtype).removeprefix("torch."), "ms": ms,
            "max_abs_diff_vs_sdpa": diffs, "speedup": ms["torch_native"] / ms["cpu_paged"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, few rounds")
    parser.add_argument("--json", default="cpu_attention.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    backend = get_attention_backend("cpu_paged", torch.device("cpu"))
    if backend.fallback_reason:  # it would time torch_native twice
        raise SystemExit(f"cpu_paged is not available: {backend.fallback_reason}")
    cases, rounds = (SMOKE_CASES, 3) if args.smoke else (CASES, args.rounds)
    rows = [measure(case, dtype, rounds) for dtype in (torch.float32, torch.bfloat16)
            for case in cases]
    print(f"\n{'case':<22}{'dtype':>9}{'cpu_paged ms':>14}{'torch_native ms':>17}{'speedup':>9}"
          f"{'sdpa dense ms':>15}{'max|diff|':>11}")
    for row in rows:
        ms = row["ms"]
        print(f"{row['case']:<22}{row['dtype']:>9}{ms['cpu_paged']:>14.3f}"
              f"{ms['torch_native']:>17.3f}{row['speedup']:>8.2f}x{ms['sdpa_dense']:>15.3f}"
              f"{row['max_abs_diff_vs_sdpa']['cpu_paged']:>11.1e}")
    print(f"one thread; median of {rounds} interleaved rounds; speedup: torch_native / cpu_paged;"
          f"\nsdpa dense: SDPA on dense tensors (no cache gather or write), for reference")
    payload = {"machine": machine(torch.device("cpu")), "threads": 1, "rounds": rounds,
               "rows": rows}
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
