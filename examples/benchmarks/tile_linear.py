"""kvgraph's tile kernels against oneDNN's packed linear: one pass over a model's weights.

Every linear weight of a Llama preset (bf16: the small one's are ~49 MiB, fp32 ~98 MiB, more
than this VM's caches keep, so a pass reads them from memory, as a decode step does),
multiplied by `rows` input rows: once through `kvgraph::packed_linear` over oneDNN-packed
weights (torch's mkldnn linear: what kvgraph ran before, and still runs where the tile kernels
do not) and once through kvgraph's kernel over the same weights in its tile layout
(`kvgraph.cpu.tile_weights`: `kvgraph_cpu::bf16_linear`, or `fp32_linear` with `--dtype float32`),
in alternating order per round; one compute thread. Prints the median ms per pass and the
ratio, writes JSON. bf16 rows 1-4 run AVX512-BF16 dot products, more run AMX tiles (dot
products where there is no AMX); fp32 rows all run AVX-512 fused multiply-adds.

    python -m examples.benchmarks.tile_linear [--dtype bfloat16] [--rows 1 4 16 64 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from examples.benchmarks.small_batch_linear import model_weights
from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS
from kvgraph.cpu.packed_linear import PACKING_BATCH_HINT, linear
from kvgraph.cpu.tile_weights import bf16_tiles_usable, fp32_tiles_usable, to_tiles

KINDS = ("oneDNN", "tiles")
USABLE = {"bfloat16": (bf16_tiles_usable, "no AVX512-BF16"),
          "float32": (fp32_tiles_usable, "no AVX-512")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(USABLE))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="tile_linear.json")
    return parser.parse_args(argv)


def measure(rows: int, weights: dict[str, list[torch.Tensor]], rounds: int) -> dict[str, Any]:
    dtype = weights["plain"][0].dtype
    inputs = {k: torch.randn(rows, k, dtype=dtype)
              for k in {w.shape[1] for w in weights["plain"]}}
    xs = [inputs[w.shape[1]] for w in weights["plain"]]

    def one_pass(kind: str) -> float:
        start = time.perf_counter()
        for x, weight in zip(xs, weights[kind]):
            linear(x, weight)
        return 1e3 * (time.perf_counter() - start)

    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for kind in KINDS:  # warm-up: first calls create oneDNN's primitives
        one_pass(kind)
    for round_index in range(rounds):
        for kind in (KINDS if round_index % 2 == 0 else KINDS[::-1]):
            samples[kind].append(one_pass(kind))
    ms = {kind: statistics.median(s) for kind, s in samples.items()}
    return {"rows": rows, "ms": ms, "ratio": ms["tiles"] / ms["oneDNN"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    usable, needs = USABLE[args.dtype]
    if not usable():
        raise SystemExit(f"kvgraph's {args.dtype} tile kernel does not run here ({needs}, or "
                         "the CPU kernels cannot be built: see the log)")
    torch.set_num_threads(args.threads)
    plain = [w.to(getattr(torch, args.dtype)) for w in model_weights(args.preset)]
    weights = {"plain": plain, "tiles": [to_tiles(w) for w in plain],
               "oneDNN": [torch.ops.mkldnn._reorder_linear_weight(w, PACKING_BATCH_HINT)
                          for w in plain]}
    mib = sum(w.numel() * w.element_size() for w in plain) / 2**20
    print(f"{args.preset} Llama's {len(plain)} linear weights ({mib:.0f} MiB {args.dtype}), "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds; median ms per pass")
    print(f"{'rows':>5}{'oneDNN':>10}{'tiles':>10}{'ratio':>8}")
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args), "weights_mib": mib,
               "date": time.strftime("%Y-%m-%d"), "results": []}
    for rows in args.rows:
        row = measure(rows, weights, args.rounds)
        payload["results"].append(row)
        print(f"{rows:>5}{row['ms']['oneDNN']:>10.2f}{row['ms']['tiles']:>10.2f}"
              f"{row['ratio']:>8.2f}", flush=True)
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
