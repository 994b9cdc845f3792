"""The `ascend` backend's MLA and encoder-only attention (kvgraph.attention.backends.ascend_mla),
run on the CPU against a stand-in of the torch_npu ops' documented behaviour
(tests/support/fake_npu_mla_ops.py): dense float64 references, the DeepSeek-style MLA model in every
graph mode against the torch-native reference, the documented limits, and the layouts and
host lengths each op is called with."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvgraph
from kvgraph.attention.backends import ascend_mla, register_attention_backend
from kvgraph.attention.backends.ascend import AscendBackend
from kvgraph.attention.backends.ascend_task_groups import CapturedCalls
from kvgraph.errors import GraphError
from kvgraph.runtime import platforms
from tests.support import fake_npu_graphs, fake_npu_mla_ops, fake_torch_npu
from tests.support.attention_reference import ref_mla
from tests.support.scenario import (BLOCK_SIZE, GENERATION, NUM_BLOCKS, generate, make_model,
                            make_runner)

MODEL = "deepseek_mla"
ALL_MODES = ["eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
NAN = float("nan")


class MLAOnCpu(AscendBackend):
    """The ascend backend let onto CPU tensors and the tiny model's shapes (the documented
    limits are tested on their own)."""

    name = "test_ascend_mla_cpu"
    device_types = None

    def check_block_size(self, block_size):
        pass

    def check_supported_mla(self, q_latent, q_pe, kv_c_cache):
        pass

    def check_supported_encoder(self, query):
        pass


register_attention_backend(MLAOnCpu)


@pytest.fixture
def fake_npu(monkeypatch):
    """torch_npu's stand-in with the MLA and encoder ops, and the NPU platform's graph contract
    on CPU tensors."""
    module = fake_npu_mla_ops.install(fake_torch_npu.install(monkeypatch))
    platform = fake_npu_graphs.NPUPlatformOnCpu(MLAOnCpu.name)
    monkeypatch.setitem(platforms._platforms, "cpu", platform)
    return module


def recorded(fake_npu, op_name):
    return [data for name, data in fake_npu.calls if name == op_name]


def padded(metadata, extra):
    """`metadata` with `extra` padding tokens (slot -1) after its requests."""
    slots = torch.cat([metadata.slot_mapping, torch.full((extra,), -1, dtype=torch.int64)])
    return dataclasses.replace(metadata, slot_mapping=slots, plan=None)


# --- against dense float64 references ---------------------------------------------------------


def test_mla_prefill_then_decode_matches_dense_attention(fake_npu):
    """A 20-token prefill (cut into 16 + 4 queries), a 5-token one, then a decode and a chunk,
    each step with padding; the caches start as NaN, so a read of an unwritten slot shows."""
    gen = torch.Generator().manual_seed(0)
    block_size, heads, rank, rope, scale, extra = 4, 4, 16, 8, 0.3, 3
    caches = [torch.full((12, block_size, dim), NAN, dtype=torch.float64) for dim in (rank, rope)]
    blocks = {0: [7, 2, 9, 0, 5, 11], 1: [3, 10]}
    kv_c = {r: torch.randn(21 if r == 0 else 8, rank, generator=gen, dtype=torch.float64)
            for r in blocks}
    k_pe = {r: torch.randn(kv_c[r].shape[0], rope, generator=gen, dtype=torch.float64)
            for r in blocks}
    backend = MLAOnCpu()
    for step in ([(0, 0, 20), (1, 0, 5)], [(0, 20, 1), (1, 5, 3)]):
        chunks = [kvgraph.RequestChunk([0] * n, done, blocks[r]) for r, done, n in step]
        metadata = padded(kvgraph.build_attention_metadata(chunks, block_size), extra)
        num_tokens = sum(n for _, _, n in step) + extra
        q_latent, q_pe = (torch.randn(num_tokens, heads, dim, generator=gen, dtype=torch.float64)
                          for dim in (rank, rope))
        new = [slice(done, done + n) for _, done, n in step]
        latents = torch.cat([*(kv_c[r][s] for (r, _, _), s in zip(step, new)),
                             torch.randn(extra, rank, dtype=torch.float64)])
        ropes = torch.cat([*(k_pe[r][s] for (r, _, _), s in zip(step, new)),
                           torch.randn(extra, rope, dtype=torch.float64)])
        out = torch.full_like(q_latent, NAN)
        backend.forward_mla(q_latent, q_pe, latents, ropes, caches, out, metadata, scale)
        start = 0
        for r, done, n in step:
            want = ref_mla(q_latent[start:start + n], q_pe[start:start + n],
                           kv_c[r][:done + n], k_pe[r][:done + n], done, scale)
            torch.testing.assert_close(out[start:start + n], want)
            start += n
        assert (out[start:] == 0).all()  # padding rows
    call = recorded(fake_npu, "npu_fused_infer_attention_score_v2")[0]
    # 20 queries cut at 16, the 5-token request, then the padding's dummy request.
    assert call["ends"] == [16, 20, 25, 28] and call["kv_lens"] == [16, 20, 5, 1]
    assert call["table_rows"] == 4 and call["key_shape"] == (12, 1, block_size, rank)
    assert call["input_layout"] == "TND" and call["sparse_mode"] == 3
    assert int((~caches[0].isnan()).all(-1).sum()) == 21 + 8  # exactly the real tokens written


def dense_encoder(query, key, value, scale, window):
    """Bidirectional attention within one request: |i - j| < window (None: every token)."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(group, 1) for t in (key, value))
    scores = torch.einsum("qhd,khd->hqk", query.double(), key) * scale
    pos = torch.arange(query.shape[0])
    if window is not None:
        scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() >= window, -torch.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value)


