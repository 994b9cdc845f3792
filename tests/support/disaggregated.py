"""Disaggregated serving in tests: the servers as a user starts them, and stand-ins for them.

`launched(command, log)` runs an example script (serve.py, disagg_proxy.py) in a process group
of its own until the block ends, once its /health answers 200; `connector_metrics` and
`settled_metrics` read its KV connector's counts on /metrics. `Upstream` is a stand-in for a
prefill or decode server, serving a canned answer and recording the bodies it was sent, so the
proxy's requests can be checked without a model.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

from tests.support.scripts import REPO, SCRIPT_ENV, free_port

# How long a server may take to answer /health 200 on a loaded two-core machine.
START_TIMEOUT_S = 240


class ServerURL(str):
    """A launched server's URL, with its `pid` (its process group's id too: it leads one)."""

    pid: int


@contextlib.contextmanager
def launched(command: list[str], log: Path) -> Iterator[ServerURL]:
    """`python <command> --port N` until the block ends: its URL, once healthy. Its output goes
    to `log`, shown when it dies or does not start in START_TIMEOUT_S."""
    port = free_port()
    with open(log, "w") as out:
        process = subprocess.Popen([sys.executable, *command, "--port", str(port)], cwd=REPO,
                                   env=SCRIPT_ENV, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = ServerURL(f"http://127.0.0.1:{port}")
    url.pid = process.pid
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        yield url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # a server's engine process stops with it
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def connector_metrics(url: str) -> dict[str, float]:
    """A server's KV connector counts on /metrics, and its prompt tokens computed."""
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(("kvgraph_kv_connector_", "kvgraph_prompt_tokens_computed")):
            name, value = line.split(" ")
            values[name] = float(value)
    return values


def settled_metrics(url: str, name: str, value: float) -> dict[str, float]:
    """/metrics once `name` reads `value` (the stats snapshot may trail an answer a little)."""
    deadline = time.monotonic() + 30
    while (metrics := connector_metrics(url))[name] != value:
        assert time.monotonic() < deadline, f"{name} stayed {metrics[name]}, never {value}"
        time.sleep(0.1)
    return metrics


@dataclass
class Upstream:
    """A stand-in server: POSTs get `answer` (JSON) with `status`, or, when the body asks for
    a stream, `events` as server-sent events; GETs get `{"server": name}`."""

    name: str
    answer: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    events: list[str] = field(default_factory=list)
    received: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)  # each POST's connection's

    def app(self) -> Any:
        # Imported here, and this module takes no `from __future__ import annotations`:
        # FastAPI must see the routes' `Request` annotation as the class itself.
        from fastapi import FastAPI, Request
        from fastapi.responses import JSONResponse, Response, StreamingResponse

        app = FastAPI()

        @app.post("/v1/{path:path}")
        async def post(path: str, http: Request) -> Response:
            body = json.loads(await http.body())
            self.received.append((f"/v1/{path}", body))
            self.client_ports.append(http.client.port)
            if body.get("stream") and self.status == 200:
                return StreamingResponse(iter(self.stream_bytes()),
                                         media_type="text/event-stream")
            return JSONResponse(self.answer, status_code=self.status)

        @app.get("/{path:path}")
        async def get(path: str) -> dict[str, Any]:
            return {"server": self.name, "path": f"/{path}"}

        return app

    def stream_bytes(self) -> list[bytes]:
        return [f"data: {event}\n\n".encode() for event in self.events]


@contextlib.contextmanager
def serving_apps(*apps: Any) -> Iterator[list[str]]:
    """Each of `apps` served from a thread of this process until the block ends: their URLs."""
    from examples.serve import BackgroundServer

    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(BackgroundServer(app)).url for app in apps]
