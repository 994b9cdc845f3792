"""Serving throughput per graph mode: N concurrent streaming clients against the HTTP server.

For each graph mode a server is started as a subprocess (`python -m examples.serve`, flags
passed through), then `--num-clients` clients send `--num-requests` streaming completions in
all, with prompt and output lengths drawn from a fixed mix (random prompt token ids,
`ignore_eos`, so every request makes exactly its output length). Prints requests/s, output
tokens/s and time-to-first-token / inter-token-latency percentiles, and writes JSON.

    python -m examples.benchmarks.serve_throughput --preset tiny --num-clients 8 \
        --graph-modes eager,piecewise,full_and_piecewise [--json serve_throughput.json]

`--url URL` measures a server that is already running instead (one row).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

import httpx
import torch

PERCENTILES = (50, 90, 99)
# Prompt token ids below 256 are valid for every example model and checkpoint vocabulary.
MAX_PROMPT_TOKEN = 256
STARTUP_TIMEOUT_S = 600


def workload(num_requests: int, prompt_lens: Sequence[int], output_lens: Sequence[int],
             seed: int) -> list[dict[str, Any]]:
    """The request bodies, repeatable for a seed: lengths cycle through the mix."""
    rng = random.Random(seed)
    return [{"prompt": [rng.randrange(MAX_PROMPT_TOKEN) for _ in range(prompt_lens[i % len(
                prompt_lens)])],
             "max_tokens": output_lens[(i // len(prompt_lens)) % len(output_lens)],
             "temperature": 0, "ignore_eos": True, "stream": True}
            for i in range(num_requests)]


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """Send one streaming completion; its TTFT, its inter-token gaps and its token count."""
    start = time.perf_counter()
    times = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
    return {"ttft": times[0] - start, "itl": [b - a for a, b in zip(times, times[1:])],
            "tokens": len(times)}


async def run_clients(url: str, bodies: list[dict[str, Any]], num_clients: int
                      ) -> tuple[list[dict[str, Any]], float]:
    """`num_clients` clients, each sending the next unsent request when its last one is done."""
    pending = list(reversed(bodies))
    results: list[dict[str, Any]] = []

    async def client_loop(client: httpx.AsyncClient) -> None:
        while pending:
            results.append(await one_request(client, pending.pop()))

    limits = httpx.Limits(max_connections=num_clients)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(num_clients)))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    return float(torch.tensor(values, dtype=torch.float64).quantile(q / 100)) if values else 0.0


def summarize(results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    ttft = [r["ttft"] for r in results]
    itl = [gap for r in results for gap in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    row = {"requests": len(results), "seconds": seconds, "requests_per_s": len(results) / seconds,
           "output_tokens_per_s": tokens / seconds}
    for q in PERCENTILES:
        row[f"ttft_p{q}_ms"] = percentile(ttft, q) * 1e3
        row[f"itl_p{q}_ms"] = percentile(itl, q) * 1e3
    return row


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(mode: str, server_args: list[str]) -> tuple[subprocess.Popen, str]:
    """A server subprocess in `mode`, once /health answers."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "examples.serve", "--port", str(port),
                                "--graph-mode", mode, *server_args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the {mode} server exited: {process.stderr.read()[-3000:]}")
        try:
            httpx.get(f"{url}/health", timeout=1).raise_for_status()
            return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"the {mode} server did not start in {STARTUP_TIMEOUT_S} s")


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    bodies = workload(args.num_requests, args.prompt_lens, args.output_lens, args.seed)
    asyncio.run(run_clients(url, bodies[:args.num_clients], args.num_clients))  # warm-up
    return summarize(*asyncio.run(run_clients(url, bodies, args.num_clients)))


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ("| mode | req/s | out tok/s | TTFT p50 / p90 / p99 (ms) | "
              "ITL p50 / p90 / p99 (ms) |")
    print(header)
    print("|---|---|---|---|---|")
    for r in rows:
        ttft = " / ".join(f"{r[f'ttft_p{q}_ms']:.1f}" for q in PERCENTILES)
        itl = " / ".join(f"{r[f'itl_p{q}_ms']:.1f}" for q in PERCENTILES)
        print(f"| {r['mode']} | {r['requests_per_s']:.2f} | {r['output_tokens_per_s']:.1f} | "
              f"{ttft} | {itl} |")


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    def lengths(text: str) -> list[int]:
        return [int(v) for v in text.split(",")]

    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Other flags (--model, --preset, --piece-compiler, ...) go to the server.")
    parser.add_argument("--graph-modes", default="eager,piecewise,full_and_piecewise,"
                        "full_decode_only")
    parser.add_argument("--url", help="measure this running server instead of starting one")
    parser.add_argument("--num-clients", type=int, default=8)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-lens", type=lengths, default=[16, 64, 200])
    parser.add_argument("--output-lens", type=lengths, default=[16, 48])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="serve_throughput.json")
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args, server_args = parse_args(argv)
    rows = []
    if args.url:
        rows.append({"mode": args.url, **measure(args.url, args)})
    for mode in [] if args.url else args.graph_modes.split(","):
        process, url = start_server(mode, server_args)
        try:
            rows.append({"mode": mode, **measure(url, args)})
        finally:
            process.terminate()
            process.wait()
    print_table(rows)
    meta = {"torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "server_args": server_args,
            "num_clients": args.num_clients, "num_requests": args.num_requests,
            "prompt_lens": args.prompt_lens, "output_lens": args.output_lens}
    with open(args.json, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