@pytest.mark.parametrize("window", [None, 3])
def test_encoder_attention_matches_dense_attention(fake_npu, window):
    """Two requests (one with cached tokens, which encoder attention ignores) and padding."""
    torch.manual_seed(0)
    chunks = [kvgraph.RequestChunk([0] * 7, 0, [0, 1]), kvgraph.RequestChunk([0] * 5, 4, [2, 3, 4])]
    metadata = padded(kvgraph.build_attention_metadata(chunks, 4), 2)
    query, key, value = (torch.randn(14, heads, 8) for heads in (4, 2, 2))
    out = torch.full_like(query, NAN)
    MLAOnCpu().forward_encoder(query, key, value, out, metadata, 0.4, window)
    for rows in (slice(0, 7), slice(7, 12)):
        want = dense_encoder(query[rows], key[rows], value[rows], 0.4, window)
        torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)
    assert (out[12:] == 0).all()
    call = recorded(fake_npu, "npu_fusion_attention")[-1]
    assert call["ends"] == call["kv_ends"] == [7, 12, 14] and call["input_layout"] == "TND"
    if window is None:
        assert call["sparse_mode"] == 0 and call["mask_dtype"] is None
    else:
        assert (call["sparse_mode"], call["pre"], call["next"]) == (4, window - 1, window - 1)
        assert call["mask_dtype"] == torch.uint8  # npu_fusion_attention takes no int8 mask


# --- the MLA model through the runner, in every graph mode ------------------------------------


@pytest.fixture(scope="module")
def reference():
    """Greedy generation with the torch-native backend, eager, on the plain CPU platform."""
    runner = make_runner(MODEL, "eager")
    try:
        return generate(runner, runner.model.config.vocab_size, GENERATION)
    finally:
        runner.close()


@pytest.mark.parametrize("mode", ALL_MODES)
def test_the_mla_model_matches_torch_native_in_every_graph_mode(fake_npu, reference, mode):
    runner = make_runner(MODEL, mode, attn_backend=MLAOnCpu.name)
    try:
        if runner.config.graph_mode.has_graphs:
            summary = runner.capture()
            assert not summary["failed"], summary["failed"]
        logits, tokens = generate(runner, runner.model.config.vocab_size, GENERATION)
        hits = runner.stats()["hits"]
    finally:
        runner.close()
    want_logits, want_tokens = reference
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if "full" in mode:
        assert any(key.startswith("full:") for key in hits), hits  # full graphs replayed
    calls = recorded(fake_npu, "npu_fused_infer_attention_score_v2")
    for call in calls:  # the documented layout, whatever the mode
        assert call["input_layout"] == "TND" and call["sparse_mode"] == 3
        assert call["key_shape"][1] == 1 and call["ends"][-1] == call["num_tokens"]
    # The 17-token prefill after four decodes (21 tokens, run without graphs) is cut at 16.
    assert any(call["ends"] == [1, 2, 3, 4, 20, 21] for call in calls)


