"""The OpenAI API's fields: what the server implements answers as OpenAI does, what it does not
is refused naming the field (never silently ignored), and an unknown model is a 404. Checked
with plain HTTP and, in the slow suite, with the official `openai` client."""

from __future__ import annotations

import json
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.support.servers import serving  # noqa: E402

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def url(checkpoint):
    with serving(str(checkpoint), "piecewise") as url:
        yield url


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


UNSUPPORTED = {
    "logit_bias": {"5": 10},
    "best_of": 2, "suffix": "!", "tools": [{"type": "function"}], "tool_choice": "auto",
    "response_format": {"type": "json_object"},
}


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("field", list(UNSUPPORTED))
def test_a_field_the_server_does_not_implement_is_refused_naming_it(url, path, field):
    base = ({"prompt": "hello"} if path == COMPLETIONS
            else {"messages": [{"role": "user", "content": "hello"}]})
    for stream in (False, True):
        response = post(url, path, {**base, field: UNSUPPORTED[field], "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == field and f"{field} is not supported" in error["message"]


def test_the_values_that_ask_for_nothing_are_served(url):
    body = {"prompt": "hello", "max_tokens": 2, "echo": False, "best_of": 1,
            "logit_bias": {}, "response_format": {"type": "text"}, "suffix": None}
    assert post(url, COMPLETIONS, body).status_code == 200


def test_max_completion_tokens_bounds_the_output_and_wins_over_max_tokens(url):
    body = {"messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 5,
            "max_tokens": 16, "ignore_eos": True, "temperature": 0}
    data = post(url, CHAT, body).json()
    assert data["usage"]["completion_tokens"] == 5
    assert data["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_a_stream_with_include_usage_ends_with_the_counts(url, path):
    base = ({"prompt": "hello there"} if path == COMPLETIONS
            else {"messages": [{"role": "user", "content": "hello there"}]})
    body = {**base, "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(len(c["choices"]) == 1 and "usage" not in c for c in chunks[:-1])
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 4
    refused = post(url, path, {**base, "stream_options": {"include_usage": True}})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream_options"


def test_an_unknown_model_is_a_404_and_the_served_one_is_answered(url):
    for stream in (False, True):
        response = post(url, COMPLETIONS, {"prompt": "hi", "model": "gpt-4o", "stream": stream})
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and "'gpt-4o' does not exist" in error["message"]
    name = served_model(url)
    assert post(url, COMPLETIONS, {"prompt": "hi", "model": name, "max_tokens": 1}).status_code == 200


def test_completions_logprobs_come_per_token_streamed_or_not(url):
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0,
            "logprobs": 2}
    logprobs = post(url, COMPLETIONS, body).json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 4
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    # Greedy: each token is the most likely (top_logprobs is keyed by text, so two tokens that
    # decode alike share one entry: the chosen one's logprob is at least the entries').
    assert all(lp >= max(top.values()) for lp, top in zip(logprobs["token_logprobs"],
                                                           logprobs["top_logprobs"]))
    assert logprobs["text_offset"][0] == 0
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json={**body, "stream": True},
                      timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    streamed = [json.loads(e)["choices"][0]["logprobs"] for e in events[:-1]]
    assert [s["token_logprobs"][0] for s in streamed] == pytest.approx(logprobs["token_logprobs"])


def test_chat_logprobs_come_as_records_and_their_options_are_checked(url):
    base = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
            "ignore_eos": True, "temperature": 0}
    content = post(url, CHAT, {**base, "logprobs": True, "top_logprobs": 3}).json()[
        "choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert all(len(c["top_logprobs"]) == 3 and c["bytes"] == list(c["token"].encode())
               for c in content)
    assert post(url, CHAT, base).json()["choices"][0]["logprobs"] is None
    for bad, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"),
                       ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        response = post(url, CHAT, {**base, **bad})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, bad


@pytest.mark.slow
def test_the_official_openai_client(url):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    name = served_model(url)
    completion = client.completions.create(model=name, prompt="hello", max_tokens=3,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == 3 and completion.choices[0].text is not None
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=4,
        temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4
    streamed = list(client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=4,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content and streamed[-1].usage.completion_tokens == 4
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="hello", max_tokens=1)
    echoed = client.completions.create(model=name, prompt="hello", max_tokens=1, echo=True,
                                       logprobs=1, temperature=0)
    assert echoed.choices[0].text.startswith("hello")
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    scored = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "hello"}], max_completion_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = scored.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == c.top_logprobs[0].logprob for c in content)  # greedy: the best


