"""Draft-model speculative decoding (issue 47): a smaller model, in a runner of its own, proposes
the drafts the target verifies.

References are independent of the proposer's bookkeeping: greedy tokens and logprobs of the
same target decoding without speculation; for the drafts themselves, the greedy continuation a
plain engine running the draft model generates from the request's whole sequence (a fresh
prefill, no cache carried over), which the proposer's incremental catch-up must equal; for sampled
drafts, the distribution the request's temperature, top-k and top-p make of the draft's logits.
"""

from __future__ import annotations

import types

import pytest
import torch

import kvgraph
from examples.engine import LLMEngine, SamplingParams
from examples.engine.draft_model import DraftModelProposer
from examples.engine.rejection_sampler import RejectionSampler
from examples.engine.sampler import Sampler
from examples.engine.tokenizer import ByteTokenizer
from tests.examples.engine.test_rejection_sampler import ALPHA, make, seeded
from tests.support import chi_square
from tests.support.engines import BLOCK_SIZE, MAX_MODEL_LEN
from tests.support.filtered_probs import filtered_probs
from tests.support.scenario import make_model
from tests.support.speculation import (DRAFT, GREEDY, K, PROMPTS, PROPOSERS, build, first_layers,
                                       tokens)

FULL_MODES = ("full", "full_decode_only", "full_and_piecewise")


def spec_stats(engine: LLMEngine) -> dict:
    return {k: v for k, v in engine.stats().items() if k.startswith("spec_decode_")}


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
@pytest.mark.parametrize("mode", ["eager", "none", "piecewise", *FULL_MODES])
def test_every_graph_mode_gives_the_tokens_and_both_runners_replay_graphs(kind, mode):
    expected = tokens(build(kind=kind, mode=mode).generate(PROMPTS[:2], GREEDY))
    speculating = build(DRAFT, kind=kind, mode=mode)
    assert tokens(speculating.generate(PROMPTS[:2], GREEDY)) == expected
    stats = speculating.stats()
    # The first-layer draft is right sometimes and wrong sometimes: both paths ran.
    assert 0 < stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]
    if mode in FULL_MODES:
        verify = [key for key in stats["runner"]["hits"] if f"query_len={K + 1}" in key]
        assert any(key.startswith("full:") for key in verify), stats["runner"]["hits"]
        # The draft's one-token steps replay its own full graphs.
        assert any(key.startswith("full:") and "uniform_decode=True" in key
                   for key in stats["draft_runner"]["hits"]), stats["draft_runner"]["hits"]
    assert sum(stats["draft_runner"]["hits"].values()) == stats["spec_decode_draft_model_steps"]


@pytest.mark.cuda
@pytest.mark.parametrize("proposer", list(PROPOSERS))
@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_speculation_on_cuda_gives_the_tokens_and_replays_verify_graphs(proposer, kind):
    """The device's contract: verify steps (and the draft's one-token steps) replay captured
    CUDA graphs of the device's attention backend, and greedy tokens are those without drafts
    (in the GPU's default graph mode; the others are the CPU tests')."""
    mode = "full_and_piecewise"
    expected = tokens(build(kind=kind, mode=mode, device="cuda").generate(PROMPTS[:2], GREEDY))
    speculating = build(PROPOSERS[proposer], kind=kind, mode=mode, device="cuda")
    assert tokens(speculating.generate(PROMPTS[:2], GREEDY)) == expected
    stats = speculating.stats()
    assert stats["spec_decode_accepted_tokens"] > 0
    verify = [key for key in stats["runner"]["hits"] if f"query_len={K + 1}" in key]
    assert any(key.startswith("full:") for key in verify), stats["runner"]["hits"]
    if proposer == "draft_model":
        assert any(key.startswith("full:") and "uniform_decode=True" in key
                   for key in stats["draft_runner"]["hits"]), stats["draft_runner"]["hits"]


@pytest.mark.parametrize("draft, accepted", [("target", "all"), ("unrelated", "none")])
def test_how_many_drafts_are_accepted_follows_the_draft_and_no_token_changes(draft, accepted):
    expected = tokens(build().generate(PROMPTS, GREEDY))
    model = make_model("llama", seed=1 if draft == "target" else 7)  # the target's seed is 1
    e = build(DRAFT, draft=model)
    assert tokens(e.generate(PROMPTS, GREEDY)) == expected
    stats = spec_stats(e)
    assert stats["spec_decode_draft_tokens"] > 0
    if accepted == "all":
        assert stats["spec_decode_accepted_tokens"] == stats["spec_decode_draft_tokens"]
        assert e.stats()["steps"] < sum(map(len, expected)) / 2
    else:
        assert stats["spec_decode_accepted_tokens"] == 0


