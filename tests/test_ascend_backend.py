"""The `ascend` attention backend, run on the CPU against a stand-in of torch_npu's documented
ops (tests/fake_torch_npu.py): the same tokens and logits as the torch-native reference, and
each op called with the layouts, host lengths and padding torch_npu requires."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvgraph
from kvgraph.attention.backends import register_attention_backend
from kvgraph.attention.backends.ascend import AscendBackend
from tests import fake_torch_npu
from tests.scenario import GENERATION, generate, make_runner


class AscendOnCpu(AscendBackend):
    """The ascend backend let onto CPU tensors, where the stand-in ops run, and onto the tiny
    models' fp32 and head size 16 (FIA's limits are tested on their own below)."""

    name = "test_ascend_cpu"
    device_types = None

    def check_supported(self, query, num_kv_heads, block_size):
        pass


register_attention_backend(AscendOnCpu)


@pytest.fixture
def fake_npu(monkeypatch):
    return fake_torch_npu.install(monkeypatch)


def reference(mode="eager"):
    runner = make_runner("llama", mode)
    return generate(runner, runner.model.config.vocab_size, GENERATION)


@pytest.mark.parametrize("mode", ["eager", "none", "piecewise"])
def test_matches_torch_native(fake_npu, mode):
    want_logits, want_tokens = reference()
    runner = make_runner("llama", mode, attn_backend=AscendOnCpu.name)
    runner.capture() if runner.config.graph_mode.has_graphs else None
    logits, tokens = generate(runner, runner.model.config.vocab_size, GENERATION)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert any(name == "npu_fused_infer_attention_score" for name, _ in fake_npu.calls)


def test_full_graph_modes_run_attention_outside_graphs_until_lengths_are_updated(fake_npu):
    runner = make_runner("llama", "full_and_piecewise", attn_backend=AscendOnCpu.name)
    assert runner.config.graph_mode.value == "piecewise"  # FIA's host lengths would freeze


def test_padded_steps_end_in_a_dummy_request_and_padding_slots_are_skipped(fake_npu):
    runner = make_runner("llama", "piecewise", attn_backend=AscendOnCpu.name)
    runner.capture()
    generate(runner, runner.model.config.vocab_size, GENERATION[:2])
    attention = [data for name, data in fake_npu.calls if name == "npu_fused_infer_attention_score"]
    # The first step, 7 + 3 tokens, runs padded to the capture size 16: a dummy third request.
    first = [call for call in attention if call["ends"][:2] == [7, 10]]
    assert first and all(call["ends"] == [7, 10, 16] and call["kv_lens"] == [7, 3, 1]
                         for call in first)
    for call in attention:
        assert call["ends"][-1] == call["num_tokens"] and call["sparse_mode"] == 3
    writes = [data for name, data in fake_npu.calls if name == "npu_scatter_pa_kv_cache"]
    assert writes and all(-1 not in data["slots"] for data in writes)  # padding sliced off


def test_a_sliding_window_is_a_band_of_pre_tokens(fake_npu):
    """Against dense float64 attention: a query sees the `window` keys ending at itself."""
    torch.manual_seed(0)
    backend = AscendOnCpu()
    block_size, window = 4, 3
    key_cache = torch.zeros(8, block_size, 2, 8, dtype=torch.float64)
    value_cache = torch.zeros_like(key_cache)
    chunks = [kvgraph.RequestChunk(list(range(7)), 0, [3, 1])]
    metadata = kvgraph.build_attention_metadata(chunks, block_size, "cpu")
    q, k, v = (torch.randn(7, h, 8, dtype=torch.float64) for h in (4, 2, 2))
    out = torch.empty_like(q)
    backend.forward(q, k, v, [key_cache, value_cache], out, metadata, 0.5, window)
    call = [d for n, d in fake_npu.calls if n == "npu_fused_infer_attention_score"][-1]
    assert call["sparse_mode"] == 4 and call["pre_tokens"] == window
    kk, vv = (t.repeat_interleave(2, 1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, kk) * 0.5
    pos = torch.arange(7)
    visible = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, -torch.inf).softmax(-1), vv)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("dtype, head_size, block_size, heads, fault", [
    (torch.float32, 128, 128, 8, "dtype torch.float32"),
    (torch.bfloat16, 64, 128, 8, "head size 64"),
    (torch.bfloat16, 128, 24, 8, "block size 24"),
    (torch.float16, 128, 2048, 8, "block size 2048"),
])
def test_what_fused_attention_cannot_run_is_refused_naming_the_limit(dtype, head_size,
                                                                     block_size, heads, fault):
    query = torch.empty(1, heads, head_size, dtype=dtype)
    with pytest.raises(ValueError, match=f"cannot run .*{fault}"):
        AscendBackend().check_supported(query, 2, block_size)
    AscendBackend().check_supported(torch.empty(1, 8, 128, dtype=torch.bfloat16), 2, 128)


def test_mla_is_refused_clearly(fake_npu):
    with pytest.raises(NotImplementedError, match="ascend.*MLA"):
        AscendOnCpu().forward_mla(*[None] * 8)


def test_choosing_it_imports_no_torch_npu_until_it_runs():
    # torch has no "npu" device without torch_npu: the backend reads only the device's type.
    code = ("import sys, types, kvgraph.attention.backends as b\n"
            "b.get_attention_backend('ascend', types.SimpleNamespace(type='npu'))\n"
            "print('torch_npu' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split()[-1] == "False", result.stderr
