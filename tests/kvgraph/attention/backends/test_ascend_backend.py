"""The `ascend` attention backend, run on the CPU against a stand-in of torch_npu's documented
ops and graph API (tests/support/fake_torch_npu.py, tests/support/fake_npu_graphs.py): the same tokens and
logits as the torch-native reference in every graph mode, each op called with the layouts,
host lengths and padding torch_npu requires, and full graphs whose host lengths are updated
before each replay (without which they go wrong)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import kvgraph
from kvgraph.attention.backends import register_attention_backend
from kvgraph.attention.backends.ascend import AscendBackend
from kvgraph.runtime import platforms
from tests.support import fake_npu_graphs, fake_torch_npu
from tests.support.scenario import GENERATION, generate, make_runner


class AscendOnCpu(AscendBackend):
    """The ascend backend let onto CPU tensors, where the stand-in ops run, and onto the tiny
    models' fp32 and head size 16 (FIA's limits are tested on their own below)."""

    name = "test_ascend_cpu"
    device_types = None

    def check_supported(self, query, num_kv_heads, block_size):
        pass

    def check_block_size(self, block_size):
        pass


register_attention_backend(AscendOnCpu)


class FrozenLengthsOnCpu(AscendOnCpu):
    """The backend as it would be without task groups: a full graph freezes FIA's lengths."""

    name = "test_ascend_frozen"

    def before_capture(self, mode, descriptor, metadata):
        super().before_capture(mode, descriptor, metadata)
        self.step_plan(metadata).capture = None


