"""The server stays live or says it is not: a client leaving never stops the engine's output
thread, /health answers 503 for a dead or stuck engine, and SIGTERM stops the server in bounded
time, whoever else it reaches.

Faults are injected the real way where a process can be: a client that leaves as its last token
is on its way (the reader held back in that window), an engine process stopped with SIGSTOP, a
tensor-parallel worker killed with SIGKILL while the engine is idle, SIGTERM to the server's
process group. The thread engine's stuck step is a model forward that blocks.

Time itself is asserted only where a loaded machine cannot move it: the step watch's limit on a
clock of the test's own; a stopped engine asked about until it is reported stuck; stops that
take at least the waits they are given, and at most those plus a wide margin.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from examples.engine import AsyncEngine, RequestFailed, SamplingParams, build_engine
from examples.engine import async_engine, engine_process, liveness
from examples.engine.engine_core import OUTPUTS
from examples.engine.engine_process import EngineProcess
from examples.engine.liveness import StepWatch
from examples.serve import MODELS, parse_args
from tests.support.engine_process import FLAGS, GREEDY, tokens_of
from tests.support.scripts import REPO, SCRIPT_ENV, free_port

LONG = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)


class HeldPipe:
    """The server's end of the engine's pipe, handing over each message that finishes a request
    `hold_s` late: the window in which a client can leave as its last token is on its way."""

    def __init__(self, conn, hold_s: float):
        self._conn = conn
        self.hold_s = hold_s
        self.holding = threading.Event()

    def recv(self):
        message = self._conn.recv()
        if message[0] == OUTPUTS and any(output.finished for output in message[1]):
            self.holding.set()
            time.sleep(self.hold_s)
        return message

    def __getattr__(self, name):
        return getattr(self._conn, name)


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


def test_a_step_is_overdue_only_once_it_has_run_longer_than_the_limit(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(liveness, "time", clock)  # the watch's clock
    watch = StepWatch(2.0)
    assert watch.overdue() is None  # no step
    watch.begin()
    clock.now += 2.0
    assert watch.overdue() is None  # at the limit, not past it
    clock.now += 1.0
    assert watch.overdue() == ("the engine is stuck: a step has run for 3 s, longer than the 2 s "
                               "one may take (--stuck-step-timeout)")
    watch.begin()  # the next step
    assert watch.overdue() is None
    clock.now += 10.0
    watch.end()
    assert watch.overdue() is None  # idle, however long


async def reported_stuck(engine) -> str:
    """Why `engine.liveness()` calls the engine stuck, once it does (a minute at most: the
    watch's limit is counted from the last message, which a loaded machine may read late)."""
    deadline = time.monotonic() + 60
    while (why := engine.liveness()) is None:
        assert time.monotonic() < deadline, "a stopped engine was never reported"
        await asyncio.sleep(0.05)
    return why


def started(engine: EngineProcess, conn=None) -> EngineProcess:
    if conn is not None:
        engine._conn = conn
    engine.start()
    return engine


def test_a_client_leaving_as_its_last_token_arrives_leaves_the_server_serving():
    engine = EngineProcess(parse_args(FLAGS), MODELS)
    pipe = HeldPipe(engine._conn, hold_s=0.5)
    started(engine, pipe)

    async def leave_at_the_last_token():
        stream = engine.generate("leaver", [1, 2, 3],
                                 SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        await anext(stream)
        assert await asyncio.to_thread(pipe.holding.wait, 30)  # the last token is on its way
        await stream.aclose()  # the client leaves
        pipe.hold_s = 0.0
        await asyncio.sleep(1.0)  # the held message is handled meanwhile
        return await asyncio.wait_for(tokens_of(engine, "after", [4, 5, 6]), 30)

    try:
        assert len(asyncio.run(leave_at_the_last_token())) == GREEDY.max_tokens
        assert engine.liveness() is None and engine._reader.is_alive()
    finally:
        engine.stop()


def test_an_output_thread_that_cannot_handle_a_message_ends_the_engine_loudly():
    class Malformed(HeldPipe):
        def recv(self):
            message = self._conn.recv()
            return (OUTPUTS, None, None) if message[0] == OUTPUTS and message[1] else message

    told = threading.Event()
    engine = EngineProcess(parse_args(FLAGS), MODELS, on_fatal=lambda error: told.set())
    started(engine, Malformed(engine._conn, 0.0))

    async def one():
        return await asyncio.wait_for(tokens_of(engine, "r", [1, 2]), 30)

    try:
        with pytest.raises(RequestFailed, match="engine-output thread failed: TypeError"):
            asyncio.run(one())
        assert told.wait(5)
        assert "engine-output thread failed" in engine.liveness()
    finally:
        engine.stop()


def test_a_stopped_engine_process_is_reported_stuck_then_stopped_in_bounded_time(monkeypatch):
    monkeypatch.setattr(engine_process, "ENGINE_STOP_S", 1.0)
    engine = started(EngineProcess(parse_args(FLAGS), MODELS, step_watch=StepWatch(1.0)))
    failures = []

    async def stuck_then_continued():
        stream = engine.generate("stuck", [1, 2, 3], LONG)
        await anext(stream)
        os.kill(engine.pid, signal.SIGSTOP)
        why = await reported_stuck(engine)
        os.kill(engine.pid, signal.SIGCONT)
        async for _ in stream:
            pass
        return why

    try:
        why = asyncio.run(stuck_then_continued())
        assert why is not None and "stuck" in why and "--stuck-step-timeout" in why
        assert engine.liveness() is None  # it went on once continued

        async def stopped_mid_request():
            stream = engine.generate("frozen", [1, 2, 3], LONG)
            await anext(stream)
            os.kill(engine.pid, signal.SIGSTOP)
            start = time.monotonic()
            await asyncio.to_thread(engine.stop)
            failures.append(time.monotonic() - start)
            with pytest.raises(RequestFailed, match="the server stopped"):
                async for _ in stream:
                    pass

        asyncio.run(stopped_mid_request())
        # It waited for the stopped process, then for SIGTERM (pending while stopped), then
        # sent SIGKILL: never sooner than those waits, and later only by the joins' overhead.
        waits = engine_process.ENGINE_STOP_S + engine_process.TERMINATE_WAIT_S
        assert waits <= failures[0] < waits + engine_process.TERMINATE_WAIT_S + 1.0
        assert engine._process.exitcode == -signal.SIGKILL
    finally:
        if engine._process.is_alive():
            engine.stop()


def test_a_thread_engine_whose_step_blocks_is_stuck_and_stops_in_bounded_time(monkeypatch):
    monkeypatch.setattr(async_engine, "STOP_TIMEOUT_S", 0.5)
    args = parse_args(["--preset", "tiny", "--graph-mode", "eager", "--max-model-len", "64",
                       "--max-num-seqs", "2"])
    engine, _ = build_engine(args, MODELS)
    release, blocked = threading.Event(), threading.Event()

    def block(module, inputs):
        if engine.num_steps >= 1:  # the second step hangs until released
            blocked.set()
            release.wait(30)

    engine.runner.model.register_forward_pre_hook(block)
    loop = AsyncEngine(engine, step_watch=StepWatch(0.5))
    loop.start()

    async def run():
        stream = loop.generate("r", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
        await anext(stream)
        assert await asyncio.to_thread(blocked.wait, 30)
        await asyncio.sleep(0.8)
        stuck = loop.liveness()
        start = time.monotonic()
        loop.stop()
        return stuck, time.monotonic() - start

    stuck, stop_s = asyncio.run(run())
    release.set()
    assert stuck is not None and "a step has run for" in stuck
    assert async_engine.STOP_TIMEOUT_S <= stop_s < 2.0  # it gave the step its time, then left it


def test_a_worker_that_dies_while_the_engine_is_idle_makes_it_unhealthy_at_once():
    from tests.support.tp_engines import EAGER, tp_engine

    with tp_engine(*EAGER) as engine:
        deaths = []
        loop = AsyncEngine(engine, on_fatal=deaths.append)
        loop.start()
        assert loop.liveness() is None
        os.kill(engine.runner.workers.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while loop.liveness() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        why = loop.liveness()
        loop.stop()
    assert why is not None and re.search(r"rank 1 \(pid \d+\) died, killed by SIGKILL", why)
    assert len(deaths) == 1


# --- a real server process ---------------------------------------------------------------

def _serve(tmp_path, *flags: str) -> tuple[subprocess.Popen, str, object]:
    """A server in a process group of its own, healthy; its process, URL and log path."""
    httpx = pytest.importorskip("httpx")
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "examples/serve.py", *FLAGS, "--port", str(port), *flags],
            cwd=REPO, env=SCRIPT_ENV, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        assert server.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def _engine_pid(log) -> int:
    return int(re.search(r"the engine runs in process (\d+)", log.read_text()).group(1))


@contextlib.contextmanager
def _streaming(url: str, max_tokens: int) -> Iterator[Iterator[str]]:
    """A streamed completion under way: the rest of its lines, once its first chunk came."""
    import httpx

    body = {"prompt": "hello", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            yield lines


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_sigterm_to_the_process_group_stops_the_server_quietly_answering_what_is_in_flight(
        tmp_path):
    server, url, log = _serve(tmp_path, "--shutdown-timeout", "20")
    engine_pid = _engine_pid(log)
    try:
        with _streaming(url, max_tokens=40) as lines:
            start = time.monotonic()
            os.killpg(server.pid, signal.SIGTERM)  # as timeout, systemd and kill -TERM -PGID
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # the request in flight was answered whole
        # Hang guards: it exits in ~3 s, beside a CPU hog too; a process's exit gets a minute.
        assert server.wait(timeout=60) == 0
        assert time.monotonic() - start < 60
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    text = log.read_text()
    assert "CRITICAL" not in text and "exited unexpectedly" not in text, text
    assert _gone(engine_pid)


@pytest.mark.slow
def test_sigterm_stops_a_server_whose_engine_is_stuck_in_bounded_time(tmp_path):
    import httpx

    server, url, log = _serve(tmp_path, "--shutdown-timeout", "1", "--stuck-step-timeout", "1")
    engine_pid = _engine_pid(log)
    try:
        with _streaming(url, max_tokens=50) as lines:
            os.kill(engine_pid, signal.SIGSTOP)
            # Unhealthy once the watch's second has passed since the server read the engine's
            # last message (late, on a loaded machine): asked until then, for a minute at most.
            deadline = time.monotonic() + 60
            while (health := httpx.get(f"{url}/health", timeout=60)).status_code == 200:
                assert time.monotonic() < deadline, "a stopped engine was never reported"
                time.sleep(0.1)
            assert health.status_code == 503 and "stuck" in health.json()["error"]
            start = time.monotonic()
            server.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.HTTPError):  # failed: cut off, never left hanging
                list(lines)
        # The grace, the engine's time to stop, then SIGTERM and SIGKILL to it: never sooner
        # (it waits for each), and later only by a teardown that took 1.5 s beside a CPU hog.
        assert server.wait(timeout=60) == 0
        waits = 1 + engine_process.ENGINE_STOP_S + engine_process.TERMINATE_WAIT_S
        assert waits <= time.monotonic() - start < waits + engine_process.TERMINATE_WAIT_S + 15
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert _gone(engine_pid)


@pytest.mark.slow
def test_clients_leaving_at_their_last_token_again_and_again_never_hang_the_server(tmp_path):
    """The adversarial user's reproduction, kept as a soak: a streamed request of two tokens
    whose client closes after the first chunk, many times; the server then still answers."""
    import httpx

    from tests.support.checkpoints import write_checkpoint
    from tests.support.servers import serving, wait_for_free_blocks

    body = {"prompt": "hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with serving(str(write_checkpoint(tmp_path)), "piecewise", engine_loop="process") as url:
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(30):
                with client.stream("POST", "/v1/completions", json=body) as response:
                    assert next(line for line in response.iter_lines()
                                if line.startswith("data: "))
            answer = client.post("/v1/completions", json={**body, "stream": False}, timeout=30)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
            assert client.get("/health").status_code == 200
        health = wait_for_free_blocks(url)
        assert health["kv_blocks_free"] == health["kv_blocks_total"]
