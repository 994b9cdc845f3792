"""A timed streaming workload for serving benchmarks: requests decoding steadily while long
prompts arrive among them.

`decoders` clients each send a short prompt and stream its output (between half of
`decode_tokens` and all of it, drawn), then the next, until every long prompt is answered; the
long prompts are sent at fixed times (one every `long_every_s`, the first after one gap). Every
request is a streaming completion of random prompt token ids with `ignore_eos`, so it makes
exactly its output length. Each request's time to first token (TTFT) and the gaps between its
tokens (inter-token latency, ITL) are what the client sees, whatever stands behind the URL (a
server, or a proxy over several).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from examples.benchmarks.serve_throughput import MAX_PROMPT_TOKEN, one_request, percentile


@dataclass(frozen=True)
class MixedWorkload:
    """The mix: steady decoders and long prompts arriving among them."""

    decoders: int = 4
    short_len: int = 32
    decode_tokens: int = 128
    long_prompts: int = 4
    long_len: int = 1536
    long_tokens: int = 16
    long_every_s: float = 2.0


def completion(rng: random.Random, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    """A streaming greedy completion of `prompt_len` random token ids, exactly `max_tokens` out."""
    return {"prompt": [rng.randrange(MAX_PROMPT_TOKEN) for _ in range(prompt_len)],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


async def run_mixed(url: str, work: MixedWorkload, seed: int) -> dict[str, Any]:
    """One run of `work` against `url`: each request's TTFT, ITL gaps, tokens and prompt length,
    as `{"decode": [...], "long": [...], "seconds": the run's wall time}`. The prompts are the
    same for a seed whatever serves them (each decoder draws its own, so how many it sends does
    not change the long ones)."""
    # String seeds: an int seed's sign is dropped (seed -1 draws what seed 1 does), and a
    # prompt repeated across runs would be served from the prefix cache.
    rng = random.Random(f"long prompts {seed}")
    longs = [completion(rng, work.long_len, work.long_tokens) for _ in range(work.long_prompts)]
    results: dict[str, Any] = {"decode": [], "long": []}
    done = asyncio.Event()

    async def timed(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        return {**await one_request(client, body), "prompt_tokens": len(body["prompt"])}

    async def decoder(client: httpx.AsyncClient, index: int) -> None:
        own = random.Random(f"decoder {index} {seed}")
        while not done.is_set():
            # Lengths drawn, so the decoders drift apart rather than finish and start together.
            tokens = own.randint(max(1, work.decode_tokens // 2), work.decode_tokens)
            body = completion(own, work.short_len, tokens)
            results["decode"].append(await timed(client, body))

    async def long_prompt(client: httpx.AsyncClient, index: int, start: float) -> None:
        await asyncio.sleep(start + (index + 1) * work.long_every_s - time.perf_counter())
        results["long"].append(await timed(client, longs[index]))

    # One connection per request in flight: none waits for another's. An idle one is dropped
    # before the server's 5 s keep-alive could close it under a request sent on it.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None,
                          keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        decoders = [asyncio.create_task(decoder(client, i)) for i in range(work.decoders)]
        try:
            await asyncio.gather(*(long_prompt(client, i, start)
                                   for i in range(work.long_prompts)))
        finally:
            done.set()  # the decoders finish the request they are in, and send no more
            await asyncio.gather(*decoders)
        results["seconds"] = time.perf_counter() - start
    return results


def summarize(results: list[dict[str, Any]]) -> dict[str, float]:
    """TTFT and ITL p50 / p99 / p99.9 / max (ms) of `results`, with their request and token
    counts. The tail past p99 is kept: a long prefill stalls a decoding request for one or two
    gaps among hundreds, which p99 alone can miss."""
    values = {"ttft": [r["ttft"] for r in results],
              "itl": [gap for r in results for gap in r["itl"]]}
    row = {"requests": len(results), "tokens": sum(r["tokens"] for r in results)}
    for name, seconds in values.items():
        for q in (50, 99, 99.9):
            row[f"{name}_p{q:g}_ms"] = percentile(seconds, q) * 1e3
        row[f"{name}_max_ms"] = max(seconds, default=0.0) * 1e3
    return row
