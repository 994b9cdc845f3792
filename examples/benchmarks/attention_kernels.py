"""One attention call: kvgraph's paged backends against SDPA on dense tensors of the same sizes.

Decode (one query token per request, the whole context cached) and causal prefill, with the
1B Llama's heads (32 query, 8 KV, head_dim 64), block size 16 and shuffled block tables. Each
backend call writes the step's new keys/values into the cache and attends, as in a model step;
SDPA only attends. Every case is checked against SDPA once (max |diff| printed), then timed:
median of repeated runs after warm-up, eagerly and, on CUDA, replayed from a CUDA graph.
The target (issue 9): decode attention within 1.5x of SDPA.

    python -m examples.benchmarks.attention_kernels --device cuda       # bf16, the full set
    python -m examples.benchmarks.attention_kernels                     # CPU: torch_native only
    TRITON_INTERPRET=1 python -m examples.benchmarks.attention_kernels --smoke
                                    # CPU: tiny shapes, Triton too, in Triton's interpreter
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.nn import functional as F

import kvgraph
from examples.benchmarks.timing import machine, median_ms, synchronize, write_json
from kvgraph.attention.backends import get_attention_backend

BLOCK_SIZE = 16
DECODE_TARGET = 1.5  # a decode call may take at most this many times SDPA's time
TARGET_LABELS = {True: "ok", False: "MISS", None: "-"}


@dataclass(frozen=True)
class Case:
    """One attention call: `batch` requests of `context` tokens, the last `query_len` new."""

    kind: str  # "decode" or "prefill"
    batch: int
    context: int
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 64

    @property
    def query_len(self) -> int:
        return 1 if self.kind == "decode" else self.context

    @property
    def name(self) -> str:
        return f"{self.kind} b={self.batch} ctx={self.context}"


def decode_cases(batches, contexts, **heads) -> list[Case]:
    return [Case("decode", b, c, **heads) for c in contexts for b in batches]


CASE_SETS = {
    "cuda": decode_cases((1, 8, 64), (1024, 8192)) + [Case("prefill", 1, 4096)],
    "cpu": decode_cases((1, 8), (1024,)) + [Case("prefill", 1, 512)],
    # Triton's interpreter runs each program in Python: a few heads and keys only.
    "smoke": decode_cases((1, 2), (48,), heads=4, kv_heads=2, head_dim=16)
    + [Case("prefill", 1, 24, heads=4, kv_heads=2, head_dim=16)],
}
# (warm-up calls, timed repeats, calls per repeat)
TIMING = {"cuda": (5, 15, 10), "cpu": (2, 5, 1), "smoke": (1, 3, 1)}


@dataclass
class Inputs:
    """A case's tensors: dense (for SDPA) and paged (for the backends), the same values."""

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D]: the new rows, written by the backend call
    value: torch.Tensor
    caches: list[torch.Tensor]  # key_cache, value_cache [blocks, BLOCK_SIZE, Hkv, D]
    metadata: Any
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q [B,H,Q,D], k and v [B,Hkv,C,D]


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device) -> Inputs:
    """Random keys/values laid out both ways; each request's blocks drawn at random."""
    generator = torch.Generator().manual_seed(0)
    device_generator = torch.Generator(device).manual_seed(0)  # 8k-token batches: fill there

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=device_generator, device=device).to(dtype)

    b, c, q = case.batch, case.context, case.query_len
    keys, values = (randn(b, c, case.kv_heads, case.head_dim) for _ in range(2))
    query = randn(b, q, case.heads, case.head_dim)
    blocks_per_seq = -(-c // BLOCK_SIZE)
    table = (torch.randperm(b * blocks_per_seq, generator=generator) + 1).view(b, blocks_per_seq)
    caches = [torch.zeros(b * blocks_per_seq + 1, BLOCK_SIZE, case.kv_heads, case.head_dim,
                          dtype=dtype, device=device) for _ in range(2)]
    positions = torch.arange(c)
    slots = (table[:, positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE).to(device)
    for cache, rows in zip(caches, (keys, values)):
        cache.view(-1, case.kv_heads, case.head_dim)[slots.flatten()] = rows.flatten(0, 1)
    chunks = [kvgraph.RequestChunk([0] * q, c - q, row.tolist()) for row in table]
    return Inputs(
        query=query.flatten(0, 1), key=keys[:, c - q:].flatten(0, 1),
        value=values[:, c - q:].flatten(0, 1), caches=caches,
        metadata=kvgraph.build_attention_metadata(chunks, BLOCK_SIZE, device),
        dense=(query.transpose(1, 2).contiguous(), keys.transpose(1, 2).contiguous(),
               values.transpose(1, 2).contiguous()),
    )


def sdpa_call(case: Case, inputs: Inputs) -> Callable[[], torch.Tensor]:
    """SDPA on the dense tensors; returns `[T, H, D]` like the backends."""
    q, k, v = inputs.dense
    causal = case.kind == "prefill"

    def call() -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True,
                                             scale=case.head_dim**-0.5)
        return out.transpose(1, 2).flatten(0, 1)

    return call


def backend_call(name: str, case: Case, inputs: Inputs) -> Callable[[], torch.Tensor]:
    """kvgraph backend `name`: write this step's keys/values into the cache, attend."""
    backend = get_attention_backend(name, inputs.query.device)
    out = torch.empty_like(inputs.query)

    def call() -> torch.Tensor:
        backend.forward(inputs.query, inputs.key, inputs.value, inputs.caches, out,
                        inputs.metadata, case.head_dim**-0.5, sliding_window=None, write_kv=True)
        return out

    return call


def time_ms(fn: Callable[[], Any], device: torch.device, timing: tuple[int, int, int]) -> float:
    """Median ms per call over `repeats` runs of `calls` calls each, after `warmup` calls."""
    warmup, repeats, calls = timing
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        seconds.append((time.perf_counter() - start) / calls)
    return median_ms(seconds)


def graph_ms(fn: Callable[[], Any], device: torch.device,
             timing: tuple[int, int, int]) -> float | None:
    """`time_ms` of `fn` captured once in a CUDA graph and replayed; None off CUDA or when the
    call cannot be captured (the reason printed)."""
    if device.type != "cuda":
        return None
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError as error:
        print(f"  not capturable: {error}")
        return None
    return time_ms(graph.replay, device, timing)


def available_backends(args) -> list[str]:
    """kvgraph backends this run times: torch_native always; triton where it can run."""
    if args.device.type == "cpu" and not args.smoke:
        print("triton skipped: on a CPU it runs only in Triton's interpreter, with --smoke")
        return ["torch_native"]
    try:
        get_attention_backend("triton", args.device)
    except (ImportError, ValueError) as error:  # not installed; on a CPU, not interpreting
        print(f"triton skipped: {error} (on a CPU: TRITON_INTERPRET=1 and --smoke)")
        return ["torch_native"]
    return ["triton", "torch_native"]


def measure_case(case: Case, backends: list[str], args) -> dict[str, Any]:
    """Check each backend against SDPA once, then time them all, eagerly and as graphs."""
    inputs = make_inputs(case, args.torch_dtype, args.device)
    calls = {"sdpa": sdpa_call(case, inputs)}
    calls.update({name: backend_call(name, case, inputs) for name in backends})
    expected = calls["sdpa"]().float()
    row: dict[str, Any] = {"case": case.name, **vars(case), "max_abs_diff": {}, "ms": {},
                           "graph_ms": {}}
    for name in backends:
        row["max_abs_diff"][name] = (calls[name]().float() - expected).abs().max().item()
    print(f"{case.name}: max |diff| vs sdpa " + ", ".join(
        f"{name} {diff:.2e}" for name, diff in row["max_abs_diff"].items()), flush=True)
    for name, fn in calls.items():
        row["ms"][name] = time_ms(fn, args.device, args.timing)
        row["graph_ms"][name] = graph_ms(fn, args.device, args.timing)
    row["meets_target"] = meets_target(row, args.device)
    return row


def ratio(times: dict[str, float | None]) -> float | None:
    """Triton's time over SDPA's, where both were measured."""
    triton_ms, sdpa_ms = times.get("triton"), times.get("sdpa")
    return triton_ms / sdpa_ms if triton_ms is not None and sdpa_ms is not None else None


def meets_target(row: dict[str, Any], device: torch.device) -> bool | None:
    """Whether a decode row meets the target, judged on graph replays (no launch overhead)
    where there are any; None for prefill, without Triton, and off CUDA (the target's GPU)."""
    judged = ratio(row["graph_ms"]) or ratio(row["ms"])
    if row["kind"] != "decode" or judged is None or device.type != "cuda":
        return None
    return judged <= DECODE_TARGET


def print_table(rows: list[dict[str, Any]]) -> None:
    def cell(value: float | None, width: int = 10, digits: int = 3) -> str:
        return f"{value:>{width}.{digits}f}" if value is not None else f"{'-':>{width}}"

    print(f"{'case':<22}{'sdpa ms':>10}{'triton ms':>10}{'ratio':>9}{'native ms':>10}"
          f"{'sdpa g ms':>10}{'triton g':>10}{'g ratio':>9}{'target':>7}")
    for row in rows:
        eager, graph, target = row["ms"], row["graph_ms"], TARGET_LABELS[row["meets_target"]]
        print(f"{row['case']:<22}{cell(eager['sdpa'])}{cell(eager.get('triton'))}"
              f"{cell(ratio(eager), 9, 2)}{cell(eager.get('torch_native'))}{cell(graph['sdpa'])}"
              f"{cell(graph.get('triton'))}{cell(ratio(graph), 9, 2)}{target:>7}")
    print(f"ratio: triton / sdpa; native: kvgraph's torch_native backend; g: replayed from a CUDA "
          f"graph.\ntarget: decode triton within {DECODE_TARGET}x of sdpa (graph replays where "
          f"measured; CUDA only)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:i]")
    parser.add_argument("--dtype", help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes; on a CPU, Triton in its interpreter too")
    parser.add_argument("--json", default="attention_kernels.json")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    args.dtype = args.dtype or ("bfloat16" if args.device.type == "cuda" else "float32")
    args.torch_dtype = getattr(torch, args.dtype)
    shapes = "smoke" if args.smoke else ("cuda" if args.device.type == "cuda" else "cpu")
    args.cases, args.timing = CASE_SETS[shapes], TIMING[shapes]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    backends = available_backends(args)
    rows = [measure_case(case, backends, args) for case in args.cases]
    print(f"\n{args.dtype}, {args.device}, block size {BLOCK_SIZE}, shuffled block tables")
    print_table(rows)
    payload = {"machine": machine(args.device), "dtype": args.dtype, "backends": backends,
               "rows": rows}
    write_json(args.json, payload)
    print(f"wrote {args.json}")
    return payload


if __name__ == "__main__":
    main()
