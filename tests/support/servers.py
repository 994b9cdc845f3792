"""The HTTP server in tests: a server started in this process, and clients' requests to it.

`serving(model, mode)` runs examples/serve.py's server for `model` (a preset name or checkpoint
dir) on 127.0.0.1 until the block ends; `request_body(i)` is the i-th of a fixed mix of
completion requests, `complete`/`complete_all` send them (streamed or not) and return what the
client got; `stream_text` streams one; `metric` reads /metrics (`wait_for_metric` until it
reaches a value), and `wait_for_free_blocks` waits until /health says no request holds a KV block.

It needs the server's packages (the test extra): a test module that imports it without them is
skipped, as the server tests are.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from examples.serve import BackgroundServer, build_app, parse_args, start_engine  # noqa: E402

MAX_MODEL_LEN = 128
WORDS = "the quick brown fox jumps over the lazy dog hello world paged attention keeps blocks"


def request_body(i: int) -> dict:
    words = WORDS.split()
    prompt = " ".join(words[(i * 3) % len(words):] + words[: (i * 5) % 11])  # 5..25 words
    return {"prompt": prompt, "max_tokens": 4 + (i * 7) % 21, "temperature": 0,
            "stream": i % 2 == 1, "ignore_eos": i % 3 != 0}


@contextlib.contextmanager
def serving(model: str, mode: str, *flags: str, engine_loop: str = "thread"):
    args = parse_args(["--model", model, "--graph-mode", mode, "--piece-compiler", "eager",
                       "--max-num-tokens", "32", "--capture-sizes", "1,2,4,8,16,32",
                       "--max-num-seqs", "8", "--max-model-len", str(MAX_MODEL_LEN),
                       "--engine-loop", engine_loop, *flags])
    engine = start_engine(args)
    try:
        with BackgroundServer(build_app(engine, "tiny")) as server:
            yield server.url
    finally:
        engine.close()


async def complete(client: httpx.AsyncClient, body: dict, path="/v1/completions") -> dict:
    """One request's text, finish reason and token count, streamed or not."""
    if not body.get("stream"):
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        return {"text": text, "finish_reason": choice["finish_reason"],
                "tokens": data["usage"]["completion_tokens"]}
    events = []
    async with client.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    return {"text": "".join(c["delta"]["content"] if "delta" in c else c["text"] for c in chunks),
            "finish_reason": chunks[-1]["finish_reason"], "tokens": len(chunks)}


async def complete_all(url: str, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await asyncio.gather(*(complete(client, body) for body in bodies))


def metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for_metric(url: str, name: str, value: float) -> None:
    """Wait until /metrics says `name` is `value`: what the server does after a client has gone
    (a loaded machine may be seconds late, a minute fails the test)."""
    deadline = time.monotonic() + 60
    while (got := metric(url, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed {got}, never {value}"
        time.sleep(0.05)


def wait_for_free_blocks(url: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        health = httpx.get(f"{url}/health").json()
        if health["kv_blocks_free"] == health["kv_blocks_total"] and health["running"] == 0:
            break
        time.sleep(0.05)
    return health


async def stream_text(client, body, started: asyncio.Event) -> str:
    """A streamed request's text; `started` is set at its first chunk."""
    text = ""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: "):])["choices"][0]["text"]
                started.set()
    return text