def draft_reference(draft_kind: str, sequence: list[int], n: int) -> list[int]:
    """The draft model's greedy continuation of `sequence`, from a fresh plain engine."""
    config = kvgraph.CompilationConfig(graph_mode="eager")
    runner = kvgraph.ModelRunner(first_layers(draft_kind, 1), config,
                                 num_blocks=MAX_MODEL_LEN // BLOCK_SIZE * 2,
                                 block_size=BLOCK_SIZE, max_num_seqs=2,
                                 max_model_len=MAX_MODEL_LEN)
    engine = LLMEngine(runner, ByteTokenizer())
    (done,) = engine.generate([sequence], SamplingParams(max_tokens=n, temperature=0,
                                                         ignore_eos=True))
    engine.close()
    return list(done.token_ids)


def check_drafts_each_step(engine: LLMEngine, requests, kind: str) -> int:
    """Step `engine` to the end; after every step each request's drafts must be the draft
    model's greedy continuation of its tokens. How many drafts were checked."""
    checked = 0
    while engine.has_unfinished:
        engine.step()
        for r in requests:
            if r.spec_token_ids:
                want = draft_reference(kind, r.all_token_ids, len(r.spec_token_ids))
                assert r.spec_token_ids == want, (r.request_id, r.num_tokens)
                checked += len(want)
    return checked


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_drafts_are_the_draft_models_greedy_continuation_at_every_step(kind):
    """Catch-up after partly accepted drafts, all accepted ones and none runs exactly the
    tokens whose draft entries are missing or wrong."""
    e = build(DRAFT, kind=kind)
    requests = [e.add_request(p, GREEDY) for p in PROMPTS[:2]]
    assert check_drafts_each_step(e, requests, kind) > 20
    stats = spec_stats(e)
    assert 0 < stats["spec_decode_accepted_tokens"] < stats["spec_decode_draft_tokens"]


def test_drafts_stay_right_for_a_request_sharing_a_prefix_and_under_preemption():
    """A request admitted onto another's cached blocks reads the draft entries its computer's
    draft wrote; a preempted request's draft starts over in its new blocks."""
    e = build(DRAFT, num_blocks=24, budget=16)
    first = e.add_request(PROMPTS[0], GREEDY)
    while len(first.output_token_ids) < 6:
        e.step()
    second = e.add_request(first.all_token_ids[:-1] + [77, 78], GREEDY)
    others = [e.add_request(p, GREEDY) for p in PROMPTS[1:]]
    assert check_drafts_each_step(e, [first, second, *others], "llama") > 0
    assert e.stats()["prefix_cache_hit_tokens"] > 0
    assert e.stats()["preemptions"] > 0
    assert spec_stats(e)["spec_decode_draft_model_failures"] == 0