def test_a_full_graph_of_long_mixed_batches_is_refused_and_its_batches_run_without(
        fake_npu, reference, allow_capture_failures, caplog):
    """A mixed full graph of 32 tokens could meet requests of over 16 queries in a replay,
    where no call can be cut: its capture is refused naming the limit, the 8-token one works,
    and every step still gives the reference's tokens."""
    config = kvgraph.CompilationConfig(graph_mode="full", piece_compiler="eager",
                                       capture_sizes=(8, 32), check_graph_inputs=True)
    runner = kvgraph.ModelRunner(make_model(MODEL), config, num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK_SIZE, max_num_tokens=32, max_num_seqs=8,
                                 device="cpu", attn_backend=MLAOnCpu.name)
    try:
        summary = runner.capture()
        logits, tokens = generate(runner, runner.model.config.vocab_size, GENERATION)
    finally:
        runner.close()
    assert summary["failed"] == ["full:BatchDescriptor(num_tokens=32, num_reqs=None, "
                                 "uniform_decode=False)"]
    assert "at most 16 query tokens per request" in caplog.text
    want_logits, want_tokens = reference
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_encoder_attention_refuses_a_full_graph_capture(fake_npu):
    metadata = kvgraph.build_attention_metadata([kvgraph.RequestChunk([0] * 3, 0, [0])], 4)
    backend = MLAOnCpu()
    backend.step_plan(metadata).capture = CapturedCalls()
    query = torch.zeros(3, 2, 8)
    with pytest.raises(GraphError, match="npu_fusion_attention .*cannot be captured"):
        backend.forward_encoder(query, query, query, torch.empty_like(query), metadata, 0.1)


# --- documented limits ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype, heads, rank, rope, block_size, fault", [
    (torch.float32, 32, 512, 64, 128, "dtype torch.float32"),
    (torch.bfloat16, 24, 512, 64, 128, "24 query heads"),
    (torch.bfloat16, 256, 512, 64, 128, "256 query heads"),
    (torch.bfloat16, 32, 256, 64, 128, "kv_lora_rank 256"),
    (torch.float16, 32, 512, 32, 128, "rope_dim 32"),
    (torch.float16, 32, 512, 64, 64, "block size 64"),
])
def test_what_fused_mla_cannot_run_is_refused_naming_the_limit(dtype, heads, rank, rope,
                                                                block_size, fault):
    q_latent, q_pe = torch.empty(1, heads, rank, dtype=dtype), torch.empty(1, heads, rope,
                                                                          dtype=dtype)
    with pytest.raises(ValueError, match=f"cannot run .*{fault}"):
        ascend_mla.check_supported_mla(q_latent, q_pe, torch.empty(2, block_size, rank,
                                                                   dtype=dtype))
    for heads, block_size in ((16, 128), (128, 16)):  # DeepSeek-V2-Lite, V3
        ascend_mla.check_supported_mla(torch.empty(1, heads, 512, dtype=torch.bfloat16),
                                       torch.empty(1, heads, 64, dtype=torch.bfloat16),
                                       torch.empty(2, block_size, 512, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype, heads, head_size, fault", [
    (torch.float64, 8, 64, "dtype torch.float64"),
    (torch.float16, 8, 1024, "head size 1024"),
    (torch.bfloat16, 512, 64, "512 query heads"),
])
def test_what_fusion_attention_cannot_run_is_refused_naming_the_limit(dtype, heads, head_size,
                                                                      fault):
    with pytest.raises(ValueError, match=f"cannot run .*{fault}"):
        ascend_mla.check_supported_encoder(torch.empty(1, heads, head_size, dtype=dtype))
    ascend_mla.check_supported_encoder(torch.empty(1, 16, 128, dtype=torch.float32))


def test_split_requests_cuts_every_request_into_at_most_16_queries():
    ends, kv_lens, rows = ascend_mla.split_requests([1, 34, 34, 40], [9, 40, 1, 1])
    assert ends == [1, 17, 33, 34, 34, 40] and rows == [0, 1, 1, 1, 2, 3]
    assert kv_lens == [9, 23, 39, 40, 1, 1]  # each piece reads its keys up to its last query
