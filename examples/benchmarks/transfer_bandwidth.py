"""KV block transports against a plain memcpy of the same bytes, between two caches on one host.

Two caches of a model's shape (--layers layers of (key, value), --blocks blocks of 16 tokens,
--kv-heads x --head-size, fp32 or bf16) in two processes; the receiver pulls --pull blocks
(scattered, so runs are short, or --contiguous) from the sender: over gloo (BlockPair: P sends,
D receives), Mooncake's Transfer Engine over TCP and NIXL over UCX (D reads; each skipped with
its reason where it does not import). The reference is a memcpy of the same bytes in one
process (one `copy_` per run of blocks and tensor, as the transports move them). Rounds alternate the
transports; medians. Prints a table and writes JSON.

    python -m examples.benchmarks.transfer_bandwidth [--pull 512] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import time
from typing import Any, Sequence

import torch

from examples.benchmarks.timing import machine, write_json
from kvgraph.kv_transfer.block_pair import paired_runs

TRANSPORTS = ("gloo", "mooncake", "nixl")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=1024)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--pull", type=int, default=512, help="blocks moved per transfer")
    parser.add_argument("--contiguous", action="store_true", help="pull one run of blocks")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="transfer_bandwidth.json")
    return parser.parse_args(argv)


def caches(args: argparse.Namespace) -> dict[str, tuple[torch.Tensor, ...]]:
    shape = (args.blocks, 16, args.kv_heads, args.head_size)
    dtype = getattr(torch, args.dtype)
    return {f"layer.{i}": (torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
            for i in range(args.layers)}


def block_ids(args: argparse.Namespace, seed: int) -> tuple[list[int], list[int]]:
    if args.contiguous:
        return list(range(args.pull)), list(range(args.blocks - args.pull, args.blocks))
    rng = random.Random(seed)
    return rng.sample(range(args.blocks), args.pull), rng.sample(range(args.blocks), args.pull)


def transport(kind: str, kv_caches, timeout_s: float = 60.0):
    if kind == "mooncake":
        from kvgraph.kv_transfer.mooncake import MooncakeTransport
        return MooncakeTransport(kv_caches, "127.0.0.1")
    if kind == "nixl":
        from kvgraph.kv_transfer.nixl import NixlTransport
        return NixlTransport(kv_caches, timeout_s)
    from kvgraph.kv_transfer.torch_distributed import PointToPointTransport
    return PointToPointTransport(kv_caches, "127.0.0.1", timeout_s)


def sender_main(kind: str, args: argparse.Namespace, conn) -> None:
    """The prefill side: offers its cache, serves each pull until told to stop."""
    torch.set_num_threads(1)
    side = transport(kind, caches(args))
    offer = side.offer()
    conn.send(offer)
    handle = side.accept(offer)
    while (message := conn.recv()) is not None:
        side.serve_pull(handle, *message)
        conn.send("served")
        side.until_readable(conn)  # a one-sided read progresses here, until the next message
    side.close()


def time_transport(kind: str, args: argparse.Namespace, pulls: list) -> list[float]:
    """Seconds of each pull in `pulls`, the receiver in this process."""
    torch.set_num_threads(1)
    parent, child = mp.Pipe()
    process = mp.get_context("spawn").Process(target=sender_main, args=(kind, args, child))
    process.start()
    receiver = transport(kind, caches(args))
    handle = receiver.connect(parent.recv())
    seconds = []
    for src, dst in pulls:
        start = time.perf_counter()
        parent.send((src, dst))
        receiver.pull(handle, src, dst)
        parent.recv()
        seconds.append(time.perf_counter() - start)
    parent.send(None)
    process.join(60)
    receiver.close()
    return seconds


def memcpy_seconds(args: argparse.Namespace, pulls: list) -> list[float]:
    """The same runs copied between two caches in one process: one `copy_` per run and tensor."""
    torch.set_num_threads(1)
    src_caches, dst_caches = caches(args), caches(args)
    seconds = []
    for src, dst in pulls:
        runs = paired_runs(src, dst)
        start = time.perf_counter()
        for name, cache in src_caches.items():
            for s, d in zip(cache, dst_caches[name]):
                for first_src, first_dst, count in runs:
                    d[first_dst:first_dst + count].copy_(s[first_src:first_src + count])
        seconds.append(time.perf_counter() - start)
    return seconds


def available(kind: str) -> str | None:
    """Why `kind` cannot run here, or None."""
    try:
        if kind == "mooncake":
            from kvgraph.kv_transfer.mooncake import _import_engine
            _import_engine()
        elif kind == "nixl":
            from kvgraph.kv_transfer.nixl import _import_agent
            _import_agent()
    except Exception as error:  # noqa: BLE001 - reported in the table
        return str(error).splitlines()[0]
    return None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    pulls = [block_ids(args, seed) for seed in range(4)]
    nbytes = sum(t[0].numel() * t.element_size() for c in caches(args).values() for t in c)
    moved = nbytes * args.pull
    skipped = {k: why for k in TRANSPORTS if (why := available(k))}
    samples: dict[str, list[float]] = {k: [] for k in ("memcpy", *TRANSPORTS) if k not in skipped}
    for round_ in range(args.rounds):
        order = list(samples)
        order = order[round_ % len(order):] + order[:round_ % len(order)]
        for kind in order:
            samples[kind] += (memcpy_seconds(args, pulls) if kind == "memcpy"
                              else time_transport(kind, args, pulls))
    rows = {k: {"ms": 1e3 * statistics.median(v), "GB_s": moved / statistics.median(v) / 1e9}
            for k, v in samples.items()}
    print(f"{args.pull} blocks of {nbytes / 2**10:.0f} KiB over {args.layers} layers "
          f"({moved / 2**20:.0f} MiB, {'one run' if args.contiguous else 'scattered'}), one "
          f"thread a side, median of {args.rounds} rounds x {len(pulls)} pulls:")
    for kind, row in rows.items():
        print(f"  {kind:9s} {row['ms']:8.2f} ms  {row['GB_s']:6.2f} GB/s  "
              f"{rows['memcpy']['ms'] / row['ms']:5.2f}x memcpy's speed")
    for kind, why in skipped.items():
        print(f"  {kind:9s} not run: {why}")
    payload = {"machine": machine(torch.device("cpu")), "args": vars(args), "bytes": moved,
               "rows": rows, "skipped": skipped, "samples": samples}
    write_json(args.json, json.loads(json.dumps(payload, default=str)))
    return payload


if __name__ == "__main__":
    main()
