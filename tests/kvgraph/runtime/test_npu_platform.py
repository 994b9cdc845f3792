"""The NPU platform against torch_npu's stand-in: its defaults (the ascend backend, 128-token
blocks), ACL graph capture through `torch.npu.graph`, stream exhaustion re-raised with advice,
and the error without torch_npu naming the autoload switch."""

from __future__ import annotations

import sys

import pytest
import torch

import kvgraph
from kvgraph.attention.backends.ascend import AscendBackend
from kvgraph.errors import ConfigError, GraphError, PlatformError
from kvgraph.runtime import platforms
from kvgraph.runtime.platforms.npu import ACLGraph, is_stream_exhaustion, npu_platform
from tests.support import fake_torch_npu

STREAM_ERROR = ("EZ9999: Inner Error! rtStreamCreate failed, error code 207008: stream "
                "resources are insufficient")


@pytest.fixture
def npu(monkeypatch):
    fake_torch_npu.install(monkeypatch)
    monkeypatch.delitem(platforms._platforms, "npu", raising=False)
    return torch.npu


def test_the_npu_platform_defaults_to_the_ascend_backend_and_128_token_blocks(npu, monkeypatch):
    platform = npu_platform()
    assert (platform.attention_backend, platform.default_block_size) == ("ascend", 128)
    assert platform.graph_class is npu.NPUGraph and platform.freezes_shapes
    assert isinstance(platform.make_graph(False, "piece_0"), ACLGraph)
    monkeypatch.setitem(platforms._platforms, "npu", platform)
    assert kvgraph.ModelRunner.default_block_size("npu:0") == 128
    assert kvgraph.ModelRunner.default_block_size("cpu") == 16


def test_an_acl_graph_captures_through_torch_npu_graph_with_the_runners_pool(npu):
    platform = npu_platform()
    graph = platform.make_graph(False, "piece_0")
    x = torch.ones(4)
    captured = graph.capture(lambda t: t * 2, (x,), npu.graph_pool_handle())
    assert torch.equal(captured, torch.full((4,), 2.0))
    assert npu.state.empty_cache_calls == 1  # torch.npu.graph empties the cache on entry
    with platform.capture_phase():  # many captures in a row keep the cache
        platform.make_graph(False, "piece_1").capture(lambda t: t + 1, (x,), npu.graph_pool_handle())
    assert npu.state.empty_cache_calls == 1


def test_running_out_of_streams_in_a_capture_is_reraised_with_what_to_change(npu):
    graph = npu_platform().make_graph(False, "piece_0")
    npu.state.capture_error = RuntimeError(STREAM_ERROR)
    with pytest.raises(GraphError, match="ran out of streams.*207008.*capture_sizes.*"
                                         "full_decode_only") as caught:
        graph.capture(lambda t: t, (torch.ones(1),), npu.graph_pool_handle())
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_other_capture_errors_pass_through_unchanged(npu):
    graph = npu_platform().make_graph(False, "piece_0")
    npu.state.capture_error = RuntimeError("operator not supported in capture")
    with pytest.raises(RuntimeError, match="^operator not supported in capture$"):
        graph.capture(lambda t: t, (torch.ones(1),), npu.graph_pool_handle())


@pytest.mark.parametrize("message, exhausted", [
    (STREAM_ERROR, True),
    ("ACL graph capture: insufficient_stream_resources", True),
    ("error 207008 while allocating the stream pool", True),
    ("error code 507008", False),
    ("out of memory", False),
])
def test_stream_exhaustion_is_recognised_by_cann_code_or_words(message, exhausted):
    assert is_stream_exhaustion(RuntimeError(message)) is exhausted


@pytest.mark.parametrize("block_size", [16, 192, 1024])
def test_a_block_size_fused_attention_cannot_run_is_a_config_error(block_size):
    with pytest.raises(ConfigError, match=f"multiples of 128 up to 512.*got {block_size}"):
        AscendBackend().check_block_size(block_size)
    AscendBackend().check_block_size(128)


def test_without_torch_npu_the_error_names_the_cause_and_the_autoload_switch(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    monkeypatch.delitem(platforms._platforms, "npu", raising=False)
    with pytest.raises(PlatformError, match="torch_npu.*TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
        platforms.get_platform("npu")


def test_the_npu_serves_with_kvgraphs_defaults_over_hccl_one_npu_per_rank(npu, monkeypatch):
    platform = npu_platform()
    assert platform.default_graph_mode is None  # kvgraph's own, piecewise
    assert (platform.default_max_num_tokens, platform.captures_decode_only) == (128, False)
    assert (platform.default_burst_gap_ms, platform.distributed_backend) == (0.0, "hccl")
    assert platform.device_memory is npu and platform.rank_device(2) == "npu:2"
    chosen: list[int] = []
    monkeypatch.setattr(npu, "set_device", chosen.append, raising=False)
    platform.set_device(2)
    assert chosen == [2]
