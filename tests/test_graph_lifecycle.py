"""Graphs are captured only in capture(), belong to their runner, and report their memory.

On CUDA and NPU a capture records kernels without running them; the CPU graph poisons what a
capture returns, so a runner that captured on live data would produce NaN here as well.
"""

import gc
import logging
import weakref

import pytest
import torch

import kvgraph
from kvgraph import CompilationConfig, GraphMode
from kvgraph.attention.batch import host_batch
from kvgraph.compilation.counters import compile_counters, graph_counters
from tests.scenario import (
    BLOCK_SIZE, NUM_BLOCKS, TOLERANCE, assert_matches_eager, generate, make_model, make_runner,
)

GRAPH_MODES = ["piecewise", "full", "full_decode_only", "full_and_piecewise"]

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def eager_generation(kind="llama", device="cpu"):
    eager = make_runner(kind, "eager", device)
    return generate(eager, eager.model.config.vocab_size)


def assert_same_generation(runner, expected):
    expected_logits, expected_tokens = expected
    logits, tokens = generate(runner, runner.model.config.vocab_size)
    assert tokens == expected_tokens
    for step, (got, want) in enumerate(zip(logits, expected_logits)):
        torch.testing.assert_close(got, want, **TOLERANCE, msg=f"step {step}")


@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_execute_before_capture_runs_without_graphs_and_equals_eager(mode, caplog):
    expected = eager_generation()
    runner = make_runner("llama", mode)
    with caplog.at_level(logging.INFO, logger="kvgraph.runtime.dispatcher"):
        assert_same_generation(runner, expected)
    stats = runner.stats()
    assert stats["graphs"]["captures"] == 0 and graph_counters.captures == 0
    assert {key.split(":")[0] for key in stats["hits"]} == {"none"}
    assert stats["uncaptured"] > 0
    assert caplog.text.count("none was captured") == 1, "logged once"
    runner.capture()  # and capturing afterwards still works
    assert runner.stats()["graphs"]["captures"] > 0


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_graph_wrappers_outside_the_capture_phase_run_without_capturing(mode):
    """Below the dispatcher: a step run in a graph mode, whose descriptor has no graph."""
    chunks = [kvgraph.RequestChunk([3, 1, 4], 0, [2]), kvgraph.RequestChunk([5], 0, [7])]
    expected = make_runner("llama", "eager").execute(chunks)
    runner = make_runner("llama", "full" if mode == "full" else "piecewise",
                         attn_backend="test_always")
    batch = host_batch(chunks, BLOCK_SIZE)
    hidden = runner._run(runner.dispatcher.plan_for(batch, GraphMode(mode),
                                                    kvgraph.BatchDescriptor(4)))
    logits = runner.model.compute_logits(hidden[torch.tensor([2, 3])])
    torch.testing.assert_close(logits, expected, **TOLERANCE)
    assert not runner.graphs.entries


def test_each_runner_owns_its_graphs_and_dropping_it_frees_them():
    expected = eager_generation()
    first, second = make_runner("llama", "full_and_piecewise"), make_runner("llama", "piecewise")
    first.capture()
    second.capture()
    graphs = [weakref.ref(entry.graph) for entry in first.graphs.entries.values()]
    assert graphs and not set(first.graphs.entries) & set(second.graphs.entries)
    del first
    gc.collect()
    assert all(graph() is None for graph in graphs), "a dropped runner's graphs are still alive"
    assert_same_generation(second, expected)
    assert second.stats()["graphs"]["replays"] > 0


def test_close_frees_the_graphs_and_later_steps_run_without_them():
    expected = eager_generation()
    runner = make_runner("llama", "full_and_piecewise")
    runner.capture()
    graphs = [weakref.ref(entry.graph) for entry in runner.graphs.entries.values()]
    runner.close()
    gc.collect()
    assert all(graph() is None for graph in graphs)
    assert_same_generation(runner, expected)
    stats = runner.stats()
    assert stats["graphs"]["captures"] == 0 and stats["graphs"]["graph_bytes"] == 0
    assert stats["uncaptured"] > 0


