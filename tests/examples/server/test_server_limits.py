"""What the server refuses, and how: every body it cannot serve is a 4xx naming the field,
streamed or not (before the stream starts), and every response is counted in /metrics.

One test per adversarial finding: lone surrogates, deep nesting, numbers the engine cannot
hold, an overflowing top_k beside a valid request, uncounted 500s, a checkpoint without
tokenizer.json.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import shutil

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from examples.engine import AsyncEngine  # noqa: E402
from examples.engine.json_body import MAX_BODY_BYTES, MAX_JSON_DEPTH  # noqa: E402
from examples.engine.tokenizer import ByteTokenizer  # noqa: E402
from examples.models.llama import Llama  # noqa: E402
from examples.serve import BackgroundServer, build_app, main  # noqa: E402
from tests.support.engines import make_engine  # noqa: E402
from tests.support.servers import serving  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
VALID = {"prompt": "hello", "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def url(checkpoint):
    with serving(str(checkpoint), "eager") as url:
        yield url


def raw(body: dict, **fields_as_json: str) -> bytes:
    """`body` as JSON with more fields whose values are given as raw JSON text."""
    text = json.dumps(body)[:-1]
    for name, value in fields_as_json.items():
        text += f', "{name}": {value}'
    return (text + "}").encode()


def post(url: str, content: bytes, stream: bool, path: str = COMPLETIONS) -> httpx.Response:
    """POST `content`; with `stream`, as a streaming client reads it (the body is read whole)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        if not stream:
            return client.post(path, content=content)
        with client.stream("POST", path, content=content) as response:
            response.read()
            return response


def assert_refused(response: httpx.Response, field: str, status: int = 400) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"  # not a cut event stream
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path, body, field", [
    (COMPLETIONS, {"prompt": "ab\ud800"}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["ok", "\udfff"]}, "stop"),
    (COMPLETIONS, {"prompt": "hi", "model": "m\ud800"}, "model"),
    (COMPLETIONS, {"prompt": "hi", "user": {"name": ["\ud83d"]}}, "user"),  # one we never read
    (COMPLETIONS, {"prompt": "hi", "\ud800": 1}, "body"),
    (CHAT, {"messages": [{"role": "user", "content": "hi \udc00"}]}, "messages"),
])
def test_lone_surrogates_are_a_400(url, stream, path, body, field):
    content = json.dumps({**VALID, **body, "stream": stream}).encode()  # escaped as \ud800
    assert_refused(post(url, content, stream, path), field)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_bodies_nested_past_the_limit_are_a_400(url, stream):
    body = {**VALID, "stream": stream}
    assert_refused(post(url, raw(body, x=nested(100_000)), stream), "body")
    # The body is one level: a field may hold MAX_JSON_DEPTH - 1 more, and no more.
    assert_refused(post(url, raw(body, x=nested(MAX_JSON_DEPTH)), stream), "x")
    assert post(url, raw(body, x=nested(MAX_JSON_DEPTH - 1)), stream).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_bodies_past_the_size_limit_are_a_413(url, stream):
    padding = "a" * MAX_BODY_BYTES
    content = json.dumps({**VALID, "stream": stream, "padding": padding}).encode()
    assert_refused(post(url, content, stream), "body", status=413)


