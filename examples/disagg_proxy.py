"""One OpenAI-style endpoint over prefill and decode servers (disaggregated prefill).

Each request's prompt is prefilled on one server and decoded on another:

    python examples/disagg_proxy.py --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

The prefill servers (P) and decode servers (D) are examples/serve.py serving one model, P with a
`kv_producer` TorchDistributedConnector and D with a `kv_consumer` one (docs/kv-transfer.md).
For each POST /v1/completions or /v1/chat/completions, as vLLM's proxies do:

1. the next P (round-robin) prefills the request: it is sent with `kv_transfer_params:
   {"do_remote_decode": true}`, one token to generate (`max_tokens: 1`, and
   `max_completion_tokens: 1`, which the chat API reads first), `stream: false` and no
   `stream_options`; P answers with `kv_transfer_params` saying where the prompt's blocks are
   (P holds them until D has them, or for its connector's `timeout_s`);
2. the next D gets the original request with those `kv_transfer_params`: it pulls the prompt's
   blocks from P instead of computing them, then generates;
3. D's answer, streamed or not, is the client's, as D sent it.

P's refusal or failure is the client's answer (P's status and body); a server that cannot be
reached is a 502 (504 when it does not answer in --timeout). A P without a connector answers
`kv_transfer_params: null`: D then computes the prompt itself (the same answer, later; logged
once). More than one choice (`n` > 1) is refused (400): one prefill hands over one request.
GET /health and /v1/models are the first D's answers. With --push, D is sent the request first
and P pushes the blocks layer by layer as it computes them (examples/disagg_push.py).

Needs fastapi, uvicorn and httpx, imported once the flags are parsed (`--help` needs none of
them); not torch. A mistake in the flags is one line on stderr and exit status 2.
"""

# No `from __future__ import annotations`: FastAPI must see the routes' `Request` class.
import argparse
import itertools
import json
import logging
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Sequence

if TYPE_CHECKING:
    import httpx
    from fastapi import FastAPI, Request, Response

if __package__:
    from .disagg_flags import OneLineParser, number, server_url
    from .disagg_push import SideChannels, Unreachable, push_bodies, pushed
else:
    from disagg_flags import OneLineParser, number, server_url
    from disagg_push import SideChannels, Unreachable, push_bodies, pushed

PROG = Path(__file__).name
PACKAGES = ("fastapi", "uvicorn", "httpx")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
# The largest request body read, as serve.py's limit (examples/engine/json_body.py).
MAX_BODY_BYTES = 4 << 20
DEFAULT_TIMEOUT_S = 600.0
# An idle pooled connection is dropped after this, before the servers' own keep-alive (uvicorn's
# 5 s) closes it: a request sent on a connection the server closes meanwhile fails (ReadError,
# seen about once in a few hundred requests under load when both were 5 s).
KEEPALIVE_S = 2.0
logger = logging.getLogger("examples.disagg_proxy")