def test_more_runners_than_dynamos_recompile_limit_each_compile():
    """Dynamo caches per code object, 8 entries at most: each runner compiles its own copy."""
    chunks = [kvgraph.RequestChunk([3, 1, 4], 0, [2])]
    eager = make_runner("llama", "eager")
    expected = eager.execute(chunks)
    for i in range(10):
        runner = make_runner("llama", "none")
        torch.testing.assert_close(runner.execute(chunks), expected, **TOLERANCE)
        assert compile_counters.dynamo_graphs == i + 1, f"runner {i} was not compiled"
        del runner


def sized_runner(capture_sizes):
    config = CompilationConfig(graph_mode="full_and_piecewise", piece_compiler="eager",
                               capture_sizes=capture_sizes)
    return kvgraph.ModelRunner(make_model("llama"), config, num_blocks=NUM_BLOCKS,
                               block_size=BLOCK_SIZE, max_num_tokens=32, max_num_seqs=8)


def test_graph_memory_is_reported_per_descriptor_and_grows_with_capture_sizes():
    small, large = sized_runner((1, 2)), sized_runner((1, 2, 4, 8, 16))
    summaries = [small.capture(), large.capture()]
    for summary in summaries:
        by_descriptor = summary["bytes_by_descriptor"]
        assert all(size >= 0 for size in by_descriptor.values())
        assert sum(by_descriptor.values()) == summary["bytes"] > 0
    assert summaries[1]["bytes"] > summaries[0]["bytes"]
    by_descriptor = summaries[1]["bytes_by_descriptor"]
    assert (by_descriptor["piecewise:BatchDescriptor(num_tokens=16, num_reqs=None, "
                          "uniform_decode=False)"]
            > by_descriptor["piecewise:BatchDescriptor(num_tokens=1, num_reqs=None, "
                            "uniform_decode=False)"] > 0)
    stats = large.stats()["graphs"]
    assert stats["graph_bytes"] == summaries[1]["bytes"]
    assert stats["bytes_by_descriptor"] == by_descriptor


def test_no_splitting_ops_captures_the_whole_forward_per_descriptor(caplog):
    expected = eager_generation()
    with caplog.at_level(logging.WARNING):
        runner = make_runner("llama", "piecewise", splitting_ops=())
    # torch_native captures attention for uniform decode only: full graphs for those batches.
    assert runner.config.graph_mode is GraphMode.FULL_DECODE_ONLY
    assert "runs as 'full'" in caplog.text and "'full_decode_only'" in caplog.text
    assert runner.capture()["graphs"] > 0
    assert_same_generation(runner, expected)
    assert any(key.startswith("full:") for key in runner.stats()["hits"])


def test_no_splitting_ops_with_a_backend_that_captures_every_batch():
    expected = eager_generation()
    config = CompilationConfig(graph_mode="piecewise", splitting_ops=(), piece_compiler="eager",
                               capture_sizes=(1, 2, 4, 8, 16))
    runner = kvgraph.ModelRunner(make_model("llama"), config, num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK_SIZE, max_num_tokens=32, max_num_seqs=8,
                                 attn_backend="test_always")
    assert runner.config.graph_mode is GraphMode.FULL
    assert runner.capture()["graphs"] > 0
    assert_same_generation(runner, expected)
    assert any(key.startswith("full:") and "uniform_decode=False" in key
               for key in runner.stats()["hits"])


@pytest.mark.cuda
def test_runners_built_captured_run_and_dropped_three_times_on_cuda():
    expected = eager_generation(device="cuda")
    reserved = []
    for _ in range(3):
        runner = make_runner("llama", "full_and_piecewise", device="cuda")
        summary = runner.capture()
        assert summary["bytes"] > 0 and all(b >= 0 for b in summary["bytes_by_descriptor"].values())
        assert_same_generation(runner, expected)
        del runner
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[2] <= reserved[0] + 2**20, f"memory kept by dropped runners: {reserved}"


@pytest.mark.cuda
@pytest.mark.parametrize("mode", GRAPH_MODES)
def test_execute_before_capture_equals_eager_on_cuda(mode):
    expected = eager_generation(device="cuda")
    runner = make_runner("llama", mode, device="cuda")
    assert_same_generation(runner, expected)
    assert runner.stats()["graphs"]["captures"] == 0


@pytest.mark.cuda
def test_cuda_runner_matches_eager_without_an_index_or_with_one():
    for device in ("cuda", f"cuda:{torch.cuda.current_device()}"):
        runner = assert_matches_eager("llama", "full_and_piecewise", device=device)
        assert runner.device == torch.device("cuda", torch.cuda.current_device())
