"""A capture that fails costs its descriptor its graph, never the runner: the failure is
logged, that descriptor's batches run without graphs, every other graph is captured and used.

The failure is real, not patched into kvgraph: an attention backend whose kernels cannot be
recorded at one batch size (as a kernel with a workspace too large for the graph pool), from
tests/support/capture_faults.py.
"""

import logging

import pytest
import torch

from tests.support.capture_faults import (FAILING_SIZE, CannotCaptureFourTokens,
                                          CannotCaptureFourTokensInAFullGraph)
from tests.support.scenario import CAPTURE_SIZES, TOLERANCE, generate, make_runner


@pytest.mark.usefixtures("fresh_compile_state", "allow_capture_failures")
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_failed_capture_runs_without_its_graph_and_the_rest_keep_working(mode, caplog):
    eager = make_runner("llama", "eager")
    expected, expected_tokens = generate(eager, eager.model.config.vocab_size)
    runner = make_runner("llama", mode, attn_backend=CannotCaptureFourTokens.name)
    with caplog.at_level(logging.WARNING, logger="kvgraph"):
        summary = runner.capture()
    failed = [key for key in summary["failed"]]
    assert failed and all(f"num_tokens={FAILING_SIZE}," in key for key in failed), failed
    assert any("capturing" in r.getMessage() and "out of memory" in r.getMessage()
               for r in caplog.records)
    held = runner.stats()["graphs"]["bytes_by_descriptor"]
    assert not any(f"num_tokens={FAILING_SIZE}," in key for key in held), "nothing half-captured"
    decode_sizes = 4 if mode == "full_and_piecewise" else 0  # full decode graphs up to 8 reqs
    assert len(held) == len(CAPTURE_SIZES) + decode_sizes - len(failed) > 0

    logits, tokens = generate(runner, runner.model.config.vocab_size)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected, **TOLERANCE)
    stats = runner.stats()
    assert stats["uncaptured"] > 0, "the failed descriptor's batches ran without graphs"
    assert stats["graphs"]["replays"] > 0, "the other graphs are used"


@pytest.mark.usefixtures("fresh_compile_state", "allow_capture_failures")
def test_batches_of_a_failed_full_graph_use_the_same_size_s_piecewise_graphs():
    eager = make_runner("llama", "eager")
    expected, expected_tokens = generate(eager, eager.model.config.vocab_size)
    runner = make_runner("llama", "full_and_piecewise",
                         attn_backend=CannotCaptureFourTokensInAFullGraph.name)
    assert runner.capture()["failed"] == [
        f"full:BatchDescriptor(num_tokens={FAILING_SIZE}, num_reqs={FAILING_SIZE}, "
        f"uniform_decode=True)"]
    logits, tokens = generate(runner, runner.model.config.vocab_size)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected, **TOLERANCE)
    stats = runner.stats()
    assert stats["uncaptured"] == 0
    assert stats["hits"].get(f"piecewise:BatchDescriptor(num_tokens={FAILING_SIZE}, "
                             "num_reqs=None, uniform_decode=False)", 0) > 0
