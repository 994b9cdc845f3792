"""Weights in 4 KiB pages against huge pages on the CPU: reading them, and the engine's steps.

First the model's linear weights (plain `[out, in]` copies of whatever the engine packed them
into: on AMD processors with AVX-512 its fp32 linears are oneDNN's, which stay where oneDNN put
them, so there only the reading rounds say what huge pages would do for them), copied once
into ordinary memory and once into huge-page memory
(`kvgraph.cpu.huge_pages`), each read in alternating rounds: summed (a plain stream), and multiplied
by 1 and 16 input rows with the small-batch kernel (a decode step's matmuls). Then two example
engines in one process, `--no-huge-pages` and `--huge-pages` (same model and flags otherwise:
the engine's defaults, one thread unless --threads, no prefix caching), rounds alternating
their order: a decode step at each batch size and a prefill of 16 prompts of 64 tokens, timed
through `generate` as served. Prints medians and huge / 4 KiB, writes JSON.

    python -m examples.benchmarks.huge_pages [--model DIR | --preset small] [--dtype bfloat16] \
        [--rounds 8]
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch
from torch import nn

from examples.benchmarks.engine_steps import alternating_step_ms, engine_parser
from examples.benchmarks.timing import machine, write_json
from examples.engine import build_engine
from examples.models import MODELS
from kvgraph.cpu.huge_pages import huge_page_tensors, thp_unavailable_reason
from kvgraph.cpu.packed_linear import PackedLinear
from kvgraph.cpu.small_batch_linear import SmallBatchLinear, small_batch_kernel_loaded
from kvgraph.cpu.tile_weights import from_tiles, is_tile_packed

SETTINGS = {"4k": False, "huge": True}  # name: --huge-pages


def reading_ms(weights: list[torch.Tensor], rounds: int) -> dict[str, dict[str, float]]:
    """Median ms to read `weights` each way, from ordinary and from huge-page memory."""
    copies = {"4k": [w.clone() for w in weights],
              "huge": huge_page_tensors([(w.shape, w.dtype) for w in weights])}
    for plain, huge in zip(weights, copies["huge"]):
        huge.copy_(plain)
    ways: dict[str, Callable[[torch.Tensor], Any]] = {"sum": torch.sum}
    if small_batch_kernel_loaded():
        for rows in (1, 16):
            inputs = {k: torch.randn(rows, k, dtype=weights[0].dtype)
                      for k in {w.shape[1] for w in weights}}
            ways[f"small_batch {rows} row(s)"] = (
                lambda w, inputs=inputs: torch.ops.kvgraph_cpu.small_batch_linear(
                    inputs[w.shape[1]], w, None))
    samples = {(name, way): [] for name in copies for way in ways}
    for round_index in range(rounds + 1):  # the first round warms up
        for name in copies if round_index % 2 == 0 else list(copies)[::-1]:
            for way, read in ways.items():
                start = time.perf_counter()
                for w in copies[name]:
                    read(w)
                if round_index:
                    samples[name, way].append(1e3 * (time.perf_counter() - start))
    return {name: {way: statistics.median(samples[name, way]) for way in ways} for name in copies}


def plain_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` as a plain `[out, in]` tensor: oneDNN's packed one densified, kvgraph's tile
    layouts laid back."""
    if weight.layout == torch._mkldnn:
        return weight.to_dense()
    return from_tiles(weight) if is_tile_packed(weight) else weight


def engine_ms(args) -> tuple[list[torch.Tensor], dict[str, dict[str, float]]]:
    """Median ms of the engine's steps without and with huge pages (see the docstring), and
    the model's linear weights as plain tensors."""
    engines = {}
    for name, huge in SETTINGS.items():
        args.huge_pages = huge
        engines[name] = build_engine(args, MODELS)[0]
    steps = alternating_step_ms(engines, args)
    weights = [plain_weight(m.weight.detach()) for m in engines["4k"].runner.model.modules()
               if isinstance(m, (nn.Linear, SmallBatchLinear, PackedLinear))]
    for engine in engines.values():
        engine.runner.close()
    return weights, steps


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = engine_parser(__doc__.splitlines()[0], 8, "huge_pages.json")
    args = parser.parse_args(argv)
    reason = thp_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"no transparent huge pages here: {reason}")
    args.threads = args.threads or 1
    args.enable_prefix_caching = False  # the rounds repeat their prompts: compute them each time
    weights, steps = engine_ms(args)
    torch.set_num_threads(args.threads)
    reads = reading_ms(weights, args.rounds)
    mib = sum(w.numel() * w.element_size() for w in weights) / 2**20
    payload = {"machine": machine(torch.device("cpu")), "date": time.strftime("%Y-%m-%d"),
               "args": vars(args), "weights_mib": mib, "reading_ms": reads, "engine_ms": steps}
    write_json(args.json, payload)
    print(f"{args.preset or args.model} Llama, {args.dtype}, {args.threads} thread(s), "
          f"{args.rounds} rounds; median ms, huge pages / 4 KiB pages")
    for title, table in ((f"reading {len(weights)} linear weights ({mib:.0f} MiB)", reads),
                         ("engine steps", steps)):
        print(title)
        for what in table["4k"]:
            small, huge = table["4k"][what], table["huge"][what]
            print(f"  {what:<28}{small:>10.2f}{huge:>10.2f}{huge / small:>8.2f}x")
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
