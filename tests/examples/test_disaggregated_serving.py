"""Disaggregated prefill over HTTP (issue 46): `kv_transfer_params` through the server's
protocol, engine and answers, and examples/disagg_proxy.py fronting a prefill server (P) and a
decode server (D) as one OpenAI endpoint.

References are independent of the code under test: a colocated server with no connector gives
the greedy text; vLLM's rule gives the counts (P offers every block of the prompt, the partial
last one too: `ceil(P / BLOCK)`; D continues from P's first token, so it loads every prompt
token, `P`, and computes none); stand-in servers record what the proxy sends them.
"""

from __future__ import annotations

import json
import re
import socket
import time
import types

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from examples.disagg_proxy import KEEPALIVE_S, build_app, build_parser  # noqa: E402
from examples.engine.errors import RequestError  # noqa: E402
from examples.engine.protocol import parse_chat, parse_completion  # noqa: E402
from tests.examples.test_fail_fast import refused, run  # noqa: E402
from tests.support.openai_answers import MAX_TOKENS, MESSAGES, ask
from tests.support.disaggregated import (  # noqa: E402
    Upstream, launched, serving_apps, settled_metrics)
from tests.support.scripts import free_port  # noqa: E402
from tests.support.transfer_engines import require_mooncake, require_nixl  # noqa: E402
from tests.support.servers import serving, wait_for_free_blocks  # noqa: E402

BLOCK = 16
SERVE_FLAGS = ["--graph-mode", "eager", "--block-size", str(BLOCK), "--max-num-seqs", "4",
               "--max-model-len", "256"]


def offered_blocks(prompt_tokens: int) -> int:
    """How many blocks P offers for a prompt: all it fills, the partial last one too."""
    return -(-prompt_tokens // BLOCK)


def loaded_tokens(prompt_tokens: int) -> int:
    """How many prompt tokens D loads from P: all (it continues from P's first token)."""
    return prompt_tokens


def transfer_config(role: str, connector: str = "TorchDistributedConnector", **settings) -> str:
    return json.dumps({"kv_connector": connector, "kv_role": role,
                       "kv_connector_extra_config": settings})


# --- the protocol: kv_transfer_params checked before anything runs ---------------------------

def parse(body: dict, chat: bool = False):
    if chat:
        tokenizer = types.SimpleNamespace(encode_chat=lambda messages: [1, 2, 3])
        return parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, tokenizer)
    return parse_completion({"prompt": [5, 6, 7], **body}, tokenizer=None)


@pytest.mark.parametrize("value", ["do_remote_decode", [], 1, True, 0.5])
@pytest.mark.parametrize("chat", [False, True])
def test_kv_transfer_params_that_is_not_an_object_is_refused_naming_it(value, chat):
    with pytest.raises(RequestError) as error:
        parse({"kv_transfer_params": value}, chat)
    assert error.value.param == "kv_transfer_params" and error.value.status == 400
    assert str(error.value) == (f"kv_transfer_params must be an object or null, got "
                                f"{json.dumps(value)}")


@pytest.mark.parametrize("params, wrong", [
    ({"do_remote_decode": "yes"}, "do_remote_decode"),
    ({"do_remote_prefill": 1, "remote_host": "h", "remote_port": 1, "remote_block_ids": []},
     "do_remote_prefill"),
    ({"remote_port": "8100"}, "remote_port"), ({"remote_port": 70000}, "remote_port"),
    ({"remote_block_ids": [1, -2]}, "remote_block_ids"), ({"remote_block_ids": 3},
                                                           "remote_block_ids"),
    ({"remote_host": ""}, "remote_host"), ({"remote_request_id": 7}, "remote_request_id"),
])
def test_a_key_the_connector_reads_must_have_its_type(params, wrong):
    with pytest.raises(RequestError) as error:
        parse({"kv_transfer_params": params})
    assert error.value.param == "kv_transfer_params"
    assert str(error.value).startswith(f"kv_transfer_params.{wrong} must be ")


