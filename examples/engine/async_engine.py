"""AsyncEngine: the engine loop in one background thread, its outputs as asyncio streams.

An `EngineDeadError` from a step (a tensor-parallel rank died) ends the engine: every request
in flight, and every one added later, fails saying why; `fatal_error` holds it, and the
`on_fatal` callback (the server's: stop serving) is called once, from the loop thread. While
idle, the loop looks at the ranks every IDLE_CHECK_S, so a rank that dies then is found too.
`liveness()` says why the engine cannot serve (dead, its loop gone, a step overdue) for /health.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, AsyncIterator, Callable, Sequence

from .burst_window import BurstWindow
from .engine import LLMEngine
from .errors import EngineDeadError, RequestError, RequestFailed
from .liveness import IDLE_CHECK_S, StepWatch, check_ranks
from .request import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_STOP = object()  # what `_receive` makes of the stop command (None: nothing came)
# Seconds between refreshes of the stats snapshot that HTTP threads read.
STATS_INTERVAL = 0.25
# Seconds `stop` waits for the loop thread to finish its step: a stuck step cannot hold up the
# server's exit (the thread is a daemon).
STOP_TIMEOUT_S = 10.0


class AsyncEngine:
    """Drives an `LLMEngine` from one thread for callers in any asyncio event loop.

    Callers never touch the engine: they put commands (add, abort) on a queue, which the loop
    thread applies between steps, so the scheduler and its blocks have a single owner. Each
    request's outputs come back through an asyncio queue of the caller's loop; a request the
    engine refuses raises RequestError there, one it fails raises RequestFailed.
    """

    def __init__(self, engine: LLMEngine,
                 on_fatal: Callable[[EngineDeadError], None] | None = None,
                 burst: BurstWindow = BurstWindow(), step_watch: StepWatch | None = None):
        self.engine = engine
        self.burst = burst
        self.step_watch = step_watch or StepWatch()
        self.on_fatal = on_fatal
        self.fatal_error: EngineDeadError | None = None
        self.stats: dict[str, Any] = engine.stats()  # replaced, never mutated: safe to read
        self._commands: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stats_time = 0.0

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(STOP_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("the engine loop did not stop in %.0f s (a step is stuck); leaving it",
                         STOP_TIMEOUT_S)

    def close(self) -> None:
        """Release the engine's runner (with tensor parallelism, stop the other ranks), unless
        a step stuck on the loop thread still uses it (spawned ranks then stop at exit)."""
        if self._thread.is_alive():
            logger.error("not closing the runner: a step is still running on it")
            return
        self.engine.close()

    def liveness(self) -> str | None:
        """Why the engine cannot serve now (for /health), or None while it can."""
        if self.fatal_error is not None:
            return str(self.fatal_error)
        if self._thread.ident is not None and not self._thread.is_alive():
            return "the engine loop thread has stopped"
        return self.step_watch.overdue()

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Refuse a request that could never run (RequestError), before it is queued."""
        self.engine.check(prompt_token_ids, params)

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 params: SamplingParams, kv_transfer_params: dict[str, Any] | None = None
                 ) -> AsyncIterator[RequestOutput]:
        """The request's outputs, one per token; leaving early aborts it (its blocks are
        freed before the next step). `kv_transfer_params`: vLLM's, for the KV connector."""
        def submit(loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue) -> None:
            if self.fatal_error is not None:  # the loop may be gone: nobody would take it
                outputs.put_nowait(RequestFailed(f"the engine stopped: {self.fatal_error}"))
                return
            self._commands.put(lambda: self._add(request_id, prompt_token_ids, params, loop,
                                                 outputs, kv_transfer_params))

        return request_stream(submit, lambda: self._commands.put(lambda: self._abort(request_id)))

    # --- the loop thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as error:  # noqa: BLE001 - never a silent hang: end the engine loudly
            logger.exception("the engine loop failed")
            self._die(EngineDeadError(f"the engine loop failed: {type(error).__name__}: "
                                      f"{error}"))

    def _loop(self) -> None:
        while True:
            # Block for a command only when there is nothing to step (or nothing can be).
            stepping = self.engine.has_unfinished and self.fatal_error is None
            if not self._apply_commands(block=not stepping):
                return
            if stepping:
                self._step()
            if self.fatal_error is None:
                self._refresh_stats()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands, and when they wake an idle engine, those that follow within
        its burst window; False when asked to stop."""
        idle = not self.engine.has_unfinished
        try:
            command = self._next_command(block)
            while command is not None:
                command()
                command = self._commands.get_nowait()
            return False
        except queue.Empty:
            pass
        if idle and self.engine.has_unfinished:
            for command in self.burst.gather(self._receive, lambda: self.engine.is_full):
                if command is _STOP:
                    return False
                command()
        return True

    def _next_command(self, block: bool) -> Callable[[], None] | None:
        """The next command; while blocked waiting for one, look at the ranks now and then."""
        while block:
            try:
                return self._commands.get(timeout=IDLE_CHECK_S)
            except queue.Empty:
                if self.fatal_error is None:
                    self._check_ranks()
        return self._commands.get_nowait()

    def _check_ranks(self) -> None:
        try:
            check_ranks(self.engine.runner)
        except EngineDeadError as error:
            self._die(error)

    def _receive(self, timeout: float) -> Callable[[], None] | object | None:
        try:
            command = self._commands.get(timeout=timeout)
        except queue.Empty:
            return None
        return _STOP if command is None else command

    def _add(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
             loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue,
             kv_transfer_params: dict[str, Any] | None = None) -> None:
        if self.fatal_error is not None:
            deliver(loop, outputs, RequestFailed(f"the engine stopped: {self.fatal_error}"))
            return
        try:
            self.engine.add_request(prompt_token_ids, params, request_id,
                                    kv_transfer_params=kv_transfer_params)
        except RequestError as error:
            deliver(loop, outputs, error)
            return
        except Exception as error:  # the loop thread must outlive any request
            logger.exception("adding request %s failed", request_id)
            deliver(loop, outputs, RequestFailed(f"adding the request failed: {error}"))
            return
        self._streams[request_id] = (loop, outputs)

    def _abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def _step(self) -> None:
        self.step_watch.begin()
        try:
            outputs = self.engine.step()
        except EngineDeadError as error:
            self._die(error)
            return
        except Exception as error:  # a bug in the engine itself: fail its requests, not the server
            logger.exception("engine step failed; aborting every request in flight")
            for request_id, (loop, stream) in list(self._streams.items()):
                deliver(loop, stream, RequestFailed(f"engine step failed: {error}"))
                self._abort(request_id)
            return
        finally:
            self.step_watch.end()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                deliver(*stream, output if output.error is None else RequestFailed(output.error))
            if output.finished:
                self._streams.pop(output.request_id, None)

    def _die(self, error: EngineDeadError) -> None:
        """Fail every request in flight with `error`, refuse all later ones, tell `on_fatal`."""
        logger.critical("the engine cannot go on: %s", error)
        self.fatal_error = error
        for request_id, (loop, stream) in list(self._streams.items()):
            deliver(loop, stream, RequestFailed(f"the engine stopped: {error}"))
            self._abort(request_id)
        if self.on_fatal is not None:
            self.on_fatal(error)

    def _refresh_stats(self) -> None:
        now = time.perf_counter()
        if now - self._stats_time >= STATS_INTERVAL or not self.engine.has_unfinished:
            self.stats = self.engine.stats()
            self._stats_time = now


def deliver(loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue, item: Any) -> None:
    try:
        loop.call_soon_threadsafe(outputs.put_nowait, item)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


async def request_stream(submit: Callable[[asyncio.AbstractEventLoop, asyncio.Queue], None],
                         on_leave: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs until it finishes, an exception among them raised: `submit(loop,
    outputs)` starts it once the caller first asks, with the queue its outputs go to;
    `on_leave()` is called if the caller leaves before it finishes."""
    loop = asyncio.get_running_loop()
    outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    submit(loop, outputs)
    finished = False
    try:
        while not finished:
            output = await outputs.get()
            if isinstance(output, BaseException):
                finished = True
                raise output
            finished = output.finished
            yield output
    finally:
        if not finished:  # the caller went away (a client disconnect cancels it here)
            on_leave()