def test_echo_puts_the_prompt_first_and_scores_it_with_logprobs(url):
    body = {"prompt": "hello world", "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1}
    choice = post(url, COMPLETIONS, body).json()["choices"][0]
    assert choice["text"].startswith("hello world")
    logprobs = choice["logprobs"]
    prompt_tokens = len(logprobs["tokens"]) - 1  # the prompt's tokens, then the generated one
    assert prompt_tokens >= 2 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs["token_logprobs"][1:])
    plain = post(url, COMPLETIONS, {**body, "echo": False}).json()["choices"][0]
    assert choice["text"] == "hello world" + plain["text"]
    assert logprobs["token_logprobs"][-1] == pytest.approx(plain["logprobs"]["token_logprobs"][0])
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json={**body, "stream": True},
                      timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    first = json.loads(events[0])["choices"][0]
    assert first["text"] == choice["text"]
    assert first["logprobs"]["token_logprobs"] == pytest.approx(logprobs["token_logprobs"])
    echo_only = post(url, COMPLETIONS, {**body, "logprobs": None}).json()["choices"][0]
    assert echo_only["text"] == choice["text"] and echo_only["logprobs"] is None
    chat = post(url, CHAT, {"messages": [{"role": "user", "content": "hi"}], "echo": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "echo"


def stream_choices(url: str, path: str, body: dict) -> tuple[dict[int, str], list[dict]]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True},
                      timeout=60) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts, chunks


def test_n_choices_each_run_as_a_request_streamed_or_not(url):
    body = {"prompt": "hello there", "max_tokens": 5, "ignore_eos": True, "temperature": 1.0,
            "seed": 11, "n": 3}
    data = post(url, COMPLETIONS, body).json()
    choices = data["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    assert data["usage"]["completion_tokens"] == 15
    # Choice i of a seeded request draws from seed + i: it equals a lone request with that seed.
    for i, choice in enumerate(choices):
        alone = post(url, COMPLETIONS, {**body, "n": 1, "seed": 11 + i}).json()
        assert choice["text"] == alone["choices"][0]["text"]
    texts, chunks = stream_choices(url, COMPLETIONS, {**body, "stream_options":
                                                      {"include_usage": True}})
    assert texts == {i: c["text"] for i, c in enumerate(choices)}
    assert chunks[-1]["usage"]["completion_tokens"] == 15


def test_a_client_leaving_a_request_of_n_choices_frees_every_choices_blocks(url):
    total = httpx.get(f"{url}/health").json()["kv_blocks_total"]
    body = {"prompt": "hello there", "max_tokens": 40, "ignore_eos": True, "n": 4,
            "stream": True}
    with httpx.stream("POST", f"{url}{COMPLETIONS}", json=body, timeout=60) as response:
        next(response.iter_lines())
    for _ in range(200):
        health = httpx.get(f"{url}/health").json()
        if health["kv_blocks_free"] == total and health["running"] == 0:
            break
        time.sleep(0.05)
    assert health["kv_blocks_free"] == total and health["running"] == 0


def test_a_repeated_prompt_is_served_from_the_prefix_cache_and_metrics_count_it(url):
    from tests.support.servers import metric

    body = {"prompt": "the quick brown fox jumps over the lazy dog " * 3, "max_tokens": 4,
            "ignore_eos": True, "temperature": 0}
    first = post(url, COMPLETIONS, body).json()["choices"][0]["text"]
    hits = metric(url, "kvgraph_prefix_cache_hits_total")
    queries = metric(url, "kvgraph_prefix_cache_queries_total")
    assert post(url, COMPLETIONS, body).json()["choices"][0]["text"] == first
    assert metric(url, "kvgraph_prefix_cache_hits_total") > hits
    assert metric(url, "kvgraph_prefix_cache_queries_total") > queries
