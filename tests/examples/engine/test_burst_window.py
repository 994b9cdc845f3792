"""The burst window: an idle serving loop takes a burst of requests into its first step.

The window itself against scripted arrivals on a clock of the test's own (what it takes, when
it stops); then both serving loops (the engine process's `EngineCore`, over a real pipe, and the
in-process `AsyncEngine`) with a tiny eager engine: two requests sent 20 ms apart into an idle
engine run in one step with the window and in two without it, a full batch or a stop ends the
wait at once.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import threading
import time

import pytest

from examples.engine import AsyncEngine, SamplingParams, build_engine
from examples.engine import burst_window as burst_window_module
from examples.engine.burst_window import MAX_GAP_MS, MAX_GAPS, BurstWindow, burst_window
from examples.engine.engine_core import ADD, OUTPUTS, STOP, STOPPED, EngineCore
from examples.serve import MODELS, parse_args
from kvgraph.runtime.platforms.cpu import CPUPlatform

CPU_GAP_MS = CPUPlatform.default_burst_gap_ms
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
MAX_NUM_SEQS = 4


class Arrivals:
    """Scripted arrivals on a clock of their own: message i comes delays[i] seconds after the
    one before it. `receive(timeout)` moves the clock on to that arrival, or by `timeout` (and
    returns None) when it comes later; `monotonic` reads the clock. Installed as the window's
    clock (`scripted`), the window is tested on its own arithmetic: a loaded machine's late
    wake-ups cannot close it early."""

    def __init__(self, delays: list[float]):
        self.now = 0.0
        self._pending = list(enumerate(delays))

    def monotonic(self) -> float:
        return self.now

    def receive(self, timeout: float):
        if not self._pending:
            self.now += timeout
            return None
        i, delay = self._pending[0]
        if delay > timeout:
            self.now += timeout
            self._pending[0] = (i, delay - timeout)
            return None
        self.now += delay
        self._pending.pop(0)
        return i


@pytest.fixture
def scripted(monkeypatch):
    """`scripted(delays)`: Arrivals whose clock the burst window reads (its module's `time`)."""
    def install(delays: list[float]) -> Arrivals:
        clock = Arrivals(delays)
        monkeypatch.setattr(burst_window_module, "time", clock)
        return clock

    return install


def test_the_window_takes_arrivals_within_the_gap_and_stops_at_the_first_silence(scripted):
    window = BurstWindow(gap_s=0.05)
    clock = scripted([0.001, 0.01, 0.2, 0.001])
    assert list(window.gather(clock.receive, full=lambda: False)) == [0, 1]
    assert clock.now == pytest.approx(0.011 + 0.05)  # one gap of silence after the last


def test_the_window_ends_after_max_gaps_even_while_arrivals_keep_coming(scripted):
    # Powers of two: the clock's sums are exact, so the window's end is too.
    window = BurstWindow(gap_s=0.5)
    clock = scripted([0.125] * 100)
    taken = list(window.gather(clock.receive, full=lambda: False))
    assert clock.now == MAX_GAPS * 0.5
    assert taken == list(range(int(MAX_GAPS * 0.5 / 0.125)))


def test_the_window_ends_when_the_engine_is_full_and_a_zero_gap_waits_for_nothing(scripted):
    taken: list[int] = []
    window = BurstWindow(gap_s=1.0)
    clock = scripted([0.0] * 10)
    for message in window.gather(clock.receive, full=lambda: len(taken) >= 3):
        taken.append(message)
    assert taken == [0, 1, 2] and clock.now == 0.0

    def never(timeout: float):
        raise AssertionError("a zero gap must not receive")

    assert list(BurstWindow(0.0).gather(never, full=lambda: False)) == []


@pytest.mark.parametrize("gap", [-0.001, math.nan, math.inf, 1.001])
def test_a_negative_nan_or_unbounded_gap_is_refused(gap):
    with pytest.raises(ValueError, match=r"burst window's gap must lie in \[0, 1\] seconds"):
        BurstWindow(gap)


def test_defaults_per_device_and_the_servers_flag(caplog):
    assert BurstWindow.for_device("cpu", None).gap_s == CPU_GAP_MS / 1000
    assert BurstWindow.for_device("cuda:0", None).gap_s == 0
    assert BurstWindow.for_device("npu", 2.5).gap_s == 0.0025
    assert BurstWindow.for_device("cpu", 0).gap_s == 0
    caplog.set_level("INFO")
    assert burst_window(parse_args(["--burst-gap-ms", "7"])).gap_s == 0.007
    assert "within 7.0 ms of each other" in caplog.text
    with pytest.raises(SystemExit):
        parse_args(["--burst-gap-ms", "-1"])


@pytest.fixture(scope="module")
def engine():
    args = parse_args(["--preset", "tiny", "--graph-mode", "eager", "--max-model-len", "64",
                       "--max-num-seqs", str(MAX_NUM_SEQS)])
    return build_engine(args, MODELS)[0]


class CoreInThread:
    """An EngineCore stepping `engine` in a thread; this side of its pipe is `conn`."""

    def __init__(self, engine, gap_s: float):
        self.conn, core_conn = multiprocessing.Pipe()
        self.thread = threading.Thread(
            target=EngineCore(engine, core_conn, BurstWindow(gap_s)).run, daemon=True)
        self.thread.start()

    def outputs_until_done(self, count: int) -> list[set[str]]:
        """The request ids of each step's outputs until `count` requests have finished."""
        steps, finished = [], 0
        while finished < count:
            message = self.conn.recv()
            if message[0] == OUTPUTS and message[1]:
                steps.append({o.request_id for o in message[1]})
                finished += sum(o.finished for o in message[1])
        return steps

    def stop(self) -> float:
        start = time.monotonic()
        self.conn.send((STOP,))
        while self.conn.recv()[0] != STOPPED:
            pass
        self.thread.join(5)
        return time.monotonic() - start


@pytest.mark.parametrize("gap_s, steps", [(0.5, [{"a", "b"}]), (0.0, [{"a"}, {"b"}])])
def test_engine_core_prefills_a_burst_in_one_step_with_the_window(engine, gap_s, steps):
    core = CoreInThread(engine, gap_s)
    core.conn.send((ADD, "a", [1, 2, 3], ONE_TOKEN))
    time.sleep(0.3 if gap_s == 0 else 0.02)
    core.conn.send((ADD, "b", [4, 5], ONE_TOKEN))
    assert core.outputs_until_done(2) == steps
    core.stop()


def test_engine_core_stops_waiting_once_the_batch_is_full_or_asked_to_stop(engine):
    core = CoreInThread(engine, gap_s=MAX_GAP_MS / 1000)  # a window of 4 s at most
    start = time.monotonic()
    for i in range(MAX_NUM_SEQS):
        core.conn.send((ADD, f"r{i}", [i + 1, 2], ONE_TOKEN))
    assert core.outputs_until_done(MAX_NUM_SEQS) == [{f"r{i}" for i in range(MAX_NUM_SEQS)}]
    assert time.monotonic() - start < 2.5
    core.conn.send((ADD, "lone", [9], ONE_TOKEN))
    assert core.stop() < 2.5  # the stop arrives inside the lone request's window
    engine.abort("lone")  # left queued by the stop; the engine is shared with later tests
    assert not engine.has_unfinished


@pytest.mark.parametrize("gap_s, steps", [(0.5, 1), (0.0, 2)])
def test_async_engine_prefills_a_burst_in_one_step_with_the_window(engine, gap_s, steps):
    loop_engine = AsyncEngine(engine, burst=BurstWindow(gap_s))
    loop_engine.start()
    before = engine.num_steps

    async def one(request_id: str, prompt: list[int], delay: float) -> None:
        await asyncio.sleep(delay)
        async for _ in loop_engine.generate(request_id, prompt, ONE_TOKEN):
            pass

    async def both() -> None:
        later = 0.3 if gap_s == 0 else 0.02
        await asyncio.gather(one("a", [1, 2, 3], 0.0), one("b", [4, 5], later))

    try:
        asyncio.run(both())
    finally:
        loop_engine.stop()
    assert engine.num_steps - before == steps