def build_parser() -> argparse.ArgumentParser:
    """This script's flags."""
    parser = OneLineParser(prog=PROG, description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", action="append", type=server_url, required=True,
                        metavar="URL", help="a prefill server (examples/serve.py with a "
                        "kv_producer connector), e.g. http://127.0.0.1:8100; repeat the flag "
                        "for several, taken in turn")
    parser.add_argument("--decode", action="append", type=server_url, required=True,
                        metavar="URL", help="a decode server (examples/serve.py with a "
                        "kv_consumer connector); repeat the flag for several, taken in turn; "
                        "the first also answers /health and /v1/models")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default %(default)s: this machine only)")
    parser.add_argument("--port", type=number(0, 65535, int, "a TCP port"), default=8000,
                        help="the TCP port to listen on (default %(default)s; 0: any free one)")
    parser.add_argument("--timeout", type=number(1e-3, 86400, float, "seconds"),
                        default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="how long to wait for a server to connect, and then for each "
                        "part of its answer (default %(default)g)")
    parser.add_argument("--push", action="store_true",
                        help="send D the request first and P its prefill at the same time: P "
                        "pushes each layer's blocks into D's cache as it computes them (P with "
                        "kv_connector_extra_config push: true; its side channel is read from "
                        "its GET /v1/kv_transfer)")
    return parser


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error"
               ) -> dict[str, Any]:
    """An error in OpenAI's shape, as serve.py's."""
    return {"error": {"message": message, "type": kind, "param": param}}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as P's prefill: one token, not streamed, P's blocks kept for a decode server."""
    prefill = {**body, "kv_transfer_params": {"do_remote_decode": True}, "stream": False,
               "max_tokens": 1}
    prefill.pop("stream_options", None)  # refused without stream: true
    if "messages" in body or "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1  # the chat API's newer name wins over max_tokens
    return prefill


def build_app(prefill: Sequence[str], decode: Sequence[str],
              timeout: float = DEFAULT_TIMEOUT_S, push: bool = False) -> "FastAPI":
    """The proxy's app over the servers at `prefill` and `decode` (root URLs); `push`: the
    layer-by-layer push's flow."""
    import contextlib

    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    next_prefill, next_decode = itertools.cycle(prefill), itertools.cycle(decode)
    # One pool for every server; no cap on connections: each stream in flight holds one.
    client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_S))
    warned: set[str] = set()
    side_channels = SideChannels(client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await client.aclose()

    app = FastAPI(title="kvgraph disaggregated-prefill proxy", lifespan=lifespan)

    def unreachable(role: str, url: str, error: httpx.HTTPError) -> JSONResponse:
        late = isinstance(error, httpx.TimeoutException)
        why = f"did not answer in {timeout:g} s" if late else "could not be reached"
        return JSONResponse(error_body(f"the {role} server {url} {why} ({type(error).__name__}"
                                       f": {error})", kind="server_error"),
                            status_code=504 if late else 502)

    def relayed(reply: httpx.Response, content: bytes) -> Response:
        return Response(content, reply.status_code,
                        media_type=reply.headers.get("content-type", "application/json"))

    async def send(url: str, path: str, body: Any, stream: bool = False) -> httpx.Response:
        """`body` POSTed to `url`'s `path`; read whole unless `stream` (the caller closes it)."""
        reply = await client.send(client.build_request("POST", f"{url}{path}", json=body),
                                  stream=True)
        if not stream:
            try:
                await reply.aread()
            finally:
                await reply.aclose()
        return reply

    async def proxy(http: Request, path: str) -> Response:
        body = await _read_json(http)
        if isinstance(body, Response):
            return body
        n = body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return JSONResponse(error_body(f"a disaggregated request serves one choice: n must "
                                           f"be 1, got {n}", "n"), status_code=400)
        stream = body.get("stream") is True
        if push:
            url, decode_url = next(next_prefill), next(next_decode)
            try:
                bodies = push_bodies(body, prefill_body(body), await side_channels.of(url))
                refused, reply = await pushed(send, url, decode_url, path, bodies, stream)
            except LookupError as error:
                return JSONResponse(error_body(str(error), kind="server_error"), 502)
            except httpx.HTTPError as error:
                return unreachable("prefill", url, error)
            except Unreachable as error:
                return unreachable(error.role, error.url, error.error)
            if reply is None:
                return relayed(refused, refused.content)  # P refused or failed
            return await answer(reply, stream)
        url = next(next_prefill)
        try:
            reply = await send(url, path, prefill_body(body))
        except httpx.HTTPError as error:
            return unreachable("prefill", url, error)
        if reply.status_code != 200:
            return relayed(reply, reply.content)  # P refused or failed: the client's answer
        params = (_json_object(reply.content) or {}).get("kv_transfer_params")
        if not isinstance(params, dict) and url not in warned:
            warned.add(url)
            logger.warning("the prefill server %s answers no kv_transfer_params (no kv_producer "
                           "connector?): decode servers compute those prompts themselves", url)
        url = next(next_decode)
        try:
            reply = await send(url, path, {**body, "kv_transfer_params": params}, stream)
        except httpx.HTTPError as error:
            return unreachable("decode", url, error)
        return await answer(reply, stream)

    async def answer(reply: httpx.Response, stream: bool) -> Response:
        """D's reply relayed to the client, streamed as it comes when `stream`."""
        if not stream or reply.status_code != 200:  # refused: a status, not a stream
            try:
                return relayed(reply, await reply.aread())
            finally:
                await reply.aclose()
        return StreamingResponse(_relay(reply), status_code=reply.status_code,
                                 media_type=reply.headers.get("content-type"))

    def route(path: str) -> Callable[[Request], Awaitable[Response]]:
        async def handle(http: Request) -> Response:
            return await proxy(http, path)
        return handle

    def first_decode(path: str) -> Callable[[], Awaitable[Response]]:
        async def handle() -> Response:
            try:
                reply = await client.get(f"{decode[0]}{path}")
            except httpx.HTTPError as error:
                return unreachable("decode", decode[0], error)
            return relayed(reply, reply.content)
        return handle

    for path in (COMPLETIONS, CHAT):
        app.post(path)(route(path))
    for path in ("/health", "/v1/models"):
        app.get(path)(first_decode(path))
    return app


async def _relay(reply: "httpx.Response") -> AsyncIterator[bytes]:
    """A streamed answer's bytes as they come; closed when it ends or the client leaves (the
    server then sees its client gone and aborts the request, freeing its blocks)."""
    try:
        async for part in reply.aiter_bytes():
            yield part
    finally:
        await reply.aclose()


def _json_object(data: bytes) -> dict[str, Any] | None:
    """`data` as a JSON object; None when it is not one."""
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _read_json(http: "Request") -> "dict[str, Any] | Response":
    """The request's body, a JSON object, or the answer that refuses it (413, 400)."""
    from fastapi.responses import JSONResponse

    data = bytearray()
    async for part in http.stream():
        data += part
        if len(data) > MAX_BODY_BYTES:
            return JSONResponse(error_body(f"the request body is over {MAX_BODY_BYTES >> 20} "
                                           "MiB"), status_code=413)
    body = _json_object(bytes(data))
    if body is None:
        return JSONResponse(error_body("the request body must be a JSON object"),
                            status_code=400)
    return body


def _fail(message: str) -> None:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    for name in PACKAGES:
        try:
            __import__(name)
        except ImportError as error:
            _fail(f"the proxy needs {name}, which does not import ({error}): "
                  f"pip install fastapi uvicorn httpx")
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
    try:
        listener.bind((args.host, args.port))
    except OSError as error:
        listener.close()
        _fail(f"--host {args.host} --port {args.port}: cannot listen there ({error.strerror})")
    with listener:
        app = build_app(args.prefill, args.decode, args.timeout, args.push)
        port = listener.getsockname()[1]
        logger.info("proxying on http://%s:%d: prefill %s, decode %s", args.host, port,
                    ", ".join(args.prefill), ", ".join(args.decode))
        uvicorn.Server(uvicorn.Config(app, host=args.host, port=port, log_level="info")).run(
            sockets=[listener])


if __name__ == "__main__":
    main()
