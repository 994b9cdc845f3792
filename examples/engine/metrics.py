"""ServerMetrics: the server's Prometheus metrics, from HTTP handlers and the engine's stats.

Imports prometheus-client: only the server imports this module. Each server has its own
registry, so several can live in one process (tests start one per graph mode).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Collection, Iterator, MutableMapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .async_engine import AsyncEngine
from .request import RequestOutput

# Latency buckets (seconds) from a fast GPU decode step to a slow CPU prefill.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
# How runner.stats() names steps that ran without graphs.
NO_GRAPH_MODE = "none"
# The endpoint label of paths the server does not serve: one label, however many paths.
OTHER_ENDPOINT = "other"
# ASGI's callables, typed loosely: the middleware only reads two keys of what passes through.
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Message, Callable[[], Awaitable[Message]],
                    Callable[[Message], Awaitable[None]]], Awaitable[None]]


class ServerMetrics:
    """Request, token and latency metrics, and the engine's own counts read at scrape time."""

    def __init__(self, engine: AsyncEngine):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvgraph_http_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.finished = Counter("kvgraph_requests_finished", "Generations by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.prompt_tokens = Counter("kvgraph_prompt_tokens", "Prompt tokens of finished "
                                     "generations", registry=self.registry)
        self.generation_tokens = Counter("kvgraph_generation_tokens", "Tokens generated",
                                         registry=self.registry)
        self.ttft = Histogram("kvgraph_time_to_first_token_seconds", "Arrival to first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("kvgraph_inter_token_latency_seconds", "Between successive tokens",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(EngineCollector(engine))

    def observe(self, output: RequestOutput) -> None:
        """Count one engine output (one token) of a request."""
        self.generation_tokens.inc(len(output.token_ids))
        if output.ttft is not None:
            self.ttft.observe(output.ttft)
        if output.itl is not None:
            self.itl.observe(output.itl)
        if output.finished:
            self.finished.labels(output.finish_reason.value).inc()
            self.prompt_tokens.inc(output.num_prompt_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """The engine's latest stats snapshot as metrics: queue, cache, steps per graph."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    def collect(self) -> Iterator[Any]:
        stats = self.engine.stats
        runner = stats["runner"]
        yield _gauge("kvgraph_requests_running", "Requests in the running batch", stats["running"])
        yield _gauge("kvgraph_requests_waiting", "Requests queued", stats["waiting"])
        used = stats["kv_blocks_total"] - stats["kv_blocks_free"]
        yield _gauge("kvgraph_kv_cache_blocks_used", "KV cache blocks held by requests", used)
        yield _gauge("kvgraph_kv_cache_blocks_total", "KV cache blocks", stats["kv_blocks_total"])
        yield _counter("kvgraph_preemptions", "Requests preempted for blocks", stats["preemptions"])
        yield _counter("kvgraph_prefix_cache_queries", "Tokens of admitted requests looked up "
                       "in the prefix cache", stats["prefix_cache_queried_tokens"])
        yield _counter("kvgraph_prefix_cache_hits", "Of those, tokens found cached (prefill "
                       "skipped)", stats["prefix_cache_hit_tokens"])
        yield _counter("kvgraph_prompt_tokens_computed", "Prompt tokens run through the model "
                       "(not from a cache or a KV connector)", stats["prompt_tokens_computed"])
        yield _counter("kvgraph_prefix_cache_evictions", "Cached blocks taken back for new "
                       "tokens", stats["prefix_cache_evictions"])
        yield _gauge("kvgraph_kv_cache_blocks_cached", "KV cache blocks in the prefix cache, "
                     "held or free", stats["prefix_cache_blocks"])
        yield _counter("kvgraph_requests_aborted", "Requests aborted (client gone)",
                       stats["aborted"])
        yield _counter("kvgraph_requests_failed", "Requests the engine failed (their own "
                       "fault, or a broken step)", stats["failed"])
        yield _counter("kvgraph_engine_step_retries", "Failed batches run again one request "
                       "at a time", stats["step_retries"])
        yield _counter("kvgraph_engine_steps", "Model steps run", stats["steps"])
        steps = CounterMetricFamily("kvgraph_steps_by_graph", "Steps by runtime mode and "
                                    "batch descriptor", labels=["mode", "descriptor"])
        graph_hits = 0
        for key, count in runner["hits"].items():
            mode, _, descriptor = key.partition(":")
            steps.add_metric([mode, descriptor], count)
            graph_hits += count if mode != NO_GRAPH_MODE else 0
        yield steps
        yield _counter("kvgraph_graph_hits", "Steps that replayed a graph", graph_hits)
        yield _counter("kvgraph_graph_fallbacks", "Steps above the largest capture size",
                       runner["fallbacks"])
        yield _counter("kvgraph_graph_uncaptured", "Steps whose graph was not captured",
                       runner["uncaptured"])
        yield _counter("kvgraph_graph_padded_tokens", "Padding tokens added to reach a "
                       "capture size", runner["padded_tokens"])
        yield _gauge("kvgraph_graph_bytes", "Memory the captured graphs hold",
                     runner["graphs"]["graph_bytes"])
        yield from _verify_metrics(runner.get("verify") or {})
        yield from _kv_connector_metrics(stats, runner.get("kv_connector") or {})
        yield from _spec_decode_metrics(stats)


def _kv_connector_metrics(stats: dict[str, Any], worker: dict[str, Any]) -> Iterator[Any]:
    """The KV connector's counts (all zero without `--kv-transfer-config`): the scheduler's,
    which any connector has, and the shared-storage connector's own saves and store."""
    yield _counter("kvgraph_kv_connector_loaded_tokens", "Prompt tokens a KV connector "
                   "supplied instead of prefill (failed loads taken off)",
                   stats.get("kv_connector_loaded_tokens", 0))
    yield _counter("kvgraph_kv_connector_failed_blocks", "KV blocks a connector failed to load "
                   "(their tokens computed instead)", stats.get("kv_connector_failed_blocks", 0))
    yield _gauge("kvgraph_kv_connector_requests_waiting", "Requests waiting for their KV blocks "
                 "to load", stats.get("kv_connector_waiting_for_load", 0))
    yield _counter("kvgraph_kv_connector_saved_tokens", "Prompt tokens a KV connector saved "
                   "for later loads", worker.get("saved_tokens", 0))
    yield _counter("kvgraph_kv_connector_save_failures", "KV blocks a connector failed to save",
                   worker.get("save_failures", 0))
    yield _gauge("kvgraph_kv_connector_store_bytes", "Bytes of KV blocks in a connector's store",
                 worker.get("store_bytes", 0))
    # Disaggregated prefill: a prefill server's blocks sent and its requests no one pulled; a
    # decode server's pulls that failed (their prompts computed instead).
    yield _counter("kvgraph_kv_connector_sent_blocks", "KV blocks a prefill server sent to "
                   "decode servers", worker.get("sent_blocks", 0))
    yield _counter("kvgraph_kv_connector_expired_requests", "Prefilled requests whose blocks "
                   "no decode server pulled before the timeout", worker.get("expired_requests", 0))
    yield _counter("kvgraph_kv_connector_failed_pulls", "Pulls of a request's blocks that "
                   "failed", worker.get("failed_pulls", 0))


def _spec_decode_metrics(stats: dict[str, Any]) -> Iterator[Any]:
    """Speculative decoding's counts (all zero without `--speculative-config`)."""
    yield _counter("kvgraph_spec_decode_drafts", "Verify chunks: requests that ran a step with "
                   "draft tokens", stats.get("spec_decode_drafts", 0))
    yield _counter("kvgraph_spec_decode_draft_tokens", "Draft tokens proposed and verified",
                   stats.get("spec_decode_draft_tokens", 0))
    yield _counter("kvgraph_spec_decode_accepted_tokens", "Draft tokens the target accepted",
                   stats.get("spec_decode_accepted_tokens", 0))


def _verify_metrics(verify: dict[str, Any]) -> Iterator[Any]:
    """Verify mode's totals and its worst difference per descriptor (all zero when it is off)."""
    yield _counter("kvgraph_verify_checks", "Graph steps checked against eager (--verify)",
                   verify.get("checks", 0))
    yield _counter("kvgraph_verify_failures", "Checked steps whose graphs and eager differed "
                   "beyond the tolerance", verify.get("failures", 0))
    yield _counter("kvgraph_verify_token_flips", "Greedy tokens a checked step's graphs chose "
                   "differently from eager", verify.get("token_flips", 0))
    worst = GaugeMetricFamily("kvgraph_verify_max_rel_diff", "Largest logit difference seen, "
                              "relative to the eager logits' scale", labels=["mode", "descriptor"])
    for key, record in verify.get("descriptors", {}).items():
        mode, _, descriptor = key.partition(":")
        worst.add_metric([mode, descriptor], record["max_rel"])
    yield worst


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


class CountResponses:
    """ASGI middleware: counts every HTTP response by endpoint and status.

    It sits inside Starlette's outermost error middleware, so an unhandled exception reaches
    it before it becomes a 500: that 500 is counted here, like every answer a handler gives.
    """

    def __init__(self, app: ASGIApp, counter: Counter, endpoints: Collection[str]):
        self.app = app
        self.counter = counter
        self.endpoints = endpoints

    async def __call__(self, scope: Message, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else OTHER_ENDPOINT
        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if not started:  # the error middleware outside answers 500
                self.counter.labels(endpoint, "500").inc()
            raise
