"""The speculative decoding benchmark (examples/benchmarks/speculative_decoding.py), tiny and
eager: every row measured and the same greedy tokens with speculation as without, never how
fast (a smoke test; the speed is the benchmark's claim)."""

import json
import math

import pytest

from examples.benchmarks import speculative_decoding
from tests.support.measured import assert_measured

pytestmark = pytest.mark.slow  # builds two engines, decodes 32 candidate prompts to pick

TIMINGS = ("plain_tok_s", "spec_tok_s", "speedup", "host_ms_plain_decode",
           "execute_ms_plain_decode")
SPEC_TIMINGS = ("host_ms_spec_verify", "propose_ms_spec_verify", "execute_ms_spec_verify")


def test_every_row_is_measured_and_the_tokens_are_those_without_speculation(tmp_path):
    out = tmp_path / "spec.json"
    speculative_decoding.main(["--preset", "tiny", "--graph-mode", "eager", "--piece-compiler",
                               "eager", "--rounds", "1", "--pool", "16", "--max-tokens", "32",
                               "--json", str(out)])
    payload = json.loads(out.read_text())
    assert set(payload) >= {"machine", "args", "prompts", "results"}
    rows = payload["results"]
    assert {(r["workload"], r["batch"]) for r in rows} == {
        (w, b) for w in ("repeating", "non-repeating") for b in (1, 8)}
    assert all(r["tokens_identical"] for r in rows)
    assert_measured(r[key] for r in rows for key in TIMINGS)
    for row in rows:
        # Greedy loops in a random-weight model: both workloads get some drafts, so every
        # row has verify steps to time.
        assert row["spec_verify_steps"] > 0
        assert_measured(row[key] for key in SPEC_TIMINGS)
        assert 0 <= row["acceptance"] <= 1 and math.isfinite(row["mean_accepted_length"])
    # The repeating prompts' outputs are the ones drafts cover most.
    coverage = {w: sum(p["coverage"]) for w, p in payload["prompts"].items()}
    assert coverage["repeating"] >= coverage["non-repeating"]
