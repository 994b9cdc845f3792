"""ModelRunner in every graph mode: same tokens, logits and caches as eager; padding; capture."""

import logging

import pytest
import torch

import kvgraph
from kvgraph import CompilationConfig, GraphMode
from kvgraph.attention.backends.torch_native import TorchNativeBackend
from kvgraph.runtime.graphs import graph_counters
from tests.support.scenario import (
    BLOCK_SIZE, CAPTURE_SIZES, NUM_BLOCKS, TOLERANCE, assert_matches_eager, generate, make_model,
    make_runner,
)

MODES = ["eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_generates_what_eager_does(kind, mode):
    runner = assert_matches_eager(kind, mode)
    stats = runner.stats()
    graph_modes = {key.split(":")[0] for key in stats["hits"]}
    if mode in ("eager", "none"):
        # Steps of the model as written say so; compiled steps without a graph say "none".
        assert graph_modes == {mode} and stats["graphs"]["captures"] == 0
    else:
        assert stats["graphs"]["replays"] > 0
        assert stats["fallbacks"] == 2  # the 19- and 21-token steps are above the largest size
        assert "full" in graph_modes or mode == "piecewise"


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
@pytest.mark.parametrize("mode", MODES)
def test_every_mode_generates_what_eager_does_on_cuda(kind, mode):
    assert_matches_eager(kind, mode, device="cuda")


@pytest.mark.slow
def test_piecewise_and_full_graphs_with_inductor_pieces(compile_cache_dir):
    for mode in ("piecewise", "full_and_piecewise"):
        torch._dynamo.reset()
        assert_matches_eager("llama", mode, piece_compiler="inductor", cache_dir=compile_cache_dir)


def test_full_mode_is_downgraded_with_a_warning_naming_mode_backend_and_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="kvgraph.runtime.dispatcher"):
        # torch_native captures uniform batches only (the CPU default, cpu_paged, captures all).
        runner = make_runner("llama", "full", attn_backend="torch_native")
    assert runner.config.graph_mode is GraphMode.FULL_AND_PIECEWISE
    assert "'full' downgraded to 'full_and_piecewise'" in caplog.text
    assert "'torch_native'" in caplog.text and "uniform-decode" in caplog.text


def test_full_graphs_for_mixed_batches_with_a_backend_that_supports_them():
    eager = make_runner("llama", "eager")
    expected, expected_tokens = generate(eager, eager.model.config.vocab_size)
    model = make_model("llama")
    config = CompilationConfig(graph_mode="full", piece_compiler="eager",
                               capture_sizes=CAPTURE_SIZES, check_graph_inputs=True)
    runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                 max_num_tokens=32, max_num_seqs=8, attn_backend="test_always")
    assert runner.config.graph_mode is GraphMode.FULL
    runner.capture()
    logits, tokens = generate(runner, model.config.vocab_size)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected, **TOLERANCE)
    assert any(key.startswith("full:") and "uniform_decode=False" in key
               for key in runner.stats()["hits"])


def test_capture_happens_once_per_descriptor_and_the_stats_add_up():
    runner = make_runner("llama", "full_and_piecewise")
    first = runner.capture()
    pieces = len(runner.model.model.layers) + 1
    decode_sizes = [s for s in CAPTURE_SIZES if s <= 8]
    assert first["graphs"] == pieces * len(CAPTURE_SIZES) + len(decode_sizes)
    assert runner.capture()["graphs"] == 0
    before = graph_counters.captures
    generate(runner, runner.model.config.vocab_size)
    assert graph_counters.captures == before, "execute captured a graph capture() had"
    stats = runner.stats()
    full_steps = sum(n for key, n in stats["hits"].items() if key.startswith("full:"))
    piecewise_steps = sum(n for key, n in stats["hits"].items() if key.startswith("piecewise:"))
    assert stats["graphs"]["replays"] == full_steps + piecewise_steps * pieces
    assert stats["graphs"]["captures"] == first["graphs"]