def test_a_decode_request_must_say_where_the_blocks_are():
    with pytest.raises(RequestError) as error:
        parse({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "h"}})
    assert "needs remote_port, remote_block_ids" in str(error.value)


def test_objects_pass_through_and_null_means_none():
    assert parse({}).kv_transfer_params is None
    assert parse({"kv_transfer_params": None}).kv_transfer_params is None
    # vLLM's proxies send a prefill the remote_* keys as null; other keys are another
    # connector's business.
    prefill = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None, "x": [1]}
    assert parse({"kv_transfer_params": prefill}, chat=True).kv_transfer_params == prefill


def test_kv_transfer_params_serves_one_choice():
    assert parse({"n": 3, "kv_transfer_params": None}).n == 3
    with pytest.raises(RequestError) as error:
        parse({"n": 2, "kv_transfer_params": {"do_remote_decode": True}})
    assert error.value.param == "kv_transfer_params" and "n must be 1, got 2" in str(error.value)


# --- a prefill server: the connector's answer in the response --------------------------------

@pytest.mark.parametrize("engine_loop", ["thread", "process"])
def test_a_prefill_server_answers_where_the_prompts_blocks_are(engine_loop):
    side_port = free_port()
    flags = ["--preset", "tiny", "--block-size", str(BLOCK), "--kv-transfer-config",
             transfer_config("kv_producer", port=side_port, timeout_s=0.5)]
    prompt = list(range(5, 5 + 3 * BLOCK + 5))  # three full blocks and a part
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    with serving("llama", "eager", *flags, engine_loop=engine_loop) as url:
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        params = answer["kv_transfer_params"]
        assert params["do_remote_prefill"] is True and params["remote_request_id"] == answer["id"]
        assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", side_port)
        blocks = params["remote_block_ids"]
        assert len(blocks) == len(set(blocks)) == offered_blocks(len(prompt))

        with httpx.stream("POST", f"{url}/v1/completions", json={
                **body, "max_tokens": 3, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}, timeout=60) as reply:
            lines = [json.loads(line[6:]) for line in reply.iter_lines()
                     if line.startswith("data: {")]
        tokens, usage = lines[:-1], lines[-1]
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, "length"]
        assert "kv_transfer_params" not in usage and all(
            "kv_transfer_params" not in c for c in tokens[:-1])
        assert tokens[-1]["kv_transfer_params"]["remote_request_id"] == tokens[-1]["id"]

        plain = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                           timeout=60).json()
        assert "kv_transfer_params" in plain and plain["kv_transfer_params"] is None
        many = httpx.post(f"{url}/v1/completions", json={**body, "n": 2}, timeout=60)
        assert many.status_code == 400
        assert many.json()["error"]["param"] == "kv_transfer_params"
        # Nobody came for the blocks: freed after timeout_s.
        health = wait_for_free_blocks(url)
        assert health["kv_blocks_free"] == health["kv_blocks_total"]


# --- the proxy, between stand-in servers ------------------------------------------------------

PREFILL_ANSWER = {"id": "p", "kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}}
DECODE_ANSWER = {"id": "d", "choices": [{"text": "the answer"}], "kv_transfer_params": None}


def stand_ins(**prefill):
    return (Upstream("P", **{"answer": PREFILL_ANSWER, **prefill}),
            Upstream("D", DECODE_ANSWER, events=['{"id": "d", "n": 1}', '{"n": 2}', "[DONE]"]))


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 9, "temperature": 0}),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 9, "stream": True,
                              "stream_options": {"include_usage": True}, "n": 1}),
])
def test_the_proxy_prefills_on_p_then_relays_ds_answer(path, body):
    p, d = stand_ins()
    with serving_apps(p.app(), d.app()) as (p_url, d_url), \
            serving_apps(build_app([p_url], [d_url])) as (proxy,):
        reply = httpx.post(f"{proxy}{path}", json=body, timeout=30)
        assert httpx.get(f"{proxy}/health").json() == {"server": "D", "path": "/health"}
        assert httpx.get(f"{proxy}/v1/models").json()["server"] == "D"
    expected = {k: v for k, v in body.items() if k != "stream_options"}
    expected.update(kv_transfer_params={"do_remote_decode": True}, stream=False, max_tokens=1)
    if "messages" in body:
        expected["max_completion_tokens"] = 1
    assert p.received == [(path, expected)]
    assert d.received == [(path, {**body, "kv_transfer_params": PREFILL_ANSWER[
        "kv_transfer_params"]})]
    assert reply.status_code == 200
    if body.get("stream"):
        assert reply.headers["content-type"].startswith("text/event-stream")
        assert reply.content == b"".join(d.stream_bytes())
    else:
        assert reply.json() == DECODE_ANSWER