register_attention_backend(FrozenLengthsOnCpu)
ALL_MODES = ["eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]


@pytest.fixture
def fake_npu(monkeypatch):
    """torch_npu's stand-in, and the NPU platform's graph contract on CPU tensors."""
    module = fake_torch_npu.install(monkeypatch)
    monkeypatch.setitem(platforms._platforms, "cpu",
                        fake_npu_graphs.NPUPlatformOnCpu(AscendOnCpu.name))
    return module


@pytest.fixture(scope="module")
def reference():
    """Greedy generation with the torch-native backend, eager, on the plain CPU platform."""
    runner = make_runner("llama", "eager")
    try:
        return generate(runner, runner.model.config.vocab_size, GENERATION)
    finally:
        runner.close()


def run_ascend(mode, backend=AscendOnCpu.name, plan=GENERATION):
    runner = make_runner("llama", mode, attn_backend=backend)
    if runner.config.graph_mode.has_graphs:
        summary = runner.capture()
        assert not summary["failed"], summary["failed"]
    result = generate(runner, runner.model.config.vocab_size, plan)
    return runner, result


def attention_calls(fake_npu):
    return [data for name, data in fake_npu.calls if name == "npu_fused_infer_attention_score"]


@pytest.mark.parametrize("mode", ALL_MODES)
def test_every_graph_mode_matches_torch_native(fake_npu, reference, mode):
    runner, (logits, tokens) = run_ascend(mode)
    assert runner.config.graph_mode.value == mode  # nothing downgraded: graph support ALWAYS
    want_logits, want_tokens = reference
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert attention_calls(fake_npu)
    if "full" in mode:
        hits = runner.stats()["hits"]
        assert any(key.startswith("full:") for key in hits), hits  # full graphs replayed


def test_full_graphs_update_each_task_group_with_the_steps_lengths(fake_npu):
    runner, _ = run_ascend("full_decode_only", plan=GENERATION[:3])
    layers = len(runner.kv_caches)
    # Step 3 decodes 3 requests: padded to the capture size 4, a fourth request owns the padding.
    replayed = [call for call in attention_calls(fake_npu) if call["num_tokens"] == 4][-layers:]
    assert all(call["ends"] == [1, 2, 3, 4] for call in replayed)
    assert [call["kv_lens"][:3] for call in replayed] == [[9, 9, 14]] * layers
    assert all(call["kv_lens"][3] == 1 for call in replayed)  # a padded request reads one key
    captured = [task for graph in _acl_graphs(runner) for task in graph.npu_graph.tasks]
    assert captured and all(task.group is not None for task in captured)
    assert sum(task.group.updates for task in captured) == layers  # one replay, one update each


def _acl_graphs(runner):
    return [entry.graph for entry in runner._graphs.entries()]


def test_a_full_graph_without_the_update_reads_stale_lengths_and_goes_wrong(fake_npu, reference):
    """Without task groups, FIA keeps the lengths of the capture's dummy batch: decode steps
    replayed from full graphs attend to the wrong keys, and the tokens differ."""
    runner, (logits, tokens) = run_ascend("full_decode_only", FrozenLengthsOnCpu.name)
    want_logits, want_tokens = reference
    decode_steps = [i for i, step in enumerate(GENERATION) if all(n == "decode" for _, n in step)]
    assert decode_steps
    assert not all(torch.allclose(logits[i], want_logits[i], atol=1e-3) for i in decode_steps)
    assert tokens != want_tokens
    stale = [call for call in attention_calls(fake_npu) if call["kv_lens"][:1] == [1]
             and call["num_tokens"] > 1]
    assert stale  # replays ran with the capture's one-key lengths


def test_a_replay_whose_update_is_skipped_would_hang_and_is_refused(fake_npu, monkeypatch):
    monkeypatch.setattr(AscendOnCpu, "before_replay", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="ExternalEvents nobody recorded"):
        run_ascend("full_decode_only", plan=GENERATION[:3])


def test_padded_steps_end_in_a_dummy_request_and_pass_padding_slots_as_minus_one(fake_npu):
    runner, _ = run_ascend("piecewise", plan=GENERATION[:2])
    attention = attention_calls(fake_npu)
    # The first step, 7 + 3 tokens, runs padded to the capture size 16: a dummy third request.
    first = [call for call in attention if call["ends"][:2] == [7, 10]]
    assert first and all(call["ends"] == [7, 10, 16] and call["kv_lens"] == [7, 3, 1]
                         for call in first)
    for call in attention:
        assert call["ends"][-1] == call["num_tokens"] and call["sparse_mode"] == 3
    writes = [data["slots"] for name, data in fake_npu.calls if name == "npu_scatter_pa_kv_cache"]
    assert any(slots[:10] != [-1] * 10 and slots[10:] == [-1] * 6 for slots in writes)
    assert any(set(slots) == {-1} for slots in writes)  # compile and capture steps write nothing


def test_host_lengths_are_read_from_host_copies_not_the_device(fake_npu, monkeypatch):
    """A device read would sync every step and cannot run inside a capture."""
    monkeypatch.setattr(torch.Tensor, "tolist", _no_tolist)
    metadata = kvgraph.build_attention_metadata([kvgraph.RequestChunk([1, 2], 3, [0, 1])], 4)
    plan = AscendOnCpu().plan(metadata, None)
    assert plan.host_lengths() == ([2], [5])


def _no_tolist(tensor):
    raise AssertionError("a device tensor was read back")


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
    (torch.bfloat16, 128, 16, 8, "block size 16"),
    (torch.float16, 128, 1024, 8, "block size 1024"),
])
def test_what_fused_attention_cannot_run_is_refused_naming_the_limit(dtype, head_size,
                                                                     block_size, heads, fault):
    query = torch.empty(1, heads, head_size, dtype=dtype)
    with pytest.raises(ValueError, match=f"cannot run .*{fault}"):
        AscendBackend().check_supported(query, 2, block_size)
    AscendBackend().check_supported(torch.empty(1, 8, 128, dtype=torch.bfloat16), 2, 128)


def test_choosing_it_imports_no_torch_npu_until_it_runs():
    # torch has no "npu" device without torch_npu: the backend reads only the device's type.
    code = ("import sys, types, kvgraph.attention.backends as b\n"
            "b.get_attention_backend('ascend', types.SimpleNamespace(type='npu'))\n"
            "print('torch_npu' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.split()[-1] == "False", result.stderr