def test_logprobs_and_prompt_logprobs_equal_those_without_drafts():
    """The draft's steps between the target's never touch what the target's step returned."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)

    def run(spec):
        e = build(spec)
        requests = [e.add_request(p, params) for p in PROMPTS[:3]]
        outputs = []
        while e.has_unfinished:
            outputs += e.step()
        return requests, sorted(outputs, key=lambda o: o.request_id), e

    want_requests, want, _ = run(None)
    got_requests, got, e = run(DRAFT)
    assert spec_stats(e)["spec_decode_accepted_tokens"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(got, want):
        assert a.logprobs.token_id == b.logprobs.token_id
        assert a.logprobs.logprob == pytest.approx(b.logprobs.logprob, abs=1e-5)
        assert [t for t, _ in a.logprobs.top] == [t for t, _ in b.logprobs.top]
    for a, b in zip(got_requests, want_requests):
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) > 0
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs):
            assert (x is None) == (y is None)
            if x is not None:
                assert x.logprob == pytest.approx(y.logprob, abs=1e-5)


def test_a_failing_draft_step_costs_that_steps_drafts_only(caplog):
    expected = tokens(build().generate(PROMPTS, GREEDY))
    e = build(DRAFT)
    draft_runner = e.speculator.draft.runner
    execute, calls = draft_runner.execute, []

    def failing_once(chunks):
        calls.append(len(chunks))
        if len(calls) == 3:
            raise RuntimeError("draft step broke")
        return execute(chunks)

    draft_runner.execute = failing_once
    assert tokens(e.generate(PROMPTS, GREEDY)) == expected
    stats = spec_stats(e)
    assert stats["spec_decode_draft_model_failures"] == 1
    assert stats["spec_decode_accepted_tokens"] > 0  # drafting went on after the failure
    assert "the draft model's step failed" in caplog.text
    assert e.stats()["failed"] == 0


class FixedLogits:
    """A draft runner whose every step gives each chunk the same logits row (the proposer's
    sampling is what is tested, against those logits)."""

    def __init__(self, row: torch.Tensor, max_num_seqs: int):
        self.row = row
        self.limits = types.SimpleNamespace(max_num_tokens=1 << 16, max_num_seqs=max_num_seqs,
                                            block_size=BLOCK_SIZE)

    def execute(self, chunks):
        return self.row.expand(len(chunks), -1).clone()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.7),
                                    SamplingParams(temperature=1.2, top_k=5, top_p=0.8)],
                         ids=["temperature", "top-k and top-p"])
def test_sampled_drafts_follow_the_q_the_rejection_sampler_is_given(params):
    vocab, n = 8, 4000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    sampler = Sampler("cpu", seed=5)
    allocator = types.SimpleNamespace(is_shared=lambda block: False)
    proposer = DraftModelProposer(FixedLogits(row, n), RejectionSampler(sampler), allocator)
    requests = [make(params, name=f"r{i}") for i in range(n)]
    for r in requests:
        r.prompt_token_ids, r.block_ids = [1, 2, 3], [0]
    drafts = proposer.propose(requests, [2] * n)
    expected = filtered_probs(row, params)
    for r, ids, q in zip(requests, drafts.token_ids, drafts.probs):
        assert len(ids) == 2 and q.shape == (2, vocab)
        torch.testing.assert_close(q.double(), expected.expand(2, -1), atol=1e-6, rtol=1e-5)
    counts = torch.bincount(torch.tensor([ids[0] for ids in drafts.token_ids]),
                            minlength=vocab).tolist()
    stat, df = chi_square.statistic([(counts, expected.tolist())])
    assert chi_square.p_value(stat, df) > ALPHA
    # A seeded request's drafts are drawn from its own generator: the same in any batch.
    one = seeded([params], [9])
    many = seeded([params] * 3, [4, 9, 6])
    for r in one + many:
        r.prompt_token_ids, r.block_ids = [1, 2, 3], [0]
    alone = proposer.propose(one, [2]).token_ids[0]
    assert proposer.propose(many, [2] * 3).token_ids[1] == alone


def test_greedy_requests_get_the_argmax_and_no_q():
    row = torch.tensor([0.1, 2.0, -1.0, 0.5])
    allocator = types.SimpleNamespace(is_shared=lambda block: False)
    proposer = DraftModelProposer(FixedLogits(row, 4), RejectionSampler(Sampler("cpu")),
                                  allocator)
    request = make(GREEDY)
    request.block_ids = [0]
    drafts = proposer.propose([request], [3])
    assert drafts.token_ids == [[1, 1, 1]] and drafts.probs == [None]


@pytest.mark.parametrize("change, message", [
    ({"vocab": 128}, "vocab_size=128"),
    ({"block_size": 8}, "block_size=8"),
    ({"num_blocks": 4}, "num_blocks=4"),
    ({"max_num_seqs": 1}, "max_num_seqs=1"),
])
def test_a_draft_runner_that_cannot_serve_the_target_is_refused(change, message):
    target_engine = build()
    limits = target_engine.runner.limits
    model = make_model("llama", seed=2)
    if "vocab" in change:
        from examples.models import Llama

        model = Llama.from_hf({**Llama.presets["tiny"], "vocab_size": change["vocab"]})
    draft = kvgraph.ModelRunner(
        model, kvgraph.CompilationConfig(graph_mode="eager"),
        num_blocks=change.get("num_blocks", limits.num_blocks),
        block_size=change.get("block_size", limits.block_size),
        max_num_seqs=change.get("max_num_seqs", limits.max_num_seqs),
        max_model_len=limits.max_model_len)
    with pytest.raises(ValueError, match=message):
        LLMEngine(target_engine.runner, ByteTokenizer(), speculative_config=DRAFT,
                  draft_runner=draft)


def test_the_draft_model_method_needs_a_draft_runner_and_a_runner_of_its_own():
    e = build()
    with pytest.raises(ValueError, match="needs the draft model's runner"):
        LLMEngine(e.runner, ByteTokenizer(), speculative_config=DRAFT)
    with pytest.raises(ValueError, match="runner of its own|the target's"):
        LLMEngine(e.runner, ByteTokenizer(), speculative_config=DRAFT, draft_runner=e.runner)
