"""The engine process's side of `EngineProcess`: build the engine, then step it, taking commands
from the server's pipe between steps and sending back each step's outputs in one message.

Messages to the engine: `(ADD, request_id, prompt_token_ids, params[, kv_transfer_params])`,
`(ABORT, request_id)`, `(STOP,)`. From it: `(READY, EngineInfo)` or `(FAILED, why)` once, at
start-up; then `(OUTPUTS, [RequestOutput...], stats or None)` after each step, `(REFUSED,
request_id, param, message, status)` for a request the engine will not run, `(STEP_FAILED,
[request_id...], why)` when a step raised (those requests end), `(FATAL, why)` when the engine
cannot step again, and `(STOPPED,)` last. Errors travel as their fields: RequestError's constructor does not take
what pickling would give it.
"""

from __future__ import annotations

import argparse
import logging
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Mapping

from kvgraph import CompileError

from .burst_window import BurstWindow, burst_window
from .engine import LLMEngine
from .errors import EngineDeadError, RequestError
from .liveness import IDLE_CHECK_S, check_ranks
from .termination import DEFAULT_SHUTDOWN_S, ENGINE_STOP_S, defer_sigterm

logger = logging.getLogger(__name__)

ADD, ABORT, STOP = "add", "abort", "stop"
READY, FAILED, OUTPUTS, REFUSED, STEP_FAILED, FATAL, STOPPED = (
    "ready", "failed", "outputs", "refused", "step_failed", "fatal", "stopped")
# Why an engine may fail to build that its message says whole (a missing checkpoint, a bad flag,
# a model that does not compile); any other exception's message is prefixed with its type.
STARTUP_ERRORS = (CompileError, EngineDeadError, FileNotFoundError, NotImplementedError,
                  ValueError)
# Seconds between the stats snapshots sent with a step's outputs (always sent when idle).
STATS_INTERVAL = 0.25


@dataclass(frozen=True)
class EngineInfo:
    """What the server needs from the engine process at start-up."""

    tokenizer: Any
    max_model_len: int
    vocab_size: int | None
    summary: dict[str, Any]  # build_engine's start-up summary
    stats: dict[str, Any]


def run_engine_core(conn: Connection, args: argparse.Namespace,
                    models: Mapping[str, Any]) -> None:
    """The engine process's entry point: build the engine from the server's flags, say READY
    (or FAILED, and exit 1), then serve commands until STOP or the server goes away."""
    # Ctrl-C reaches the whole process group; the server stops this process itself, in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # So may SIGTERM (termination.py): wait as long as the server may take to stop this process.
    defer_sigterm("the engine process", getattr(args, "shutdown_timeout", DEFAULT_SHUTDOWN_S)
                  + ENGINE_STOP_S)
    logging.basicConfig(level=logging.INFO,
                        format="%(levelname)s %(name)s [engine process]: %(message)s")
    from .engine_args import build_engine  # here: the server process never builds one

    try:
        engine, summary = build_engine(args, models)
    except STARTUP_ERRORS as error:
        conn.send((FAILED, str(error)))
        raise SystemExit(1) from None
    except Exception as error:  # noqa: BLE001 - the server reports it and does not start
        logger.exception("building the engine failed")
        conn.send((FAILED, f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from None
    try:
        limits = engine.runner.limits
        conn.send((READY, EngineInfo(engine.tokenizer, limits.max_model_len,
                                     engine.runner.vocab_size, summary, engine.stats())))
        EngineCore(engine, conn, burst_window(args)).run()
    finally:
        engine.close()  # with tensor parallelism: the other ranks stop too


class EngineCore:
    """Steps one engine while it has work, applying the pipe's commands between steps."""

    def __init__(self, engine: LLMEngine, conn: Connection,
                 burst: BurstWindow = BurstWindow()):
        self.engine = engine
        self.conn = conn
        self.burst = burst
        self.dead = False  # after an EngineDeadError: take commands, never step again
        self._stats_time = 0.0

    def run(self) -> None:
        try:
            while True:
                stepping = self.engine.has_unfinished and not self.dead
                if (not stepping or self.conn.poll()) and not self._apply_commands():
                    break
                if stepping:
                    self._step()
            self.conn.send((STOPPED,))
        except (EOFError, BrokenPipeError, ConnectionResetError):
            logger.warning("the server went away; the engine process stops")

    def _apply_commands(self) -> bool:
        """Apply the waiting commands (wait for the first if none is), and when they wake an
        idle engine, those that follow within its burst window; False on STOP."""
        idle = not self.engine.has_unfinished
        while idle and not self.dead and not self.conn.poll(IDLE_CHECK_S):
            self._check_ranks()
        while True:
            if not self._apply(self.conn.recv()):
                return False
            if not self.conn.poll():
                break
        if idle and self.engine.has_unfinished:
            for message in self.burst.gather(self._receive, lambda: self.engine.is_full):
                if not self._apply(message):
                    return False
        if not self.engine.has_unfinished:
            self.conn.send((OUTPUTS, [], self._stats(force=True)))
        return True

    def _apply(self, message: tuple) -> bool:
        """Apply one command; False on STOP."""
        if message[0] == STOP:
            return False
        if message[0] == ADD:
            self._add(*message[1:])
        elif message[0] == ABORT:
            self.engine.abort(message[1])
        return True

    def _receive(self, timeout: float) -> tuple | None:
        return self.conn.recv() if self.conn.poll(timeout) else None

    def _add(self, request_id: str, prompt_token_ids: list[int], params: Any,
             kv_transfer_params: dict[str, Any] | None = None) -> None:
        if self.dead:
            self.conn.send((STEP_FAILED, [request_id], "the engine stopped"))
            return
        try:
            self.engine.add_request(prompt_token_ids, params, request_id,
                                    kv_transfer_params=kv_transfer_params)
        except RequestError as error:
            self.conn.send((REFUSED, request_id, error.param, str(error), error.status))
        except Exception as error:  # noqa: BLE001 - the loop must outlive any request
            logger.exception("adding request %s failed", request_id)
            self.conn.send((STEP_FAILED, [request_id], f"adding the request failed: {error}"))

    def _check_ranks(self) -> None:
        """While idle: a tensor-parallel rank that died is fatal now, not at the next step."""
        try:
            check_ranks(self.engine.runner)
        except EngineDeadError as error:
            self._die(error)

    def _die(self, error: EngineDeadError) -> None:
        logger.critical("the engine cannot go on: %s", error)
        self.dead = True
        self._abort_all()
        self.conn.send((FATAL, str(error)))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError as error:
            self._die(error)
            return
        except Exception as error:  # noqa: BLE001 - a bug in the engine: fail its requests
            logger.exception("engine step failed; aborting every request in flight")
            self.conn.send((STEP_FAILED, self._abort_all(), f"engine step failed: {error}"))
            return
        self.conn.send((OUTPUTS, outputs, self._stats(force=not self.engine.has_unfinished)))

    def _abort_all(self) -> list[str]:
        request_ids = list(self.engine.requests)
        for request_id in request_ids:
            self.engine.abort(request_id)
        return request_ids

    def _stats(self, force: bool) -> dict[str, Any] | None:
        now = time.perf_counter()
        if not force and now - self._stats_time < STATS_INTERVAL:
            return None
        self._stats_time = now
        return self.engine.stats()
