"""The small-batch linear against F.linear: one pass over a model's weights.

Every linear weight of a Llama preset (fp32: the small one's are ~94 MiB, more than the caches
hold, so each pass reads them from memory, as a decode step does), multiplied by `rows` input
rows, first with `F.linear` and then with `kvgraph_cpu::small_batch_linear`, in alternating
order per round; one compute thread. Prints the median ms per pass and the ratio, writes JSON.
Past 16 rows the kernel hands the batch to F.linear (MKL's sgemm), so in fp32 those rows show
its cost of asking. `--dtype bfloat16` times plain bf16 weights, which the kernel takes where
oneDNN cannot pack bf16: F.linear is then torch's own bf16 matmul, and past 16 rows the kernel
widens to fp32 for MKL.

    python -m examples.benchmarks.small_batch_linear [--preset small] [--rows 1 4 8 16 32] \
        [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from examples.benchmarks.timing import machine, write_json
from examples.models.llama import PRESETS, Llama
from kvgraph.packed_linear import small_batch_kernel_loaded

KINDS = ("F.linear", "small_batch")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", default="small_batch_linear.json")
    return parser.parse_args(argv)


def model_weights(preset: str) -> list[torch.Tensor]:
    """The preset's linear weights (`[out, in]`, fp32), the lm_head's included."""
    model = Llama.from_preset(preset, dtype=torch.float32, seed=0)
    return [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]


def pass_ms(matmul: Callable, inputs: dict[int, torch.Tensor], weights: list[torch.Tensor]
            ) -> float:
    start = time.perf_counter()
    for weight in weights:
        matmul(inputs[weight.shape[1]], weight)
    return 1e3 * (time.perf_counter() - start)


def measure(rows: int, weights: list[torch.Tensor], rounds: int) -> dict[str, Any]:
    inputs = {k: torch.randn(rows, k, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}}
    matmuls = {"F.linear": nn.functional.linear,
               "small_batch": lambda x, w: torch.ops.kvgraph_cpu.small_batch_linear(x, w, None)}
    samples: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for kind in KINDS:  # warm-up: first calls load and allocate
        pass_ms(matmuls[kind], inputs, weights)
    for round_index in range(rounds):
        for kind in (KINDS if round_index % 2 == 0 else KINDS[::-1]):
            samples[kind].append(pass_ms(matmuls[kind], inputs, weights))
    ms = {kind: statistics.median(s) for kind, s in samples.items()}
    return {"rows": rows, "ms": ms, "ratio": ms["small_batch"] / ms["F.linear"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if not small_batch_kernel_loaded():
        raise SystemExit("kvgraph's CPU kernels cannot be built here (see the log)")
    torch.set_num_threads(args.threads)
    weights = [w.to(getattr(torch, args.dtype)) for w in model_weights(args.preset)]
    mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
    print(f"{args.preset} Llama's {len(weights)} linear weights ({mib:.0f} MiB {args.dtype}), "
          f"{args.threads} thread(s), {args.rounds} interleaved rounds; median ms per pass")
    print(f"{'rows':>5}{'F.linear':>11}{'small_batch':>13}{'ratio':>8}")
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args), "weights_mib": mib,
               "date": time.strftime("%Y-%m-%d"), "results": []}
    for rows in args.rows:
        row = measure(rows, weights, args.rounds)
        payload["results"].append(row)
        print(f"{rows:>5}{row['ms']['F.linear']:>11.2f}{row['ms']['small_batch']:>13.2f}"
              f"{row['ratio']:>8.2f}", flush=True)
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
