"""Speculative verify steps through a ModelRunner: captured as descriptors of 1 + K tokens a
request, replayed, and giving eager's logits for every position asked for, in every graph mode.

Token ids are fixed in advance (teacher forcing), so the graph runner and its eager reference
see identical batches whatever their logits.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvgraph
from kvgraph import BatchDescriptor, GraphMode
from kvgraph.attention.backends import GraphSupport, register_attention_backend
from kvgraph.attention.backends.torch_native import TorchNativeBackend
from tests.support.scenario import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    TOLERANCE,
    Request,
    make_model,
    make_runner,
)

ALL_MODES = ["eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
K = 2
Q = 1 + K
# Each step: (request, new tokens, num_logits). Verify chunks (Q tokens, logits of all Q) alone
# and in mixed steps, a decode step with no drafts, padding of requests (4 verify requests run
# as 6), and verify chunks asking fewer logits.
SCHEDULE = [
    [(0, 7, 1), (1, 3, 1)],
    [(0, Q, Q), (1, 5, 1), (2, 13, 1)],
    [(0, Q, Q), (1, Q, Q), (2, Q, Q)],
    [(0, 1, 1), (1, 1, 1), (2, 1, 1)],
    [(0, Q, Q), (1, Q, Q), (2, Q, Q), (3, 2, 1)],
    [(3, Q, Q)],
    [(0, Q, Q), (1, Q, Q), (2, Q, Q), (3, Q, Q)],
    [(3, Q, 2), (0, Q, 1)],
]
VERIFY_KEYS = [BatchDescriptor(9, 3, True, Q), BatchDescriptor(3, 1, True, Q),
               BatchDescriptor(18, 6, True, Q)]


def run(runner, schedule=SCHEDULE, seed: int = 0) -> list[torch.Tensor]:
    """Every step of `schedule` through `runner.execute`; each step's logits (cloned: they must
    be fresh tensors, so later steps must not change them, which the caller checks)."""
    rng = random.Random(seed)
    lengths: dict[int, int] = {}
    for step in schedule:
        for req, n, _ in step:
            lengths[req] = lengths.get(req, 0) + n
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    vocab = runner.model.config.vocab_size
    requests = {req: Request([rng.randrange(vocab) for _ in range(n)],
                             [free.pop() for _ in range(-(-n // BLOCK_SIZE))])
                for req, n in sorted(lengths.items())}
    results = []
    for step in schedule:
        chunks = []
        for req, n, num_logits in step:
            r = requests[req]
            chunks.append(kvgraph.RequestChunk(r.token_ids[r.num_computed:r.num_computed + n],
                                               r.num_computed, r.block_ids, num_logits))
            r.num_computed += n
        logits = runner.execute(chunks)
        assert logits.shape == (sum(c.num_logits for c in chunks), vocab)
        results.append((logits, logits.clone()))
    for logits, copy in results:  # a later replay overwrote no step's logits
        torch.testing.assert_close(logits, copy, rtol=0, atol=0)
    return [logits for logits, _ in results]


def assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for step, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, **TOLERANCE, msg=f"step {step}")


@pytest.fixture(scope="module")
def eager_logits():
    """Each model's eager logits on SCHEDULE, without speculation: the reference."""
    return {kind: run(make_runner(kind, "eager")) for kind in ("llama", "deepseek_mla")}


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
@pytest.mark.parametrize("mode", ALL_MODES)
def test_verify_steps_give_eager_logits_and_replay_verify_graphs(kind, mode, eager_logits):
    runner = make_runner(kind, mode, num_speculative_tokens=K)
    assert runner.config.capture_size_list == (3, 6, 9, 18)
    runner.capture()
    assert_same(run(runner), eager_logits[kind])
    hits = runner.stats()["hits"]
    mode = GraphMode(mode)
    for key in VERIFY_KEYS:
        if mode.has_full_graphs:
            assert hits.get(f"full:{key}") == 1, hits
        elif mode.has_piecewise_graphs:  # as any batch of its size
            assert hits.get(f"piecewise:{BatchDescriptor(key.num_tokens)}", 0) >= 1, hits
    if mode.has_full_graphs:  # the step with no drafts ran on a decode graph
        assert hits.get(f"full:{BatchDescriptor(3, 3, True)}") == 1, hits
    if mode.has_graphs:
        assert runner.stats()["graphs"]["replays"] > 0


def test_a_verify_step_replays_its_one_full_graph_padded_to_whole_requests():
    runner = make_runner("llama", "full_and_piecewise", num_speculative_tokens=K)
    runner.capture()
    chunks = [kvgraph.RequestChunk([5] * Q, 4, [10 + 2 * i, 11 + 2 * i], Q) for i in range(4)]
    step = runner.prepare_step(chunks)
    assert (step.plan.runtime_mode, step.plan.descriptor) == (GraphMode.FULL, VERIFY_KEYS[2])
    # Two padded requests of Q padding tokens each, with no key.
    assert step.metadata.query_start_loc.tolist() == [0, 3, 6, 9, 12, 15, 18]
    assert step.metadata.seq_lens.tolist() == [7, 7, 7, 7, 0, 0]
    assert step.logits_indices.tolist() == list(range(12))
    replays = runner.stats()["graphs"]["replays"]
    runner.execute(chunks)
    assert runner.stats()["graphs"]["replays"] == replays + 1


