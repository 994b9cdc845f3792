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
from kvgraph.compilation.counters import compile_counters
from kvgraph.runtime.graphs import graph_counters
from kvgraph.runtime.platforms.base import tensors_in
from tests.support.scenario import (
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


def test_a_wrapper_trusts_the_dispatch_and_a_graph_never_captured_is_an_error():
    """Below the dispatcher: graphs are replayed only for descriptors the GraphSet has, and
    captured only in its capture phase; a wrapper never decides to run without its graph."""
    chunks = [kvgraph.RequestChunk([3, 1, 4], 0, [2]), kvgraph.RequestChunk([5], 0, [7])]
    runner = make_runner("llama", "piecewise")
    runner.compile()
    graphs, descriptor = runner._graphs, kvgraph.BatchDescriptor(4)
    step = runner._prepare(host_batch(chunks, BLOCK_SIZE), GraphMode.NONE, descriptor)
    assert not graphs.has(GraphMode.PIECEWISE, descriptor)
    with pytest.raises(kvgraph.GraphError, match="no graphs were captured for piecewise"):
        graphs.replay(GraphMode.PIECEWISE, descriptor, step.metadata, lambda: None)
    with pytest.raises(kvgraph.GraphError, match="only inside GraphSet.capture_phase"):
        graphs.capture(GraphMode.PIECEWISE, descriptor, step.metadata, lambda: None)
    with kvgraph.set_forward_context(step.metadata, descriptor, runner.attn_backend,
                                     GraphMode.PIECEWISE, graphs):
        with pytest.raises(kvgraph.GraphError, match="outside a replay"):
            runner._forward(step.input_ids, step.positions)
    assert not graphs.entries()


def test_each_runner_owns_its_graphs_and_dropping_it_frees_them():
    expected = eager_generation()
    first, second = make_runner("llama", "full_and_piecewise"), make_runner("llama", "piecewise")
    first.capture()
    second.capture()
    graphs = [weakref.ref(entry.graph) for entry in first._graphs.entries()]
    assert graphs and not {id(e.graph) for e in first._graphs.entries()} & {
        id(e.graph) for e in second._graphs.entries()}
    del first
    gc.collect()
    assert all(graph() is None for graph in graphs), "a dropped runner's graphs are still alive"
    assert_same_generation(second, expected)
    assert second.stats()["graphs"]["replays"] > 0


def test_close_frees_graphs_caches_and_the_model_and_the_runner_refuses_to_run():
    expected = eager_generation()
    model = make_model("llama")
    config = CompilationConfig(graph_mode="full_and_piecewise", piece_compiler="eager",
                               capture_sizes=(1, 2, 4, 8, 16))
    runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                 max_num_tokens=32, max_num_seqs=8)
    runner.capture()
    graphs = [weakref.ref(entry.graph) for entry in runner._graphs.entries()]
    caches = [weakref.ref(t) for cache in runner.kv_caches.values() for t in cache]
    runner.close()
    gc.collect()
    assert all(graph() is None for graph in graphs), "close() kept graphs alive"
    assert all(cache() is None for cache in caches), "close() kept the KV caches alive"
    assert all(layer.kv_cache == () for layer in kvgraph.attention_layers(model).values())
    assert runner.stats()["graphs"]["captures"] == 0
    with pytest.raises(kvgraph.RunnerError, match="was closed"):
        runner.execute([kvgraph.RequestChunk([1], 0, [0])])
    again = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                max_num_tokens=32, max_num_seqs=8)  # the model is free again
    again.capture()
    assert_same_generation(again, expected)


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


def test_graph_memory_is_shared_across_sizes_and_reported_per_descriptor():
    """A runner's graphs share one pool, as on a device: the largest size, captured first,
    holds the memory every smaller size reuses, so the total is the largest size's."""
    small, large = sized_runner((1, 2)), sized_runner((1, 2, 4, 8, 16))
    summaries = [small.capture(), large.capture()]
    for summary in summaries:
        by_descriptor = summary["bytes_by_descriptor"]
        assert all(size >= 0 for size in by_descriptor.values())
        assert sum(by_descriptor.values()) == summary["bytes"] > 0
    assert summaries[1]["bytes"] > summaries[0]["bytes"]
    by_descriptor = summaries[1]["bytes_by_descriptor"]
    largest = "piecewise:BatchDescriptor(num_tokens=16, num_reqs=None, uniform_decode=False)"
    full_8 = "full:BatchDescriptor(num_tokens=8, num_reqs=8, uniform_decode=True)"
    assert summaries[1]["bytes"] == by_descriptor[largest] + by_descriptor[full_8]
    assert all(size == 0 for key, size in by_descriptor.items() if key not in (largest, full_8))
    stats = large.stats()["graphs"]
    assert stats["graph_bytes"] == summaries[1]["bytes"]
    assert stats["bytes_by_descriptor"] == by_descriptor


def test_what_a_cpu_graph_keeps_alive_is_its_position_s_shared_memory():
    """The reference discipline: every size of one piece returns its outputs in the same
    memory of the pool, so replaying one size overwrites what another returned (as on a
    device), and the pool holds one buffer per piece output, not one per size."""
    runner = sized_runner((4, 8, 16))
    runner.capture()
    storages: dict[tuple[str, int], set[int]] = {}
    sizes: dict[str, int] = {}
    for entry in runner._graphs.entries():
        sizes[entry.graph.name] = sizes.get(entry.graph.name, 0) + 1
        for index, tensor in enumerate(tensors_in(entry.graph.outputs)):
            storages.setdefault((entry.graph.name, index), set()).add(
                tensor.untyped_storage().data_ptr())
    assert sizes["full"] == 2 and all(n == 3 for name, n in sizes.items() if name != "full")
    assert all(len(pointers) == 1 for pointers in storages.values()), storages
    pool = runner._graphs.pool
    assert set(pool.buffers) == set(storages)
    assert runner.stats()["graphs"]["graph_bytes"] == pool.nbytes
    runner.execute([kvgraph.RequestChunk(list(range(13)), 0, [0, 1, 2, 3])])  # 16-token graphs
    held = runner.hidden_states
    kept = held.clone()
    runner.execute([kvgraph.RequestChunk([5, 6, 7], 0, [9])])  # 3 tokens: the 4-token graphs
    assert not torch.equal(held, kept), "a replay of another size left this size's output as is"


def test_no_splitting_ops_captures_the_whole_forward_per_descriptor(caplog):
    expected = eager_generation()
    with caplog.at_level(logging.WARNING):
        runner = make_runner("llama", "piecewise", splitting_ops=(), attn_backend="torch_native")
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
