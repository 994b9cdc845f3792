"""EngineProcess: the server's engine in a spawned process, driven over a pipe.

Compared with the same engine stepped in this process (LLMEngine.generate, greedy): the
tokens must match. Then what only a second process can get wrong: a request left early is
aborted there, a duplicate id and a refused request come back as errors, a model that cannot
be built fails start-up with the child's reason, and an engine process that dies fails the
requests in flight and every later one, and tells the server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from examples.engine import LLMEngine, RequestError, RequestFailed, SamplingParams, build_engine
from examples.engine.engine_process import EngineProcess, EngineStartError
from examples.serve import MODELS, parse_args
from tests.support.engine_process import FLAGS, GREEDY, tokens_of

PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [42], [5] * 20]


async def generate_all(engine: EngineProcess, prompts: list[list[int]]) -> list[list[int]]:
    return await asyncio.gather(*(tokens_of(engine, f"r{i}", p) for i, p in enumerate(prompts)))


@pytest.fixture(scope="module")
def engine():
    engine = EngineProcess(parse_args(FLAGS), MODELS)
    engine.start()
    yield engine
    engine.stop()
    assert engine._process.exitcode == 0


def idle_stats(engine: EngineProcess, aborted: int) -> dict:
    """The engine's stats once it has aborted `aborted` requests and holds none."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats  # a snapshot the engine process sends; it may lag a little
        if stats["aborted"] == aborted and stats["running"] == stats["waiting"] == 0:
            break
        time.sleep(0.02)
    return stats


def test_tokens_match_the_engine_stepped_in_this_process(engine):
    local: LLMEngine = build_engine(parse_args(FLAGS), MODELS)[0]
    expected = [list(c.token_ids) for c in local.generate(PROMPTS, GREEDY)]
    assert asyncio.run(generate_all(engine, PROMPTS)) == expected
    assert engine.summary["graph_mode"] == "piecewise"
    assert engine.tokenizer.decode([104, 105]) == local.tokenizer.decode([104, 105])


def test_a_request_left_early_is_aborted_in_the_engine_process(engine):
    aborted = engine.stats["aborted"]

    async def leave_after_two():
        stream = engine.generate("early", [1, 2], SamplingParams(max_tokens=50, ignore_eos=True))
        assert (await anext(stream)).token_ids and (await anext(stream)).token_ids
        await stream.aclose()

    asyncio.run(leave_after_two())
    stats = idle_stats(engine, aborted + 1)
    assert stats["aborted"] == aborted + 1
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_duplicate_id_and_a_refused_request_are_request_errors(engine):
    aborted = engine.stats["aborted"]

    async def both():
        long = engine.generate("same", [1], SamplingParams(max_tokens=40, ignore_eos=True))
        await anext(long)
        with pytest.raises(RequestError, match="already in flight"):
            await anext(engine.generate("same", [2], GREEDY))
        # Past check(): the engine process refuses it, and the error keeps its field.
        with pytest.raises(RequestError, match=r"lie in \[0, 256\)") as info:
            await anext(engine.generate("bad", [1, 10**6], GREEDY))
        assert info.value.param == "prompt"
        await long.aclose()

    with pytest.raises(RequestError, match="max_model_len"):
        engine.check([1] * 64, GREEDY)
    asyncio.run(both())
    stats = idle_stats(engine, aborted + 1)  # the long request, left
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_a_model_that_cannot_be_built_fails_start_up_with_the_reason(tmp_path):
    with pytest.raises(EngineStartError, match="neither one of"):
        EngineProcess(parse_args(["--model", str(tmp_path / "missing"), "--engine-loop",
                                  "process"]), MODELS)


def test_an_engine_process_that_dies_fails_its_requests_and_tells_the_server():
    fatal, told = [], threading.Event()

    def on_fatal(error):  # called from the engine process's reader thread
        fatal.append(error)
        told.set()

    engine = EngineProcess(parse_args(FLAGS), MODELS, on_fatal=on_fatal)
    engine.start()

    async def killed_mid_request():
        stream = engine.generate("doomed", [1, 2, 3],
                                 SamplingParams(max_tokens=60, ignore_eos=True))
        await anext(stream)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="exit code -9"):
            async for _ in stream:
                pass
        with pytest.raises(RequestFailed, match="the engine stopped"):
            await anext(engine.generate("later", [1], GREEDY))

    try:
        asyncio.run(killed_mid_request())
        assert told.wait(10) and len(fatal) == 1 and "exited unexpectedly" in str(fatal[0])
        assert engine.fatal_error is fatal[0]
    finally:
        engine.stop()
