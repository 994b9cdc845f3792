"""OpenAI's `usage.prompt_tokens_details.cached_tokens` and the KV connector's /metrics, checked
on the server's pieces with made-up engine outputs and stats: the whole answer and the stream's
usage chunk carry the first choice's `num_cached_tokens` (0 when nothing was cached), and
/metrics shows the connector's counts from the engine's and the runner's stats.

The HTTP pieces need the serve extra: this module is skipped without it, as the server tests are.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from examples.engine.http_answers import collect, events, merged  # noqa: E402
from examples.engine.metrics import ServerMetrics  # noqa: E402
from examples.engine.request import FinishReason, RequestOutput  # noqa: E402
from examples.engine.responses import ResponseFormat  # noqa: E402

PROMPT_TOKENS = 70


class FakeEngine:
    """What ServerMetrics reads of an engine: its stats snapshot."""

    def __init__(self, **extra):
        self.stats = {
            "running": 0, "waiting": 0, "kv_blocks_total": 64, "kv_blocks_free": 64,
            "preemptions": 0, "prefix_cache_queried_tokens": 0, "prefix_cache_hit_tokens": 0,
            "prompt_tokens_computed": 0,
            "prefix_cache_evictions": 0, "prefix_cache_blocks": 0, "aborted": 0, "failed": 0,
            "step_retries": 0, "steps": 0,
            "runner": {"hits": {}, "fallbacks": 0, "uncaptured": 0, "padded_tokens": 0,
                       "graphs": {"graph_bytes": 0}, "verify": None,
                       "kv_connector": extra.pop("worker", None)},
            **extra}


class Connected:
    """What `collect` asks of the HTTP request: whether the client is still there."""

    async def is_disconnected(self) -> bool:
        return False


def outputs(request_id: str, cached: int, num_tokens: int = 3) -> list[RequestOutput]:
    """A request's outputs, one token each, all saying `cached` prompt tokens were cached."""
    return [RequestOutput(request_id, (65 + i,), chr(65 + i), PROMPT_TOKENS, i + 1,
                          FinishReason.LENGTH if i == num_tokens - 1 else None,
                          num_cached_tokens=cached) for i in range(num_tokens)]


async def stream(items: list[RequestOutput]):
    for item in items:
        yield item


def formatted(chat: bool = False) -> ResponseFormat:
    return ResponseFormat("cmpl-test", "tiny", chat)


def whole_answer(cached_per_choice: list[int], chat: bool = False) -> dict:
    metrics = ServerMetrics(FakeEngine())
    tagged = merged([stream(outputs(f"r-{i}", c)) for i, c in enumerate(cached_per_choice)])
    response = asyncio.run(collect(tagged, len(cached_per_choice), formatted(chat),
                                   PROMPT_TOKENS, metrics, Connected(), lambda error: None))
    assert response.status_code == 200
    return json.loads(response.body)


def streamed_chunks(cached_per_choice: list[int], include_usage: bool = True) -> list[dict]:
    metrics = ServerMetrics(FakeEngine())
    tagged = merged([stream(outputs(f"r-{i}", c)) for i, c in enumerate(cached_per_choice)])

    async def read() -> list[str]:
        return [event async for event in events(
            tagged, formatted(), metrics, PROMPT_TOKENS if include_usage else None)]

    lines = asyncio.run(read())
    assert lines[-1] == "data: [DONE]\n\n"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("chat", [False, True])
def test_a_whole_answer_says_how_many_prompt_tokens_were_cached(chat):
    usage = whole_answer([48], chat)["usage"]
    assert usage == {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 3,
                     "total_tokens": PROMPT_TOKENS + 3,
                     "prompt_tokens_details": {"cached_tokens": 48}}


def test_nothing_cached_is_a_zero_not_a_missing_field():
    assert whole_answer([0])["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert ResponseFormat("x", "m", False).response([], 5)["usage"][
        "prompt_tokens_details"] == {"cached_tokens": 0}


def test_n_choices_of_one_prompt_count_its_cached_tokens_once_from_the_first_choice():
    # The later choices start once the first has its first token: they may find more cached.
    usage = whole_answer([32, 64, 64])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 32
    assert usage["prompt_tokens"] == PROMPT_TOKENS and usage["completion_tokens"] == 9


def test_the_streams_usage_chunk_says_how_many_prompt_tokens_were_cached():
    chunks = streamed_chunks([16, 48])
    assert all("usage" not in c for c in chunks[:-1]) and len(chunks) == 7
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["prompt_tokens_details"] == {"cached_tokens": 16}
    assert usage["completion_tokens"] == 6 and usage["total_tokens"] == PROMPT_TOKENS + 6


def test_a_stream_without_include_usage_has_no_usage_chunk():
    chunks = streamed_chunks([16], include_usage=False)
    assert len(chunks) == 3 and all("usage" not in c for c in chunks)


# --- /metrics --------------------------------------------------------------------------------

def metric_values(engine: FakeEngine) -> dict[str, float]:
    text = ServerMetrics(engine).render().decode()
    return {name: float(value) for name, value in
            re.findall(r"^(kvgraph_kv_connector_\w+) (\S+)$", text, re.MULTILINE)}


def test_metrics_show_the_kv_connectors_counts():
    engine = FakeEngine(kv_connector_loaded_tokens=96, kv_connector_failed_blocks=2,
                        kv_connector_waiting_for_load=1,
                        worker={"connector": "SharedStorageConnector", "steps": 5,
                                "layer_hook_calls": 0, "loaded_tokens": 128,
                                "saved_tokens": 160, "load_failures": 2, "store_bytes": 4096,
                                "evicted_blocks": 0, "save_failures": 3})
    assert metric_values(engine) == {
        "kvgraph_kv_connector_loaded_tokens_total": 96.0,
        "kvgraph_kv_connector_failed_blocks_total": 2.0,
        "kvgraph_kv_connector_requests_waiting": 1.0,
        "kvgraph_kv_connector_saved_tokens_total": 160.0,
        "kvgraph_kv_connector_save_failures_total": 3.0,
        "kvgraph_kv_connector_store_bytes": 4096.0,
        # A prefill server's: none here (the shared-storage connector sends nothing).
        "kvgraph_kv_connector_sent_blocks_total": 0.0,
        "kvgraph_kv_connector_expired_requests_total": 0.0,
        "kvgraph_kv_connector_failed_pulls_total": 0.0,
    }


def test_metrics_show_a_prefill_servers_counts():
    engine = FakeEngine(worker={"connector": "TorchDistributedConnector", "steps": 5,
                                "layer_hook_calls": 0, "sent_blocks": 40,
                                "expired_requests": 1, "failed_pulls": 2})
    values = metric_values(engine)
    assert values["kvgraph_kv_connector_sent_blocks_total"] == 40.0
    assert values["kvgraph_kv_connector_expired_requests_total"] == 1.0
    assert values["kvgraph_kv_connector_failed_pulls_total"] == 2.0


def test_metrics_without_a_kv_connector_show_zeros():
    no_connector = {"connector": None, "layerwise": False, "steps": 0, "layer_hook_calls": 0}
    for engine in (FakeEngine(worker=no_connector), FakeEngine()):
        values = metric_values(engine)
        assert len(values) == 9 and set(values.values()) == {0.0}