def test_ps_refusal_is_the_clients_answer_and_d_is_not_asked():
    refusal = {"error": {"message": "prompt is required", "type": "x", "param": "prompt"}}
    p, d = stand_ins(answer=refusal, status=400)
    with serving_apps(p.app(), d.app()) as (p_url, d_url), \
            serving_apps(build_app([p_url], [d_url])) as (proxy,):
        reply = httpx.post(f"{proxy}/v1/completions", json={"max_tokens": 2}, timeout=30)
        many = httpx.post(f"{proxy}/v1/completions", json={"prompt": "a", "n": 2}, timeout=30)
        gone = build_app([f"http://127.0.0.1:{free_port()}"], [d_url])
        with serving_apps(gone) as (broken,):
            unreachable = httpx.post(f"{broken}/v1/completions", json={"prompt": "a"},
                                     timeout=30)
    assert (reply.status_code, reply.json()) == (400, refusal)
    assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    assert unreachable.status_code == 502
    assert "the prefill server http://127.0.0.1:" in unreachable.json()["error"]["message"]
    assert len(p.received) == 1 and d.received == []


def test_the_proxy_takes_its_servers_in_turn():
    p1, d1 = stand_ins()
    p2, d2 = stand_ins()
    with serving_apps(p1.app(), p2.app(), d1.app(), d2.app()) as urls, \
            serving_apps(build_app(urls[:2], urls[2:])) as (proxy,):
        for i in range(4):
            httpx.post(f"{proxy}/v1/completions", json={"prompt": f"{i}"}, timeout=30)
    assert [b["prompt"] for _, b in p1.received] == [b["prompt"] for _, b in d1.received] == [
        "0", "2"]
    assert [b["prompt"] for _, b in p2.received] == [b["prompt"] for _, b in d2.received] == [
        "1", "3"]


def test_an_idle_connection_is_dropped_before_the_servers_keep_alive_can_close_it():
    # uvicorn closes a connection idle for its keep-alive; a request the proxy sent on it as it
    # closed failed (ReadError), about once in a few hundred under load when both were 5 s.
    import uvicorn

    assert KEEPALIVE_S < uvicorn.Config(None).timeout_keep_alive
    p, d = stand_ins()
    with serving_apps(p.app(), d.app()) as (p_url, d_url), \
            serving_apps(build_app([p_url], [d_url])) as (proxy,):
        for pause in (0, 0, KEEPALIVE_S + 0.5):
            time.sleep(pause)
            assert httpx.post(f"{proxy}/v1/completions", json={"prompt": "a"},
                              timeout=30).status_code == 200
    assert p.client_ports[0] == p.client_ports[1] != p.client_ports[2]
    assert d.client_ports[0] == d.client_ports[1] != d.client_ports[2]


# --- the proxy's command line ----------------------------------------------------------------

def test_every_proxy_flag_says_what_it_is_for():
    parser = build_parser()
    assert all(action.help.strip() for action in parser._actions)
    assert "--prefill URL" in parser.format_help()


