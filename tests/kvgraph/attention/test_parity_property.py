"""Property: whatever the schedule, every graph mode computes what eager computes.

Hypothesis draws the steps a server would run: new requests with prompts chunked at random,
decode runs, requests skipped for a step, finished requests whose blocks return to a shuffled
free list and are reused. The same steps go through an eager runner and one runner per graph
mode, side by side; after every step the logits agree, the greedy tokens agree, and the cache
rows that live requests own are equal. Token ids are drawn in advance, so every runner sees
the same batches whatever its logits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgraph import RequestChunk
from tests.support.scenario import BLOCK_SIZE, NUM_BLOCKS, TOLERANCE, make_runner

# (mode, attention backend): test_always makes `full` capture mixed batches too.
GRAPH_MODES = [("piecewise", None), ("full_and_piecewise", None), ("full_decode_only", None),
               ("full", "test_always"), ("none", None)]
MAX_TOKENS, MAX_REQS = 32, 8  # scenario.make_runner's limits
MAX_SEQ_LEN = 28
_runners: dict = {}


def runners() -> dict:
    """One eager runner and one per graph mode, built and captured once per process."""
    if not _runners:
        _runners["eager"] = make_runner("llama", "eager")
        for mode, backend in GRAPH_MODES:
            runner = make_runner("llama", mode, attn_backend=backend)
            runner.capture()
            _runners[mode] = runner
    return _runners


@dataclass
class Request:
    token_ids: list[int]  # prompt and every token it will decode, fixed in advance
    prompt_len: int
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)


def next_step(data, live: dict[int, Request], free: list[int], rng: random.Random,
              next_id: list[int]) -> list[tuple[int, int]]:
    """Draw one step: (request, new tokens) pairs within the runners' limits."""
    budget, step = MAX_TOKENS, []
    for rid in data.draw(st.permutations(sorted(live))):
        request = live[rid]
        if budget == 0 or len(step) == MAX_REQS or data.draw(st.integers(0, 4)) == 0:
            continue  # not scheduled this step
        if request.num_computed < request.prompt_len:
            left = request.prompt_len - request.num_computed
            n = data.draw(st.integers(1, min(left, budget)))
        else:
            n = 1
        step.append((rid, n))
        budget -= n
    while len(live) < MAX_REQS and budget > 0 and data.draw(st.booleans()):
        prompt_len = data.draw(st.integers(1, 20))
        total = prompt_len + data.draw(st.integers(0, MAX_SEQ_LEN - prompt_len))
        rid = next_id[0] = next_id[0] + 1
        live[rid] = Request([rng.randrange(256) for _ in range(total)], prompt_len)
        step.append((rid, data.draw(st.integers(1, min(prompt_len, budget)))))
        budget -= step[-1][1]
    for rid, n in step:
        request = live[rid]
        while len(request.blocks) * BLOCK_SIZE < request.num_computed + n:
            request.blocks.append(free.pop())
    return step


def owned_rows(cache: torch.Tensor, request: Request) -> torch.Tensor:
    slots = torch.arange(request.num_computed)
    blocks = torch.tensor(request.blocks)[slots // BLOCK_SIZE]
    return cache[blocks, slots % BLOCK_SIZE]


def check_step(outputs: dict, live: dict[int, Request]) -> None:
    expected = outputs["eager"]
    # Greedy tokens agree wherever eager's top two logits are not a near tie.
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    for mode, logits in outputs.items():
        torch.testing.assert_close(logits, expected, **TOLERANCE, msg=mode)
        assert torch.equal(logits.argmax(-1)[clear], expected.argmax(-1)[clear]), mode
    eager = runners()["eager"]
    for mode, _ in GRAPH_MODES:
        for name, caches in runners()[mode].kv_caches.items():
            for got, want in zip(caches, eager.kv_caches[name]):
                for request in live.values():
                    torch.testing.assert_close(owned_rows(got, request),
                                               owned_rows(want, request), **TOLERANCE)


def run_schedule(data) -> None:
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    free = data.draw(st.permutations(range(NUM_BLOCKS)))
    live: dict[int, Request] = {}
    next_id = [0]
    for _ in range(data.draw(st.integers(1, 8))):
        step = next_step(data, live, free, rng, next_id)
        if not step:
            continue
        chunks = [RequestChunk(live[rid].token_ids[live[rid].num_computed:][:n],
                               live[rid].num_computed, live[rid].blocks) for rid, n in step]
        outputs = {mode: runner.execute(chunks) for mode, runner in runners().items()}
        for rid, n in step:
            live[rid].num_computed += n
        check_step(outputs, live)
        for rid in [rid for rid, r in live.items() if r.num_computed == len(r.token_ids)]:
            free.extend(live.pop(rid).blocks)  # finished: its blocks are reused, shuffled
            rng.shuffle(free)


COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@settings(max_examples=8, **COMMON)
@given(st.data())
def test_every_graph_mode_matches_eager_on_random_schedules(data):
    run_schedule(data)


@pytest.mark.slow
@settings(max_examples=60, **COMMON)
@given(st.data())
def test_every_graph_mode_matches_eager_on_many_random_schedules(data):
    run_schedule(data)
