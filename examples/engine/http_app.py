"""The HTTP app over an engine: OpenAI-style completions and chat completions (streamed or
not), health, the model list and Prometheus metrics (examples/serve.py serves it)."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgraph.kv_transfer import KVTransferConfig

from .async_engine import AsyncEngine
from .chat_template import SOURCES as CHAT_TEMPLATE_SOURCES
from .engine_process import EngineProcess
from .errors import ModelNotFound, RequestError, RequestFailed
from .http_answers import collect, events, merged, resume
from .json_body import parse_json, read_body
from .metrics import CountResponses, ServerMetrics
from .protocol import GenerationRequest, parse_chat, parse_completion
from .request import RequestOutput
from .responses import ResponseFormat, error_body
from .sampling_params import SamplingParams

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT, "/health", "/v1/models", "/metrics")


def build_app(engine: AsyncEngine | EngineProcess, model_name: str,
              kv_transfer: KVTransferConfig | None = None) -> FastAPI:
    """The FastAPI app; it starts the engine loop on start-up and stops it on shut-down.
    `kv_transfer`: the server's `--kv-transfer-config`, whose side channel a producer's
    GET /v1/kv_transfer gives (a pushing proxy's discovery)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="kvgraph example server", lifespan=lifespan,
                  exception_handlers={Exception: _internal_error})
    metrics = ServerMetrics(engine)
    app.add_middleware(CountResponses, counter=metrics.requests, endpoints=ENDPOINTS)
    tokenizer = engine.tokenizer

    async def generate(http: Request, chat: bool) -> Response:
        fmt = ResponseFormat(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name,
                             chat, token_text=lambda token: tokenizer.decode([token]))
        try:
            body = parse_json(await read_body(http))
            _check_model(body, model_name)
            parsed = (parse_chat if chat else parse_completion)(body, tokenizer)
            engine.check(parsed.prompt_token_ids, parsed.params)
            outputs = merged(await _start(engine, parsed, fmt.request_id))
        except (RequestError, RequestFailed) as error:
            return _error(error)
        prompt_tokens = len(parsed.prompt_token_ids)
        if parsed.stream:
            usage = prompt_tokens if parsed.include_usage else None
            return StreamingResponse(events(outputs, fmt, metrics, usage),
                                     media_type="text/event-stream")
        return await collect(outputs, parsed.n, fmt, prompt_tokens, metrics, http, _error)

    @app.post(COMPLETIONS)
    async def completions(http: Request) -> Response:
        return await generate(http, chat=False)

    @app.post(CHAT)
    async def chat_completions(http: Request) -> Response:
        if tokenizer.chat_template is None:
            return JSONResponse(error_body(
                "this model has no chat template (a checkpoint's is read from "
                f"{', '.join(CHAT_TEMPLATE_SOURCES)}, first found); use {COMPLETIONS}", None,
                "not_found_error"), status_code=404)
        return await generate(http, chat=True)

    @app.get("/health", response_model=None)
    async def health() -> dict[str, Any] | JSONResponse:
        why = engine.liveness()
        if why is not None:
            status = "dead" if engine.fatal_error is not None else "unhealthy"
            return JSONResponse({"status": status, "error": why}, status_code=503)
        stats = engine.stats
        return {"status": "ok", "graph_mode": stats["runner"]["graph_mode"],
                "running": stats["running"], "waiting": stats["waiting"],
                "kv_blocks_free": stats["kv_blocks_free"],
                "kv_blocks_total": stats["kv_blocks_total"]}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                            "owned_by": "kvgraph"}]}

    @app.get("/v1/kv_transfer", response_model=None)
    async def kv_transfer_side_channel() -> dict[str, Any] | JSONResponse:
        if kv_transfer is None or not kv_transfer.is_producer:
            return JSONResponse(error_body("this server prefills for no decode server (no "
                                           "kv_producer or kv_both --kv-transfer-config)", None,
                                           "not_found_error"), status_code=404)
        return {"kv_role": kv_transfer.kv_role, "kv_connector": kv_transfer.kv_connector,
                "host": kv_transfer.extra("host", "127.0.0.1"),
                "port": kv_transfer.extra("port", 0)}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    return app


def _check_model(body: Any, model_name: str) -> None:
    """Refuse (404) a request naming a model other than the one served; none named is fine."""
    requested = body.get("model") if isinstance(body, dict) else None
    if isinstance(requested, str) and requested != model_name:
        raise ModelNotFound("model", f"the model {requested!r} does not exist: this server "
                            f"serves {model_name!r} (GET /v1/models)")


def _error(error: RequestError | RequestFailed) -> JSONResponse:
    """A refused request's status (naming the field), or 500 for one the engine failed."""
    if isinstance(error, RequestError):
        kind = "not_found_error" if error.status == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(error), error.param, kind), status_code=error.status)
    return JSONResponse(error_body(str(error), None, "server_error"), status_code=500)


async def _internal_error(http: Request, error: Exception) -> JSONResponse:
    """An unhandled exception's 500, as JSON (the traceback goes to the log, not the client)."""
    return JSONResponse(error_body(f"internal server error ({type(error).__name__})", None,
                                   "server_error"), status_code=500)


async def _start(engine: AsyncEngine | EngineProcess, parsed: GenerationRequest, request_id: str
                 ) -> list[AsyncIterator[RequestOutput]]:
    """Each choice's output stream, its first output already there (so a refusal or failure
    that early is a real status); streams started before a failure are closed."""
    streams: list[AsyncIterator[RequestOutput]] = []
    try:
        for i in range(parsed.n):
            params = parsed.params if i == 0 else _nth_choice(parsed.params, i)
            stream = engine.generate(request_id if parsed.n == 1 else f"{request_id}-{i}",
                                     parsed.prompt_token_ids, params,
                                     kv_transfer_params=parsed.kv_transfer_params)
            streams.append(stream)
            first = await anext(stream)
            streams[-1] = resume(first, stream, parsed.echo_text)
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    return streams


def _nth_choice(params: SamplingParams, i: int) -> SamplingParams:
    """Choice `i`'s params: a seeded request's choices each draw from a seed of their own."""
    if params.seed is None:
        return params
    seed = params.seed + i if params.seed + i < 2**63 else params.seed - i
    return dataclasses.replace(params, seed=seed)
