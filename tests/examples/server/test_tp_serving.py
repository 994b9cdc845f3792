"""Tensor-parallel serving: rank 0's engine broadcasts each step to worker ranks that follow it.

References are TP=1 runs of the same flags: two ranks (the tiny Llama sharded over them) must
give the same greedy tokens, offline, through the server and under torchrun. Faults are real
where it is cheap (a worker killed with SIGKILL, a batch every rank refuses) and stand-ins
where only rank 0's logic is under test (a channel whose peer is gone).
"""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

import kvgraph
from examples.engine import AsyncEngine, EngineDeadError, SamplingParams, build_engine
from examples.engine.step_channel import MESSAGE_BYTES
from examples.engine.tp_runner import RankFailed, TensorParallelRunner
from examples.engine.tp_workers import STOP_WAIT_S
from examples.generate import MODELS, parse_args
from examples.models.llama import Llama
from examples.models.tensor_parallel import RowParallelLinear
from kvgraph import distributed as tp
from tests.support.checkpoints import write_checkpoint
from tests.support.engines import PROMPTS
from tests.support.scripts import REPO, SCRIPT_ENV, free_port
from tests.support.tp_engines import EAGER, FLAGS, threads_kept, tp_engine

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def tokens(completions) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]


@pytest.fixture(scope="module")
def reference():
    """The greedy tokens of PROMPTS with TP=1 (no torch.distributed)."""
    engine, _ = build_engine(parse_args(FLAGS), MODELS)
    try:
        return tokens(engine.generate(PROMPTS, GREEDY))
    finally:
        engine.runner.close()


# --- two ranks, spawned by this process ------------------------------------------------------

def test_two_ranks_generate_the_tokens_of_one_and_stop_when_closed(reference):
    with tp_engine() as engine:
        runner = engine.runner
        assert isinstance(runner, TensorParallelRunner) and runner.world_size == 2
        assert any(isinstance(m, RowParallelLinear) for m in runner.model.modules())
        assert tokens(engine.generate(PROMPTS, GREEDY)) == reference
        assert runner.stats()["tensor_parallel"] == {"size": 2,
                                                     "steps_broadcast": engine.num_steps}
        workers = runner.workers
    # close() said stop: the worker left by itself, and this process left the group.
    assert workers.stop() == {1: 0}
    with pytest.raises(kvgraph.RunnerError, match="closed"):
        runner.execute([kvgraph.RequestChunk([1], 0, [0])])
    assert not dist.is_initialized()
    assert tp.tensor_parallel_group().world_size == 1


def test_batches_every_rank_refuses_leave_the_workers_running(reference):
    bad_block = kvgraph.RequestChunk([1, 2, 3], 0, [10**6])  # a block id past the cache
    too_long = kvgraph.RequestChunk([1] * 20_000, 0, [0])  # more than its blocks hold
    assert len(pickle.dumps(too_long)) > MESSAGE_BYTES  # its message goes in two broadcasts
    with tp_engine(*EAGER) as engine:
        for bad, why in ((bad_block, "block"), (too_long, "20000 tokens")):
            with pytest.raises(kvgraph.BatchError, match=why):
                engine.runner.execute([bad])
        # Both ranks skipped them and go on in step: the next steps' collectives still pair up.
        assert tokens(engine.generate(PROMPTS[:2], GREEDY)) == reference[:2]
        assert engine.runner.workers.first_dead() is None


def test_a_worker_killed_mid_run_stops_the_engine_naming_its_rank_and_signal(tmp_path):
    # A checkpoint dir's model this time: each rank loads its shard of the same files.
    checkpoint = str(write_checkpoint(tmp_path))
    with tp_engine(*EAGER, "--max-model-len", "1024", "--model", checkpoint) as engine:
        assert any(isinstance(m, RowParallelLinear) for m in engine.runner.model.modules())
        pid = engine.runner.workers.pids[1]
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
        long = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)  # seconds of steps
        # Found before a step, by a broadcast or by a model collective: the same error.
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) died, killed by SIGKILL") as dead:
            engine.generate(PROMPTS[:2], long)
        assert (dead.value.rank, dead.value.exitcode) == (1, -signal.SIGKILL)
        assert engine.num_failed == 0  # not one request's fault: nothing was failed alone
        with pytest.raises(RankFailed) as again:
            engine.step()
        assert again.value is dead.value
        start = time.monotonic()
    # Closing after a death waits for nobody: waiting for a worker would take a worker's stop
    # wait or the group's timeout (60 s), the shortest being STOP_WAIT_S.
    assert time.monotonic() - start < STOP_WAIT_S