HUGE = str(10**400)  # no float holds it
UNREPRESENTABLE = [
    ("temperature", HUGE), ("temperature", "1e400"), ("temperature", "NaN"),
    ("temperature", "-Infinity"), ("temperature", "true"),
    ("top_p", HUGE), ("top_p", "Infinity"), ("top_p", "false"),
    ("seed", str(2**64)), ("seed", str(-2**63 - 1)), ("seed", "true"), ("seed", "1.0"),
    ("top_k", str(2**63)), ("top_k", "false"),
    ("max_tokens", str(2**63)), ("max_tokens", "1e3"),
    ("n", HUGE), ("n", "true"),
    ("presence_penalty", HUGE), ("presence_penalty", "NaN"),
    ("frequency_penalty", "1e400"), ("frequency_penalty", "true"),
    ("prompt", f"[1, {2**63}]"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("field, value", UNREPRESENTABLE,
                         ids=[f"{f}={'10**400' if v == HUGE else v}" for f, v in UNREPRESENTABLE])
def test_numbers_the_engine_cannot_hold_are_a_400(url, stream, field, value):
    body = {k: v for k, v in {**VALID, "stream": stream}.items() if k != field}
    assert_refused(post(url, raw(body, **{field: value}), stream), field)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_numbers_at_the_bounds_are_served(url, stream):
    for field, value in [("seed", 2**63 - 1), ("seed", -2**63), ("top_k", 2**63 - 1),
                         ("temperature", 1e300), ("presence_penalty", 0)]:
        content = json.dumps({**VALID, "stream": stream, field: value}).encode()
        assert post(url, content, stream).status_code == 200, (field, value)
    # An integer too long for Python to read is still a 400 (it is refused as JSON).
    body = {"prompt": "hi", "stream": stream}
    assert_refused(post(url, raw(body, temperature="1" * 5000), stream), "body")


def test_an_overflowing_top_k_is_refused_and_the_request_beside_it_runs_on(url):
    valid = {"prompt": "the quick brown fox", "max_tokens": 60, "temperature": 0,
             "ignore_eos": True, "stream": True}

    async def streamed_text(client, started: asyncio.Event) -> str:
        text = ""
        async with client.stream("POST", COMPLETIONS, json=valid) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[len("data: "):])["choices"][0]["text"]
                    started.set()
        return text

    async def alone(client):
        return await streamed_text(client, asyncio.Event())

    async def beside(client):
        started = asyncio.Event()
        running = asyncio.create_task(streamed_text(client, started))
        await started.wait()
        refused = [await client.post(COMPLETIONS, json={**VALID, "top_k": 2**63, "stream": s})
                   for s in (False, True)]
        return refused, not running.done(), await running

    async def run(requests):
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await requests(client)

    reference = asyncio.run(run(alone))
    refused, in_flight, text = asyncio.run(run(beside))
    assert in_flight and text == reference
    for response in refused:
        assert_refused(response, "top_k")


class CrashingTokenizer(ByteTokenizer):
    """Encoding a prompt with "crash" in it raises: an unhandled error in the handler."""

    def encode(self, text: str) -> list[int]:
        if "crash" in text:
            raise RuntimeError("the tokenizer crashed")
        return super().encode(text)


def counted(url: str) -> collections.Counter:
    text = httpx.get(f"{url}/metrics").text
    pattern = r'^kvgraph_http_requests_total\{endpoint="([^"]*)",status="(\d+)"\} (\S+)$'
    return collections.Counter({(e, s): float(n) for e, s, n in
                                re.findall(pattern, text, re.MULTILINE)})


def test_metrics_count_every_response_unhandled_500s_included():
    engine = make_engine(lambda: Llama.from_preset("tiny", seed=1), tokenizer=CrashingTokenizer())
    with BackgroundServer(build_app(AsyncEngine(engine), "tiny")) as server:
        before = counted(server.url)
        seen = collections.Counter({("/metrics", "200"): 1})  # the scrape above
        with httpx.Client(base_url=server.url, timeout=30) as client:
            for body, stream in [({"prompt": "crash"}, False), ({"prompt": "crash"}, True),
                                 ({"prompt": "hi"}, False), ({"prompt": "hi"}, True),
                                 ({"prompt": ""}, False), ({"prompt": ""}, True),
                                 ({"prompt": "crash", "pad": "a" * MAX_BODY_BYTES}, True)]:
                content = json.dumps({**VALID, **body, "stream": stream}).encode()
                response = post(server.url, content, stream)
                seen[(COMPLETIONS, str(response.status_code))] += 1
            for path in ("/health", "/v1/models", "/nowhere", CHAT):
                seen[(path if path != "/nowhere" else "other",
                      str(client.get(path).status_code))] += 1
            crashed = client.post(COMPLETIONS, json={**VALID, "prompt": "crash"})
            seen[(COMPLETIONS, "500")] += 1
        assert crashed.status_code == 500 and crashed.json()["error"]["type"] == "server_error"
        assert seen[(COMPLETIONS, "500")] == 3 and seen[(COMPLETIONS, "413")] == 1
        assert counted(server.url) - before == seen


def test_a_checkpoint_without_tokenizer_json_names_the_file(checkpoint, tmp_path, capsys):
    broken = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(SystemExit) as info:  # found before anything is built: a usage error
        main(["--model", str(broken), "--graph-mode", "eager", "--port", "0"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"serve.py: error: --model {broken}: tokenizer.json is missing (the tokenizer: only "
        "Hugging Face fast tokenizers, tokenizer.json, are read)\n")
