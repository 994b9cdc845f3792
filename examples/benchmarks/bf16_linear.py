"""kvgraph's bf16 tile kernel against oneDNN's packed linear: one pass over a model's weights.

Every linear weight of a Llama preset (bf16; the small one's are ~49 MiB, more than this VM's
caches keep, so a pass reads them from memory, as a decode step does), multiplied by `rows`
input rows: once through `kvgraph::packed_linear` over oneDNN-packed weights (torch's mkldnn
linear: what kvgraph ran before, and still runs without AVX512-BF16) and once through
`kvgraph_cpu::bf16_linear` over the same weights in kvgraph's tile layout, in alternating order
per round; one compute thread. Prints the median ms per pass and the ratio, writes JSON. Rows
1-4 run AVX512-BF16 dot products, more run AMX tiles (dot products where there is no AMX).

    python -m examples.benchmarks.bf16_linear [--preset small] [--rows 1 4 16 64 1024]
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
from kvgraph.packed_linear import PACKING_BATCH_HINT, bf16_tiles_usable, linear, pack_weight

KINDS = ("oneDNN", "bf16_tiles")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64, 256, 1024])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="bf16_linear.json")
    return parser.parse_args(argv)


def measure(rows: int, weights: dict[str, list[torch.Tensor]], rounds: int) -> dict[str, Any]:
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16)
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
    return {"rows": rows, "ms": ms, "ratio": ms["bf16_tiles"] / ms["oneDNN"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not bf16_tiles_usable():
        raise SystemExit("kvgraph's bf16 tile kernel does not run here (no AVX512-BF16, or the "
                         "CPU kernels cannot be built: see the log)")
    torch.set_num_threads(args.threads)
    plain = [w.to(torch.bfloat16) for w in model_weights(args.preset)]
    weights = {"plain": plain, "bf16_tiles": [pack_weight(w) for w in plain],
               "oneDNN": [torch.ops.mkldnn._reorder_linear_weight(w, PACKING_BATCH_HINT)
                          for w in plain]}
    mib = sum(w.numel() * w.element_size() for w in plain) / 2**20
    print(f"{args.preset} Llama's {len(plain)} linear weights ({mib:.0f} MiB bf16), "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds; median ms per pass")
    print(f"{'rows':>5}{'oneDNN':>10}{'bf16_tiles':>12}{'ratio':>8}")
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args), "weights_mib": mib,
               "date": time.strftime("%Y-%m-%d"), "results": []}
    for rows in args.rows:
        row = measure(rows, weights, args.rounds)
        payload["results"].append(row)
        print(f"{rows:>5}{row['ms']['oneDNN']:>10.2f}{row['ms']['bf16_tiles']:>12.2f}"
              f"{row['ratio']:>8.2f}", flush=True)
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
