"""The HTTP server, started on 127.0.0.1 in this process: completions, streaming, bad input,
disconnects and metrics, through a real HTTP client.

The reference for every graph mode is the eager server's answers to the same 16 concurrent
requests (mixed prompt lengths, output lengths, streaming or not), all greedy.
"""

from __future__ import annotations

import asyncio
import json

import pytest

# The server's packages come with the test extra; a machine without them (the GPU check's)
# skips this file instead of failing the whole collection.
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from fastapi.testclient import TestClient  # noqa: E402

from examples.engine import AsyncEngine, build_engine  # noqa: E402
from examples.serve import MODELS, build_app, parse_args  # noqa: E402
from tests.support.servers import (MAX_MODEL_LEN, complete, complete_all, metric,  # noqa: E402
                                   request_body, serving, wait_for_free_blocks,
                                   wait_for_metric)


@pytest.fixture(scope="module")
def eager_url(checkpoint):
    with serving(str(checkpoint), "eager") as url:
        yield url


@pytest.fixture(scope="module")
def reference(eager_url):
    bodies = [request_body(i) for i in range(16)]
    return asyncio.run(complete_all(eager_url, bodies))


def test_reference_completions_are_whole(reference):
    for i, answer in enumerate(reference):
        body = request_body(i)
        assert 1 <= answer["tokens"] <= body["max_tokens"]
        if body["ignore_eos"]:
            assert (answer["tokens"], answer["finish_reason"]) == (body["max_tokens"], "length")


@pytest.mark.parametrize("mode, engine_loop", [
    ("piecewise", "thread"), ("piecewise", "process"), ("full_and_piecewise", "thread"),
    ("full_decode_only", "thread"), ("full", "process")])
def test_graph_modes_answer_like_eager(checkpoint, reference, mode, engine_loop):
    """Graph modes, the engine in the server's process or a process of its own."""
    with serving(str(checkpoint), mode, engine_loop=engine_loop) as url:
        answers = asyncio.run(complete_all(url, [request_body(i) for i in range(16)]))
        assert answers == reference
        assert metric(url, "kvgraph_graph_hits_total") > 0
        assert metric(url, "kvgraph_time_to_first_token_seconds_count") == 16
        generated = sum(a["tokens"] for a in answers)
        assert metric(url, "kvgraph_generation_tokens_total") == generated
        assert metric(url, "kvgraph_inter_token_latency_seconds_count") == generated - 16


BAD_REQUESTS = [
    (b'{"prompt": "hi", ', "body"),
    (b"[1, 2]", "body"),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [10**6]}, "prompt"),
    ({"prompt": "word " * 200}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "7"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "top_k": 2.5}, "top_k"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "n": 17}, "n"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "seed": "x"}, "seed"),
]


def test_bad_input_is_a_400_naming_the_field(eager_url, reference):
    before = metric(eager_url, "kvgraph_http_requests_total",
                    '{endpoint="/v1/completions",status="400"}')
    with httpx.Client(base_url=eager_url, timeout=30) as client:
        for body, field in BAD_REQUESTS:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = client.post("/v1/completions", content=content)
            assert response.status_code == 400, (body, response.text)
            error = response.json()["error"]
            assert error["param"] == field and field in error["message"], (body, error)
        for body, field in [({"messages": "hi"}, "messages"), ({"messages": []}, "messages"),
                            ({"messages": [{"role": "user"}]}, "messages")]:
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 400 and response.json()["error"]["param"] == field
    after = metric(eager_url, "kvgraph_http_requests_total",
                   '{endpoint="/v1/completions",status="400"}')
    assert after - before == len(BAD_REQUESTS)
    # The server is still up, and answers as before.
    again = asyncio.run(complete_all(eager_url, [request_body(i) for i in range(4)]))
    assert again == reference[:4]


def test_a_client_that_stops_waiting_for_a_whole_answer_frees_its_blocks(eager_url):
    aborted = metric(eager_url, "kvgraph_requests_aborted_total")
    body = {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{eager_url}/v1/completions", json=body, timeout=0.1)
    # On a loaded machine the server may take the request only after the client left; it is
    # aborted at its first token all the same, and only then are there blocks to wait for.
    wait_for_metric(eager_url, "kvgraph_requests_aborted_total", aborted + 1)
    health = wait_for_free_blocks(eager_url)
    assert health["kv_blocks_free"] == health["kv_blocks_total"]
    assert metric(eager_url, "kvgraph_requests_aborted_total") == aborted + 1


def test_a_client_that_disconnects_frees_its_blocks(eager_url):
    aborted = metric(eager_url, "kvgraph_requests_aborted_total")
    body = {"prompt": "hello", "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=eager_url, timeout=30) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    health = wait_for_free_blocks(eager_url)
    assert health["kv_blocks_free"] == health["kv_blocks_total"]
    assert metric(eager_url, "kvgraph_requests_aborted_total") == aborted + 1


def test_chat_completions_render_the_template(eager_url, checkpoint):
    from tokenizers import Tokenizer

    messages = [{"role": "user", "content": "hello world"}]
    prompt = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).encode(
        "<s><|user|>hello world\n<|assistant|>", add_special_tokens=False).ids
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def both():
        async with httpx.AsyncClient(base_url=eager_url, timeout=30) as client:
            return await asyncio.gather(
                complete(client, {"messages": messages, **common}, "/v1/chat/completions"),
                complete(client, {"messages": messages, "stream": True, **common},
                         "/v1/chat/completions"),
                complete(client, {"prompt": prompt, **common}))

    chat, streamed, completion = asyncio.run(both())
    assert chat == streamed == completion


def test_chat_without_a_template_is_404():
    args = parse_args(["--preset", "tiny", "--graph-mode", "eager", "--max-model-len", "64",
                       "--max-num-seqs", "2"])
    engine, _ = build_engine(args, MODELS)
    with TestClient(build_app(AsyncEngine(engine), "tiny")) as client:
        response = client.post("/v1/chat/completions", json={"messages": []})
        assert response.status_code == 404
        message = response.json()["error"]["message"]
        assert "chat template" in message and "chat_template.jinja" in message  # where it looked
        assert client.get("/health").json()["status"] == "ok"


def test_a_server_whose_model_cannot_compile_does_not_start(tmp_path, caplog):
    """A compile cache kvgraph may not trust is found when compiling, before any graph is
    captured: the server says why and exits, rather than answering every request with 500."""
    from examples.serve import main

    (tmp_path / "inductor").mkdir()
    (tmp_path / "inductor").chmod(0o777)  # the root dir itself is private, so flags pass
    tmp_path.chmod(0o700)
    with pytest.raises(SystemExit) as info:
        main(["--preset", "tiny", "--graph-mode", "piecewise", "--piece-compiler", "inductor",
              "--compile-cache-dir", str(tmp_path), "--max-model-len", "64",
              "--max-num-seqs", "2", "--port", "0"])
    assert info.value.code == 1
    (error,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert error.startswith("not serving: compiling the model failed") and "chmod go-w" in error
