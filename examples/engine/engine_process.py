"""EngineProcess: the engine in a process of its own, its outputs as asyncio streams.

The server's default. The engine's step is Python between torch ops, and so is the server's
work per token (JSON, server-sent events, sockets): in one process they take turns holding the
GIL, and each waits out the other's switch interval. In two processes they run side by side,
the server on the core the engine's compute threads leave free (threads.py). vLLM splits its
server from its engine core the same way. engine_core.py is the other end of the pipe.

Same surface as AsyncEngine: `start`, `stop`, `close`, `check`, `generate`, `stats`, `fatal_error`,
`liveness`, `on_fatal`, `tokenizer`. Start-up builds the engine in the new process and waits for
it, so a model that cannot load or compile fails here (EngineStartError), before anything is
served.

Nothing may stop the output thread while the server runs: a request whose client left as its
last token arrived, or any other surprise in a message, must not end it, since every later
request would wait forever on a thread that is gone. What cannot be handled ends the engine
loudly instead (`_die`: requests fail, /health answers 503, the server stops).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import logging
import multiprocessing
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Mapping, Sequence

from .async_engine import deliver, request_stream
from .engine_core import (ABORT, ADD, FAILED, FATAL, OUTPUTS, READY, REFUSED, STEP_FAILED, STOP,
                          STOPPED, EngineInfo, run_engine_core)
from .errors import EngineDeadError, RequestError, RequestFailed
from .liveness import StepWatch
from .termination import ENGINE_STOP_S
from .request import RequestOutput
from .request_checks import check_request
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Seconds `stop` waits for the engine process to end after SIGTERM, then after SIGKILL:
# stopping the server is bounded whatever the engine does.
TERMINATE_WAIT_S = 2.0


class EngineStartError(RuntimeError):
    """The engine process could not build its engine (the message says why), or died trying."""


class EngineProcess:
    """Builds an engine from the server's flags in a spawned process and drives it over a pipe.

    Requests go to the engine process as messages, sent by a writer thread (a send blocks when
    the pipe is full, as it is while a burst of requests meets a long step, and the event loop
    must not); each step's outputs come back in one, which a reader thread hands to each
    request's asyncio queue. A request's stream is registered before its message is queued:
    no output can arrive for a stream not yet known.
    """

    def __init__(self, args: argparse.Namespace, models: Mapping[str, Any],
                 on_fatal: Callable[[EngineDeadError], None] | None = None,
                 step_watch: StepWatch | None = None):
        self.on_fatal = on_fatal
        self.fatal_error: EngineDeadError | None = None
        # The engine's steps are not seen from here: "a step in progress" is the time since the
        # last message while requests are in flight.
        self.step_watch = step_watch or StepWatch()
        # Spawned, not forked: a fork of a process that has started OpenMP's or torch's
        # threads inherits their locks, not the threads.
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        # Not a daemon: with tensor parallelism the engine process starts the other ranks.
        self._process = context.Process(target=run_engine_core, args=(child_conn, args, models),
                                        name="kvgraph-engine")
        self._process.start()
        child_conn.close()  # so that the engine process dying reads as EOF here
        # multiprocessing joins non-daemon children at exit: closing the pipe first makes a
        # server that exits without `stop` end the engine process instead of waiting on it.
        atexit.register(self._conn.close)
        info = self._wait_ready()
        self.tokenizer = info.tokenizer
        self.summary = info.summary
        self.stats: dict[str, Any] = info.stats  # replaced, never mutated: safe to read
        self._max_model_len, self._vocab_size = info.max_model_len, info.vocab_size
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()  # over _streams
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._stopping = False
        self._writer = threading.Thread(target=self._write, name="engine-inputs", daemon=True)
        self._reader = threading.Thread(target=self._read, name="engine-outputs", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def start(self) -> None:
        self._writer.start()
        self._reader.start()

    def stop(self) -> None:
        """Stop the engine process (it closes its runner, and any tensor-parallel ranks), in
        at most ENGINE_STOP_S + 2 x TERMINATE_WAIT_S; requests still in flight fail."""
        deadline = time.monotonic() + ENGINE_STOP_S
        self._stopping = True  # from now on, the engine process ending is expected
        if self._writer.is_alive():
            self._outbox.put((STOP,))
            self._outbox.put(None)
            self._writer.join(_left(deadline))
        else:
            try:
                self._conn.send((STOP,))
            except OSError:
                pass  # already gone, or never started
        if self._reader.is_alive():
            self._reader.join(_left(deadline))
        self._process.join(_left(deadline))
        if self._process.is_alive():
            logger.warning("the engine process did not stop in %.0f s; terminating it",
                           ENGINE_STOP_S)
            self._process.terminate()
            self._process.join(TERMINATE_WAIT_S)
        if self._process.is_alive():  # a stopped (SIGSTOP) process leaves SIGTERM pending
            self._process.kill()
            self._process.join(TERMINATE_WAIT_S)
        self._fail_in_flight("the server stopped before it finished")
        self._conn.close()
        atexit.unregister(self._conn.close)

    def close(self) -> None:
        """`stop`, if it has not run (the engine process owns the runner)."""
        self.stop()

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Refuse a request that could never run (RequestError), before it is sent."""
        check_request(prompt_token_ids, params, self._max_model_len, self._vocab_size)

    def liveness(self) -> str | None:
        """Why the engine cannot serve now (for /health), or None while it can: it died, a
        thread that carries its messages or its process is gone, or a step is overdue."""
        if self.fatal_error is not None:
            return str(self.fatal_error)
        for thread in (self._reader, self._writer):
            if thread.ident is not None and not thread.is_alive():
                return f"the server's {thread.name} thread has stopped"
        if not self._process.is_alive():
            return f"the engine process exited (exit code {self._process.exitcode})"
        return self.step_watch.overdue()

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams, kv_transfer_params: dict[str, Any] | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, one per token; leaving early aborts it (its blocks are
        freed before the engine's next step). `kv_transfer_params`: vLLM's, for the KV
        connector."""

        def submit(loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> None:
            with self._lock:  # _die sets fatal_error under it: no stream registers after
                if self.fatal_error is not None:
                    outputs.put_nowait(RequestFailed(f"the engine stopped: {self.fatal_error}"))
                    return
                if request_id in self._streams:
                    outputs.put_nowait(RequestError(
                        "request_id", f"request id {request_id!r} is already in flight"))
                    return
                if not self._streams:  # the engine's first step for it starts now
                    self.step_watch.begin()
                self._streams[request_id] = (loop, outputs)
            self._outbox.put((ADD, request_id, list(prompt_token_ids), params,
                              kv_transfer_params))

        def leave() -> None:
            with self._lock:
                left = self._streams.pop(request_id, None) is not None
            if left and self.fatal_error is None:
                self._outbox.put((ABORT, request_id))

        return request_stream(submit, leave)

    # --- the writer and reader threads ----------------------------------------------------

    def _write(self) -> None:
        message = self._outbox.get()
        while message is not None:
            try:
                self._conn.send(message)
            except OSError:  # the engine process is gone: the reader reports it
                return
            message = self._outbox.get()

    def _read(self) -> None:
        try:
            while True:
                message = self._conn.recv()
                if message[0] == STOPPED:
                    return
                self._handle(message)
                self._watch_steps()
        except (EOFError, OSError):
            if self._stopping:  # `stop` ended it: the requests left fail there
                return
            self._process.join(1.0)
            self._die(EngineDeadError(f"the engine process exited unexpectedly (exit code "
                                      f"{self._process.exitcode})"))
        except Exception as error:  # noqa: BLE001 - see the module's docstring
            logger.exception("the engine's output thread failed")
            self._die(EngineDeadError(f"the server's engine-output thread failed: "
                                      f"{type(error).__name__}: {error}"))

    def _watch_steps(self) -> None:
        """After a message from the engine: while requests are in flight, a step is running."""
        # Once per step: no lock, a dict's length is read whole, and a stream added meanwhile
        # has begun the watch itself (`generate`).
        if self._streams:
            self.step_watch.begin()
        else:
            self.step_watch.end()

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == OUTPUTS:
            _, outputs, stats = message
            for output in outputs:
                self._deliver(output.request_id, output if output.error is None
                              else RequestFailed(output.error), output.finished)
            if stats is not None:
                self.stats = stats
        elif kind == REFUSED:
            _, request_id, param, text, status = message
            error = RequestError(param, text)
            error.status = status
            self._deliver(request_id, error, True)
        elif kind == STEP_FAILED:
            _, request_ids, why = message
            for request_id in request_ids:
                self._deliver(request_id, RequestFailed(why), True)
        elif kind == FATAL:
            self._die(EngineDeadError(message[1]))

    def _deliver(self, request_id: str, item: Any, last: bool) -> None:
        # A stream may be gone: its client left (`leave`) while this output was on its way.
        with self._lock:
            stream = self._streams.pop(request_id, None) if last else \
                self._streams.get(request_id)
        if stream is not None:
            deliver(*stream, item)

    def _die(self, error: EngineDeadError) -> None:
        """Fail every request in flight with `error`, refuse all later ones, tell `on_fatal`."""
        if self.fatal_error is not None:
            return
        logger.critical("the engine cannot go on: %s", error)
        with self._lock:
            self.fatal_error = error
        self._fail_in_flight(f"the engine stopped: {error}")
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _fail_in_flight(self, why: str) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            deliver(*stream, RequestFailed(why))

    def _wait_ready(self) -> EngineInfo:
        """The engine's start-up info, once it is built; EngineStartError if it is not."""
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join()
            raise EngineStartError(f"the engine process exited during start-up (exit code "
                                   f"{self._process.exitcode}); its log says why") from None
        if message[0] == FAILED:
            self._process.join()
            raise EngineStartError(message[1])
        assert message[0] == READY, message[0]
        return message[1]


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
