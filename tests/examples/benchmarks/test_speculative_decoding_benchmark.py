"""The speculative decoding benchmark (examples/benchmarks/speculative_decoding.py), tiny and
eager, n-gram and with a draft model: every row measured and the same greedy tokens with
speculation as without, never how fast (a smoke test; the speed is the benchmark's claim)."""

import json
import math

import pytest

from examples.benchmarks import speculative_decoding
from tests.support.measured import assert_measured

pytestmark = pytest.mark.slow  # builds two engines, decodes 32 candidate prompts to pick

TIMINGS = ("plain_tok_s", "spec_tok_s", "speedup", "host_ms_plain_decode",
           "execute_ms_plain_decode")
SPEC_TIMINGS = ("host_ms_spec_verify", "propose_ms_spec_verify", "execute_ms_spec_verify")
# The tiny Llama's first of its 2 layers drafts for it.
CONFIGS = {"ngram": None, "draft_model": {"method": "draft_model", "model": "llama:tiny:1",
                                          "num_speculative_tokens": 3}}


@pytest.fixture(scope="module")
def payloads(tmp_path_factory):
    """The benchmark's JSON for a method, run once per module."""
    done = {}

    def payload(method: str) -> dict:
        if method not in done:
            out = tmp_path_factory.mktemp(method) / "spec.json"
            config = CONFIGS[method]
            speculative_decoding.main(
                ["--preset", "tiny", "--graph-mode", "eager", "--piece-compiler", "eager",
                 "--rounds", "1", "--pool", "16", "--max-tokens", "32", "--json", str(out)]
                + (["--speculative-config", json.dumps(config)] if config else []))
            done[method] = json.loads(out.read_text())
        return done[method]

    return payload


@pytest.mark.parametrize("method", sorted(CONFIGS))
def test_every_row_is_measured_and_the_tokens_are_those_without_speculation(payloads, method):
    payload = payloads(method)
    assert set(payload) >= {"machine", "args", "prompts", "results"}
    assert payload["args"]["speculative_config"]["method"] == method
    rows = payload["results"]
    assert {(r["workload"], r["batch"]) for r in rows} == {
        (w, b) for w in ("repeating", "non-repeating") for b in (1, 8)}
    assert all(r["tokens_identical"] for r in rows)
    assert_measured(r[key] for r in rows for key in TIMINGS)
    for row in rows:
        # Greedy loops in a random-weight model: both workloads get some n-gram drafts, and
        # a draft model proposes for every decoding request, so every row has verify steps.
        assert row["spec_verify_steps"] > 0
        assert_measured(row[key] for key in SPEC_TIMINGS)
        assert 0 <= row["acceptance"] <= 1 and math.isfinite(row["mean_accepted_length"])
    # The repeating prompts' outputs are the ones drafts cover most.
    coverage = {w: sum(p["coverage"]) for w, p in payload["prompts"].items()}
    assert coverage["repeating"] >= coverage["non-repeating"]


def test_a_draft_model_runs_on_the_ngram_prompts_and_its_runner_is_recorded(payloads):
    draft, ngram = payloads("draft_model"), payloads("ngram")
    # The n-gram replay picks the prompts either way: both methods run the same ones.
    assert draft["prompts"] == ngram["prompts"]
    assert draft["draft_runner"]["steps"] > 0 and draft["draft_runner"]["hits"]
    assert draft["draft_runner"]["failures"] == 0
    assert "draft_runner" not in ngram
    for row in draft["results"]:
        # A catch-up step and K - 1 decode steps a proposal: K steps in each verify step.
        assert row["draft_model_steps"] >= row["spec_verify_steps"]
        assert_measured([row["draft_execute_ms_spec_verify"]])
        # The draft model's steps are timed inside the proposing.
        assert row["draft_execute_ms_spec_verify"] <= row["propose_ms_spec_verify"]
    for row in ngram["results"]:
        assert row["draft_model_steps"] == 0