# A prompt that starts with POISON breaks rank 1's step; BROKEN_SEED breaks its start-up.
POISON, BROKEN_SEED = 255, 13


class RankOneFaults(Llama):
    """The tiny Llama, failing on rank 1 only: to build with seed BROKEN_SEED, and to run a step
    holding a prompt that starts with POISON (before its first collective)."""

    @classmethod
    def from_hf(cls, *args, seed=0, **kwargs):
        if seed == BROKEN_SEED and tp.tp_rank() == 1:
            raise OSError("rank 1 cannot read its weights")
        return super().from_hf(*args, seed=seed, **kwargs)

    def forward(self, input_ids, positions):
        if tp.tp_rank() == 1 and bool(((input_ids == POISON) & (positions == 0)).any()):
            raise RuntimeError("rank 1 broke on a poisoned prompt")
        return super().forward(input_ids, positions)


FAULTY = {**MODELS, "faulty": RankOneFaults}


def test_a_worker_whose_step_fails_exits_and_rank_0_names_it():
    with tp_engine(*EAGER, "--model", "faulty", models=FAULTY) as engine:
        engine.add_request([POISON, 1, 2], GREEDY)
        with pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) died, exit code 1") as dead:
            engine.step()
        assert dead.value.rank == 1


def test_a_worker_that_fails_to_start_is_named_and_nothing_is_left_behind():
    args = parse_args([*FLAGS, *EAGER, "--tensor-parallel-size", "2", "--model", "faulty",
                       "--seed", str(BROKEN_SEED)])
    with threads_kept(), pytest.raises(RankFailed, match=r"rank 1 \(pid \d+\) died during "
                                       r"start-up, exit code 1 \(rank 0 saw "):
        build_engine(args, FAULTY)
    assert not dist.is_initialized()


# --- rank 0's logic alone, on stand-ins ----------------------------------------------------

class GoneChannel:
    """A step channel whose peer went away after `ok` messages."""

    rank, world_size = 0, 2

    def __init__(self, ok: int):
        self.ok = ok
        self.sent: list[str] = []

    def send(self, kind, payload=None):
        if len(self.sent) >= self.ok:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        self.sent.append(kind)


@pytest.fixture
def gone_after_two_steps():
    """An engine over a TensorParallelRunner (on a real tiny runner) whose worker is gone after
    two steps, as torchrun leaves it: no process handle to say which rank."""
    from tests.support.engines import make_engine

    engine = make_engine(lambda: MODELS["llama"].from_preset("tiny", seed=1), budget=8)
    channel = GoneChannel(ok=2)
    engine.runner = TensorParallelRunner(engine.runner, channel)
    yield engine, channel
    engine.runner.close()


def test_a_broadcast_that_fails_is_fatal_not_one_requests_fault(gone_after_two_steps):
    engine, channel = gone_after_two_steps
    engine.add_request(PROMPTS[3], GREEDY)  # 30 tokens: four prefill steps of 8
    engine.step()
    engine.step()
    with pytest.raises(EngineDeadError, match="broadcasting a step failed: RuntimeError: "
                       "Connection closed.*torchrun's report"):
        engine.step()
    assert (engine.num_failed, engine.num_step_retries) == (0, 0)
    engine.runner.close()
    assert channel.sent == ["step", "step"]  # no stop sent to a group that is broken


def test_the_async_engine_fails_every_request_and_refuses_more_once_dead(gone_after_two_steps):
    engine, _ = gone_after_two_steps
    deaths = []
    async_engine = AsyncEngine(engine, on_fatal=deaths.append)
    async_engine.start()

    async def outcome(prompt):
        try:
            return [o async for o in async_engine.generate(f"r{len(prompt)}", prompt, GREEDY)]
        except Exception as error:  # noqa: BLE001 - the test looks at which
            return error

    async def run():
        first = await asyncio.gather(*(outcome(p) for p in PROMPTS[2:4]))
        return first, await outcome(PROMPTS[0])

    try:
        (a, b), later = asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        async_engine.stop()
    assert len(deaths) == 1 and isinstance(deaths[0], RankFailed)
    assert async_engine.fatal_error is deaths[0]
    for failed in (a, b, later):
        assert "the engine stopped: broadcasting a step failed" in str(failed), failed