def test_one_logit_per_chunk_is_the_shape_it_always_was():
    runner = make_runner("llama", "eager")
    chunks = [kvgraph.RequestChunk([1, 2, 3], 0, [1]), kvgraph.RequestChunk([4], 0, [2])]
    assert runner.execute(chunks).shape == (2, runner.model.config.vocab_size)


@pytest.mark.parametrize("mode", ["full_decode_only", "full_and_piecewise"])
def test_torch_native_runs_verify_steps_in_device_full_graphs_with_frozen_lengths(mode):
    """torch_native's padded [num_reqs, max_query_len] layout with max_query_len frozen at
    1 + K, as a device graph freezes it (emulated on the CPU graph), against its own eager."""
    reference = run(make_runner("llama", "eager", attn_backend="torch_native"))
    runner = make_runner("llama", mode, attn_backend="torch_native", num_speculative_tokens=K)
    runner._freezes_shapes = True  # what a device platform says
    runner.capture()
    assert_same(run(runner), reference)
    hits = runner.stats()["hits"]
    assert all(hits.get(f"full:{key}") == 1 for key in VERIFY_KEYS), hits
    step = runner.prepare_step([kvgraph.RequestChunk([1] * Q, 4, [3, 4], Q)])
    assert (step.plan.descriptor, step.plan.max_query_len) == (VERIFY_KEYS[1], Q)
    assert step.plan.max_seq_len == runner.limits.max_model_len


class DecodeOnlyBackend(TorchNativeBackend):
    """Torch-native math declared to hold one-token requests only in full graphs."""

    name = "test_uniform_decode_only"
    graph_support = GraphSupport.UNIFORM_DECODE


register_attention_backend(DecodeOnlyBackend)


@pytest.mark.parametrize("mode, verify_mode", [("full_decode_only", "none"),
                                               ("full_and_piecewise", "piecewise")])
def test_a_uniform_decode_backend_runs_verify_steps_outside_full_graphs(mode, verify_mode):
    reference = run(make_runner("llama", "eager", attn_backend="torch_native"))
    runner = make_runner("llama", mode, attn_backend=DecodeOnlyBackend.name,
                         num_speculative_tokens=K)
    assert runner.config.graph_mode.value == mode
    runner.capture()
    assert_same(run(runner), reference)
    hits = runner.stats()["hits"]
    assert not any("query_len" in key for key in hits), hits
    assert hits.get(f"{verify_mode}:{BatchDescriptor(9)}") == 1, hits
    assert hits.get(f"full:{BatchDescriptor(3, 3, True)}") == 1, hits


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_default_capture_sizes_with_speculation_stay_bounded_in_size_and_memory(mode):
    """Rounding to whole verify steps never grows the default list's largest size, so the
    pool, sized by each graph's largest capture, never grows either (`full` captures mixed
    full graphs of every size, so verify graphs fit under its largest)."""
    def captured(k: int):
        config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager",
                                           num_speculative_tokens=k)
        runner = kvgraph.ModelRunner(make_model("llama"), config, num_blocks=NUM_BLOCKS,
                                     block_size=BLOCK_SIZE, max_num_tokens=64, max_num_seqs=16)
        summary = runner.capture()
        sizes = runner.config.capture_size_list
        runner.close()
        return sizes, summary

    plain_sizes, plain = captured(0)
    sizes, summary = captured(K)
    assert max(plain_sizes) == 64 and max(sizes) == 63
    assert not summary["failed"] and summary["descriptors"] > 0
    assert summary["bytes"] <= plain["bytes"], (summary["bytes"], plain["bytes"])


@pytest.mark.usefixtures("fresh_compile_state")
def test_triton_runs_verify_steps_in_device_full_graphs():
    """Triton's kernels in a full graph of one verify key, max_query_len frozen at 1 + K as a
    device freezes it (under Triton's interpreter on the CPU), against torch_native eager."""
    pytest.importorskip("triton")
    schedule = SCHEDULE[:4]  # prompts, a mixed step, three verify requests, a decode step
    reference = run(make_runner("llama", "eager", attn_backend="torch_native"), schedule)
    config = kvgraph.CompilationConfig(graph_mode="full_decode_only", piece_compiler="eager",
                                       capture_sizes=(9,), num_speculative_tokens=K,
                                       check_graph_inputs=True)
    runner = kvgraph.ModelRunner(make_model("llama"), config, num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK_SIZE, max_num_tokens=32, max_num_seqs=8,
                                 attn_backend="triton")
    runner._freezes_shapes = True  # what a device platform says
    assert runner.capture()["descriptors"] == 1
    assert_same(run(runner, schedule), reference)
    assert runner.stats()["hits"].get(f"full:{VERIFY_KEYS[0]}") == 1