def test_padding_writes_nothing_and_padded_requests_are_never_nan():
    runner = make_runner("llama", "full_and_piecewise")
    runner.capture()
    # Poison every cache slot that no request owns: stale NaNs, as a freed block would hold.
    for cache in runner.kv_caches.values():
        for tensor in cache:
            tensor.fill_(float("nan"))
    blocks = [[5, 9], [17, 3], [40, 41]]
    chunks = [kvgraph.RequestChunk([1, 2, 3], 0, b) for b in blocks]  # 9 tokens -> padded to 16
    runner.execute(chunks)
    decode = [kvgraph.RequestChunk([4], 3, b) for b in blocks]  # 3 requests -> padded to 4
    logits = runner.execute(decode)
    assert torch.isfinite(logits).all()
    assert torch.isfinite(runner.hidden_states).all(), "a padded token or request produced NaN"
    assert runner.hidden_states.shape[0] == 4
    owned = {(b[pos // BLOCK_SIZE], pos % BLOCK_SIZE) for b in blocks for pos in range(4)}
    for cache in runner.kv_caches.values():
        for tensor in cache:
            written = {(blk, slot) for blk in range(NUM_BLOCKS) for slot in range(BLOCK_SIZE)
                       if not torch.isnan(tensor[blk, slot]).any()}
            assert written == owned, "padding wrote into the cache"


def test_returned_logits_survive_the_next_replay():
    runner = make_runner("llama", "full_and_piecewise")
    runner.capture()
    blocks = [[1], [2]]
    first = runner.execute([kvgraph.RequestChunk([5], 0, b) for b in blocks])
    kept = first.clone()
    runner.execute([kvgraph.RequestChunk([7], 0, b) for b in blocks[::-1]])
    assert torch.equal(first, kept)


def test_batches_the_buffers_cannot_hold_are_rejected():
    runner = make_runner("llama", "piecewise")
    with pytest.raises(kvgraph.BatchError, match="33 tokens, more than max_num_tokens=32"):
        runner.execute([kvgraph.RequestChunk([1] * 33, 0, list(range(9)))])
    with pytest.raises(kvgraph.BatchError, match="9 requests, more than max_num_seqs=8"):
        runner.execute([kvgraph.RequestChunk([1], 0, [i]) for i in range(9)])
    with pytest.raises(kvgraph.BatchError, match=f"more than num_blocks={NUM_BLOCKS}"):
        runner.execute([kvgraph.RequestChunk([1], 0, [NUM_BLOCKS])])


def test_graph_inputs_that_move_are_caught_in_debug_mode():
    runner = make_runner("llama", "piecewise")
    runner.capture()
    runner._buffers.input_ids = runner._buffers.input_ids.clone()  # a reallocated buffer
    with pytest.raises(kvgraph.errors.GraphError, match="not at the addresses"):
        runner.execute([kvgraph.RequestChunk([1, 2], 0, [0])])


def test_an_attention_backend_on_a_device_it_does_not_run_on_is_a_clear_error():
    class CUDAOnlyBackend(TorchNativeBackend):
        name = "test_cuda_only"
        device_types = ("cuda",)

    kvgraph.attention.backends.register_attention_backend(CUDAOnlyBackend)
    with pytest.raises(ValueError, match="'test_cuda_only' runs on cuda, not on cpu"):
        make_runner("llama", "piecewise", attn_backend="test_cuda_only")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        make_runner("llama", "piecewise", attn_backend="nope")


def test_cpu_full_graphs_read_only_a_batch_s_own_keys():
    # A CPU graph reruns Python on replay, so nothing freezes max_seq_len at max_model_len.
    runner = make_runner("llama", "full_and_piecewise")
    runner.capture()
    plan = runner.prepare_step([kvgraph.RequestChunk([1], 5, [3, 4])] * 1).plan
    assert plan.runtime_mode is GraphMode.FULL and plan.descriptor.uniform_decode
    assert (plan.padded_reqs, plan.max_query_len, plan.max_seq_len) == (1, 1, 6)


@pytest.mark.parametrize("mode, backend", [("full_and_piecewise", None), ("full", "test_always")])
def test_the_device_graphs_frozen_shapes_still_generate_what_eager_does(mode, backend):
    """Device graphs freeze attention's host ints at their largest; emulated on the CPU."""
    eager = make_runner("llama", "eager")
    expected, expected_tokens = generate(eager, eager.model.config.vocab_size)
    runner = make_runner("llama", mode, attn_backend=backend)
    runner._freezes_shapes = True  # what a device platform says
    runner.capture()
    logits, tokens = generate(runner, runner.model.config.vocab_size)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected, **TOLERANCE)
    plan = runner.prepare_step([kvgraph.RequestChunk([1], 5, [3, 4])]).plan
    assert plan.max_seq_len == runner.limits.max_model_len


def test_every_step_input_is_a_view_of_one_buffer_that_never_moves():
    # One buffer means one host-to-device copy a step on a device; it never moves, so graphs
    # captured on it stay valid.
    runner = make_runner("llama", "piecewise")
    storage = runner._buffers.device_bytes.untyped_storage().data_ptr()
    for chunks in ([kvgraph.RequestChunk([1, 2, 3], 0, [5])],
                   [kvgraph.RequestChunk([4], 3, [5]), kvgraph.RequestChunk([5] * 6, 0, [7, 8])]):
        step = runner.prepare_step(chunks)
        input_ids, positions, metadata = step.input_ids, step.positions, step.metadata
        tensors = [input_ids, positions, metadata.slot_mapping, metadata.block_table,
                   metadata.seq_lens, metadata.query_start_loc]
        assert {t.untyped_storage().data_ptr() for t in tensors} == {storage}
    assert positions.tolist()[:7] == [3, 0, 1, 2, 3, 4, 5]


def test_models_of_one_class_with_different_float_attributes_keep_their_graphs_valid():
    """Dynamo remembers, per function (file, line, name), which values changed between
    compiles and makes such floats graph inputs, wrapped in a new tensor on every call: a graph
    would then read a stale address. Every runner's model is a copy of one function, so a
    second model whose eps differs must still trace its floats as constants."""
    results = []
    for eps in (1e-6, 1e-5, 1e-4):
        model = make_model("llama")
        for module in model.modules():
            if hasattr(module, "eps"):
                module.eps = eps
        config = CompilationConfig(graph_mode="piecewise", piece_compiler="eager",
                                   capture_sizes=CAPTURE_SIZES, check_graph_inputs=True)
        runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                     max_num_tokens=32, max_num_seqs=8)
        runner.capture()
        logits, _ = generate(runner, model.config.vocab_size)  # GraphError if an input moved
        results.append(logits)
    assert not torch.equal(results[0][0], results[2][0]), "eps must reach the computation"


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_two_runners_in_two_threads_compute_what_they_compute_one_after_the_other(mode):
    """Each step's context (metadata, descriptor, graphs) is per thread, so two runners stepping
    at once never see each other's batch."""
    import threading

    def runner_for(kind):
        runner = make_runner(kind, mode)
        runner.capture()
        return runner

    kinds = ("llama", "deepseek_mla")
    def logits_of(runner):
        return generate(runner, runner.model.config.vocab_size)[0]

    sequential = [logits_of(runner_for(kind)) for kind in kinds]
    runners = [runner_for(kind) for kind in kinds]
    results: dict[int, list] = {}

    def run(index):
        results[index] = logits_of(runners[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index, expected in enumerate(sequential):
        for got, want in zip(results[index], expected):
            assert torch.equal(got, want), kinds[index]