@pytest.mark.parametrize("flags, line", [
    (["--decode", "http://h:1"], "the following arguments are required: --prefill"),
    (["--prefill", "h:8100", "--decode", "http://h:1"], "argument --prefill: expected a "
     "server's root URL such as http://127.0.0.1:8100 (no path), got 'h:8100'"),
    (["--prefill", "http://h:1", "--decode", "http://h:1/v1"], "argument --decode: expected "
     "a server's root URL such as http://127.0.0.1:8100 (no path), got 'http://h:1/v1'"),
    (["--prefill", "http://h:1", "--decode", "http://h:2", "--timeout", "nan"],
     "argument --timeout: must lie in [0.001, 86400], got nan"),
])
def test_a_mistake_in_the_proxys_flags_is_one_line(flags, line):
    assert refused("disagg_proxy.py", *flags) == line


def test_a_port_in_use_is_one_line_and_the_proxy_never_imports_torch():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run(["-X", "importtime", "examples/disagg_proxy.py", "--prefill", "http://h:1",
                      "--decode", "http://h:2", "--port", str(port)])
    assert result.returncode == 2
    assert f"disagg_proxy.py: error: --host 127.0.0.1 --port {port}: cannot listen there" in (
        result.stderr)
    assert re.search(r"\|\s+fastapi\s*$", result.stderr, re.MULTILINE)  # it got that far
    assert not re.search(r"\|\s+torch\s*$", result.stderr, re.MULTILINE)


# --- P, D and the proxy as a user runs them ---------------------------------------------------

# Each transport once, and the MLA model (random weights, seeded alike on every server) once.
PAIRS = [("llama", "TorchDistributedConnector"), ("mla", "MooncakeConnector"),
         ("llama", "NixlConnector")]


@pytest.mark.slow
@pytest.mark.parametrize("kind, connector", PAIRS)
def test_the_proxy_over_p_and_d_answers_as_one_colocated_server(kind, connector, checkpoint,
                                                                tmp_path):
    {"MooncakeConnector": require_mooncake, "NixlConnector": require_nixl}.get(
        connector, lambda: None)()
    model = ["examples/serve.py", *SERVE_FLAGS, *(
        ["--model", str(checkpoint)] if kind == "llama"
        else ["--model", kind, "--max-model-len", "512"])]  # a byte tokenizer: longer prompts
    chat = kind == "llama"  # the random-weight MLA model has no chat template
    with launched(model, tmp_path / "colocated.log") as url:
        reference, reference_chat, reference_usage = ask(url, chat)

    producer = transfer_config("kv_producer", connector, port=free_port())
    consumer = transfer_config("kv_consumer", connector)
    with launched([*model, "--kv-transfer-config", producer], tmp_path / "p.log") as p, \
            launched([*model, "--kv-transfer-config", consumer], tmp_path / "d.log") as d, \
            launched(["examples/disagg_proxy.py", "--prefill", p, "--decode", d],
                     tmp_path / "proxy.log") as proxy:
        completion, streamed, usage = ask(proxy, chat)
        prompts = [completion.usage.prompt_tokens, usage.prompt_tokens]
        pulled = [loaded_tokens(n) for n in prompts]
        metrics = settled_metrics(d, "kvgraph_kv_connector_loaded_tokens_total", sum(pulled))
        # P frees the blocks it held once D has them (its timeout_s, 120 s, is far off).
        p_health = wait_for_free_blocks(p)

    assert min(prompts) > 3 * BLOCK  # several blocks each
    assert completion.choices[0].text == reference.choices[0].text
    assert streamed == reference_chat
    assert completion.usage.completion_tokens == usage.completion_tokens == MAX_TOKENS
    assert prompts == [reference.usage.prompt_tokens, reference_usage.prompt_tokens]
    assert [completion.usage.prompt_tokens_details.cached_tokens,
            usage.prompt_tokens_details.cached_tokens] == pulled
    assert metrics["kvgraph_kv_connector_failed_blocks_total"] == 0
    assert metrics["kvgraph_prompt_tokens_computed_total"] == 0
    assert p_health["kv_blocks_free"] == p_health["kv_blocks_total"]