def test_the_server_answers_500_then_health_503_once_the_engine_died(gone_after_two_steps):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from examples.serve import build_app

    engine, _ = gone_after_two_steps
    deaths = []
    with TestClient(build_app(AsyncEngine(engine, on_fatal=deaths.append), "tiny")) as client:
        assert client.get("/health").status_code == 200
        answer = client.post("/v1/completions", json={"prompt": "x" * 30, "max_tokens": 2})
        assert answer.status_code == 500
        assert "the engine stopped: broadcasting a step failed" in answer.text
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "dead"
    assert len(deaths) == 1


# --- flags --------------------------------------------------------------------------------

def test_a_torchrun_world_size_that_disagrees_with_the_flag_is_refused(monkeypatch):
    from examples.engine.tp_launch import tensor_parallel_size

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert tensor_parallel_size(None) == 2
    with pytest.raises(ValueError, match="--tensor-parallel-size 4 does not match torchrun's "
                       "WORLD_SIZE=2"):
        tensor_parallel_size(4)


def test_one_device_index_for_several_ranks_is_refused():
    from examples.engine.tp_launch import Rendezvous, rank_device

    rendezvous = Rendezvous(1, 2, 1, 2)
    assert rank_device("cuda", rendezvous) == "cuda:1"
    assert rank_device("cpu", rendezvous) == "cpu"
    with pytest.raises(ValueError, match="--device cuda:0 names one device, but 2"):
        rank_device("cuda:0", rendezvous)


# --- slow: the server, and torchrun --------------------------------------------------------

def token_ids(stdout: str) -> list[list[int]]:
    """The token ids generate.py printed, request by request."""
    return [json.loads(ids) for ids in re.findall(r"token ids (\[[\d, ]*\])", stdout)]


GENERATE = [sys.executable, "examples/generate.py", *FLAGS, "--max-new-tokens", "6"]


@pytest.mark.slow
def test_torchrun_with_two_processes_generates_the_tokens_of_one():
    one = subprocess.run(GENERATE, cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True,
                         timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", *GENERATE[1:], "--tensor-parallel-size", "2"],
                         cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    assert "on 2 tensor-parallel ranks" in two.stdout
    assert token_ids(two.stdout) == token_ids(one.stdout) and len(token_ids(one.stdout)) == 4


@pytest.mark.slow
def test_the_server_on_two_ranks_answers_like_one():
    pytest.importorskip("httpx")
    from examples.serve import BackgroundServer, build_app
    from tests.support.servers import complete_all, request_body

    bodies = [request_body(i) for i in range(8)]
    answers = []
    for flags in ([], ["--tensor-parallel-size", "2"]):
        with threads_kept():
            engine, _ = build_engine(parse_args([*FLAGS, "--max-model-len", "128", *flags]),
                                     MODELS)
            try:
                with BackgroundServer(build_app(AsyncEngine(engine), "tiny")) as server:
                    answers.append(asyncio.run(complete_all(server.url, bodies)))
            finally:
                engine.runner.close()
    assert answers[1] == answers[0]


@pytest.mark.slow
def test_a_dead_worker_stops_the_server_saying_which(tmp_path):
    httpx = pytest.importorskip("httpx")
    port, log = free_port(), tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [sys.executable, "examples/serve.py", *FLAGS, "--tensor-parallel-size", "2",
             "--port", str(port)], cwd=REPO, env=SCRIPT_ENV, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while not _healthy(httpx, url):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        pid = int(re.search(r"spawned tensor-parallel rank 1 \(pid (\d+)\)",
                            log.read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4},
                            timeout=60)
        assert answer.status_code == 500
        assert "tensor-parallel rank 1" in answer.json()["error"]["message"]
        assert server.wait(timeout=60) == 1
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    text = log.read_text()
    assert re.search(r"the server stopped: tensor-parallel rank 1 \(pid \d+\) died, killed by "
                     r"SIGKILL", text), text


def _healthy(httpx, url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
