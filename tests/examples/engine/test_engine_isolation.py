"""Faults stay with their request: one that breaks in the model step, in sampling or in
detokenizing fails alone, and the others in flight finish as if it had never been there.

Faults are real: a model whose forward raises (on a poisoned prompt, or for a number of steps),
a request whose random generator torch refuses, a request whose tokenizer raises. The
reference for the others is each prompt run alone on a healthy engine.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from examples.engine import FinishReason, SamplingParams
from examples.engine.detokenizer import Detokenizer
from examples.models.llama import Llama
from tests.support.engines import GREEDY, PROMPTS, make_engine

# A prompt that starts with this token breaks the model step it is in.
POISON = 255
# Short prompts, so that all of them (and a poisoned one) are prefilled in one step of 32.
OTHERS = [PROMPTS[0], PROMPTS[1]]
POISONED = [POISON, 1, 2, 3]


class FaultyLlama(Llama):
    """The tiny Llama, with two faults to arm: a batch holding a prompt that starts with
    POISON raises (one request's fault), and so do the next `broken_steps` forwards, whatever
    they hold (the step's own fault)."""

    broken_steps = 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.broken_steps:
            self.broken_steps -= 1
            raise RuntimeError("the device fell over")
        if bool(((input_ids == POISON) & (positions == 0)).any()):
            raise RuntimeError("a poisoned prompt broke the step")
        return super().forward(input_ids, positions)


class BrokenGenerator:
    """What a request may hold where a torch.Generator belongs: torch refuses it at sample
    time, inside the sampler's batched ops."""


class FailingDecoder:
    """A tokenizer that decodes `ok` tokens, then raises on the next."""

    def __init__(self, ok: int):
        self.ok = ok

    def decode(self, token_ids):
        if len(token_ids) > self.ok:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "a byte no character starts with")
        return "x" * len(token_ids)


def faulty_model():
    return FaultyLlama.from_preset("tiny", seed=1)


@pytest.fixture(scope="module")
def alone():
    """Each of OTHERS run alone on a healthy engine (the same weights)."""
    engine = make_engine(faulty_model)
    return [engine.generate([p], GREEDY)[0].token_ids for p in OTHERS]


def run_others(engine):
    """OTHERS added after whatever `engine` holds, and every request run to its end: the
    tokens of OTHERS."""
    others = [engine.add_request(p, GREEDY) for p in OTHERS]
    while engine.has_unfinished:
        engine.step()
    return [tuple(r.output_token_ids) for r in others]


def assert_all_blocks_free(engine):
    assert engine.allocator.num_free == engine.allocator.num_blocks
    assert not engine.requests and not engine.has_unfinished


def test_a_request_whose_sampling_raises_fails_alone(alone):
    engine = make_engine(faulty_model)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    faulty = engine.add_request(PROMPTS[2], sampled)
    faulty.generator = BrokenGenerator()
    others = run_others(engine)
    assert others == alone
    assert faulty.finish_reason is FinishReason.ABORT and not faulty.output_token_ids
    assert faulty.error.startswith("sampling failed: TypeError")
    assert engine.stats()["failed"] == 1
    assert_all_blocks_free(engine)


def test_a_request_whose_detokenizer_raises_fails_alone(alone):
    engine = make_engine(faulty_model)
    faulty = engine.add_request(PROMPTS[2], GREEDY)
    faulty.detokenizer = Detokenizer(FailingDecoder(ok=3))
    others = run_others(engine)
    assert others == alone
    assert faulty.finish_reason is FinishReason.ABORT and len(faulty.output_token_ids) == 4
    assert faulty.error.startswith("detokenizing failed: UnicodeDecodeError")
    assert_all_blocks_free(engine)


def test_a_model_step_that_one_request_breaks_fails_only_that_request(alone):
    engine = make_engine(faulty_model)
    faulty = engine.add_request(POISONED, GREEDY)
    others = run_others(engine)
    assert others == alone
    assert faulty.error == ("the model step failed for this request, in its batch and alone: "
                            "RuntimeError: a poisoned prompt broke the step")
    stats = engine.stats()
    assert (stats["failed"], stats["step_retries"]) == (1, 1)  # all three shared one step
    assert_all_blocks_free(engine)


def test_a_model_step_that_fails_once_is_run_again(alone):
    engine = make_engine(faulty_model)
    engine.runner.model.broken_steps = 1
    others = run_others(engine)
    assert others == alone
    stats = engine.stats()
    assert (stats["failed"], stats["step_retries"]) == (0, 1)


def test_a_broken_model_step_fails_its_requests_clearly_and_the_engine_recovers(alone):
    engine = make_engine(faulty_model)
    engine.runner.model.broken_steps = 1000
    requests = [engine.add_request(p, GREEDY) for p in OTHERS]
    outputs = engine.step()
    assert [o.request_id for o in outputs] == [r.request_id for r in requests]
    for output in outputs:
        assert output.finish_reason is FinishReason.ABORT
        assert output.error == ("the model step failed for all 2 requests of its batch and for "
                                "each alone: it is broken, not one request: RuntimeError: the "
                                "device fell over")
    assert_all_blocks_free(engine)
    engine.runner.model.broken_steps = 0
    assert engine.generate([OTHERS[1]], GREEDY)[0].token_ids == alone[1]


# --- the same faults through the server ------------------------------------------------------

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


def test_a_request_that_breaks_the_step_fails_alone_and_the_server_stays_up():
    from examples.engine import AsyncEngine
    from examples.serve import BackgroundServer, build_app
    from tests.support.servers import stream_text, wait_for_free_blocks

    # Long enough that both are still generating when the poisoned requests fail.
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    alone = [make_engine(faulty_model).generate([p], params)[0].text for p in OTHERS]
    bodies = [{"prompt": p, "max_tokens": params.max_tokens, "temperature": 0,
               "ignore_eos": True} for p in OTHERS]
    poisoned = {**bodies[0], "prompt": POISONED}

    async def others_while_poisoned(client):
        started = [asyncio.Event() for _ in bodies]
        others = [asyncio.create_task(stream_text(client, b, e)) for b, e in zip(bodies, started)]
        await asyncio.gather(*(e.wait() for e in started))
        failed = await asyncio.gather(client.post("/v1/completions", json=poisoned),
                                      client.post("/v1/completions",
                                                  json={**poisoned, "stream": True}))
        in_flight = not any(task.done() for task in others)
        return await asyncio.gather(*others), failed, in_flight

    engine = make_engine(faulty_model)
    with BackgroundServer(build_app(AsyncEngine(engine), "faulty")) as server:
        texts, failed, in_flight = asyncio.run(with_client(server.url, others_while_poisoned))
        assert texts == alone and in_flight
        for response in failed:  # the streamed one too: it failed before its first token
            assert response.status_code == 500, response.text
            assert "model step failed for this request" in response.json()["error"]["message"]
        with httpx.Client(base_url=server.url, timeout=60) as client:
            engine.runner.model.broken_steps = 1000  # now the step itself is broken
            broken = client.post("/v1/completions", json=bodies[0])
            assert broken.status_code == 500 and "the model step failed" in broken.text
            engine.runner.model.broken_steps = 0
            later = client.post("/v1/completions", json=bodies[1])
            assert later.status_code == 200 and later.json()["choices"][0]["text"] == alone[1]
        health = wait_for_free_blocks(server.url)
        assert health["kv_blocks_free"] == health["kv_blocks_total"]


async def with_client(url, run):
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return await run(client)

