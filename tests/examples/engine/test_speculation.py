"""Speculative decoding in the example engine (issue 47): n-gram drafts proposed after each step
and verified by the target in the next.

References are independent of speculation: the same engine without it gives the greedy tokens
and their logprobs; the drafts, accepted tokens and verify steps are counted by the engine and
the runner.
"""

from __future__ import annotations

import argparse
import re
import types

import pytest

from examples.engine import FinishReason, SamplingParams
from examples.engine.engine_args import add_engine_args, compilation_config
from tests.support.speculation import GREEDY, K, NGRAM, PROMPTS, build, tokens


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_greedy_tokens_are_those_of_decoding_without_drafts(kind):
    expected = tokens(build(kind=kind).generate(PROMPTS, GREEDY))
    speculating = build(NGRAM, kind=kind)
    assert tokens(speculating.generate(PROMPTS, GREEDY)) == expected
    stats = speculating.stats()
    assert stats["spec_decode_drafts"] > 0
    assert 0 < stats["spec_decode_accepted_tokens"] <= stats["spec_decode_draft_tokens"]
    assert stats["spec_decode_mean_accepted_length"] == pytest.approx(
        1 + stats["spec_decode_accepted_tokens"] / stats["spec_decode_drafts"])
    # Fewer steps than tokens: accepted drafts came out several to a step.
    assert stats["steps"] < sum(map(len, expected))


def test_max_tokens_and_stop_tokens_cut_a_step_of_several_tokens():
    reference = build().generate(PROMPTS[:1], GREEDY)[0].token_ids
    for max_tokens in (1, 2, 5, 7):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        (got,) = build(NGRAM).generate(PROMPTS[:1], params)
        assert got.token_ids == reference[:max_tokens]
        assert got.finish_reason is FinishReason.LENGTH
    stop = reference[4]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    (got,) = build(NGRAM).generate(PROMPTS[:1], params)
    assert got.token_ids == reference[:reference.index(stop) + 1]
    assert got.finish_reason is FinishReason.STOP


def test_logprobs_of_accepted_tokens_equal_those_without_drafts():
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)

    def run(spec):
        e = build(spec)
        request = e.add_request(PROMPTS[0], params)
        outputs = []
        while e.has_unfinished:
            outputs += [o for o in e.step() if o.request_id == request.request_id]
        return outputs, e

    expected, _ = run(None)
    got, speculating = run(NGRAM)
    assert speculating.stats()["spec_decode_accepted_tokens"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for a, b in zip(got, expected):
        assert a.logprobs.token_id == b.logprobs.token_id
        assert a.logprobs.logprob == pytest.approx(b.logprobs.logprob, abs=1e-5)
        assert [t for t, _ in a.logprobs.top] == [t for t, _ in b.logprobs.top]


def test_preemption_and_a_tight_budget_keep_the_tokens():
    expected = tokens(build().generate(PROMPTS, GREEDY))
    tight = build(NGRAM, num_blocks=24, budget=8)
    assert tokens(tight.generate(PROMPTS, GREEDY)) == expected
    assert tight.stats()["preemptions"] > 0


def test_seeded_sampling_is_reproducible_and_penalised_requests_get_no_drafts():
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    alone = build(NGRAM).generate(PROMPTS[:1], seeded)[0].token_ids
    mixed = build(NGRAM).generate(
        PROMPTS, [seeded, GREEDY, GREEDY, GREEDY])[0].token_ids
    assert alone == mixed
    penalised = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                               repetition_penalty=1.3)
    e = build(NGRAM)
    assert tokens(e.generate(PROMPTS[:1], penalised)) == tokens(
        build().generate(PROMPTS[:1], penalised))
    assert e.stats()["spec_decode_drafts"] == 0


def test_metrics_count_drafts_and_accepted_tokens():
    from examples.engine.metrics import ServerMetrics

    e = build(NGRAM)
    e.generate(PROMPTS, GREEDY)
    text = ServerMetrics(types.SimpleNamespace(stats=e.stats())).render().decode()
    values = {name: float(value) for name, value in
              re.findall(r"^(kvgraph_spec_decode_\w+) (\S+)$", text, re.MULTILINE)}
    stats = e.stats()
    assert values == {"kvgraph_spec_decode_drafts_total": stats["spec_decode_drafts"],
                      "kvgraph_spec_decode_draft_tokens_total":
                          stats["spec_decode_draft_tokens"],
                      "kvgraph_spec_decode_accepted_tokens_total":
                          stats["spec_decode_accepted_tokens"]}
    assert values["kvgraph_spec_decode_accepted_tokens_total"] > 0


def test_the_flag_sets_the_runners_num_speculative_tokens_and_takes_a_draft_model(capsys):
    parser = add_engine_args(argparse.ArgumentParser())
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert args.speculative_config.num_speculative_tokens == 2
    assert compilation_config(args).num_speculative_tokens == 2
    assert compilation_config(parser.parse_args([])).num_speculative_tokens == 0
    args = parser.parse_args(["--speculative-config", '{"method": "draft_model", "model": '
                              '"llama:tiny:1", "num_speculative_tokens": 3}'])
    assert (args.speculative_config.method, args.speculative_config.model) == (
        "draft_model", "llama:tiny:1")
    assert compilation_config(args).num_speculative_tokens == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 0}'])
    assert "num_speculative_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
@pytest.mark.parametrize("mode", ["eager", "none", "piecewise", "full", "full_decode_only",
                                  "full_and_piecewise"])
def test_every_graph_mode_gives_the_tokens_and_verify_steps_replay_graphs(kind, mode):
    expected = tokens(build(kind=kind, mode=mode).generate(PROMPTS[:2], GREEDY))
    speculating = build(NGRAM, kind=kind, mode=mode)
    assert tokens(speculating.generate(PROMPTS[:2], GREEDY)) == expected
    hits = speculating.stats()["runner"]["hits"]
    verify = {key: n for key, n in hits.items() if f"query_len={K + 1}" in key}
    if mode in ("full", "full_decode_only", "full_and_piecewise"):
        assert any(key.startswith("full:") for key in verify), hits
