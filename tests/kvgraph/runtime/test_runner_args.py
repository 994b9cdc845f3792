"""A runner's and a config's arguments are refused when built, naming the argument (issue 17):
wrong types and ranges, sizes no index or allocator can hold, paths no file can have, and
splitting ops that split nothing."""

from __future__ import annotations

import logging

import pytest
import torch

import kvgraph
from kvgraph import GraphMode, RequestChunk
from kvgraph.compilation.counters import compile_counters
from tests.support.scenario import CAPTURE_SIZES, assert_matches_eager, make_model, make_runner

pytestmark = pytest.mark.usefixtures("fresh_compile_state")  # some tests count compiles

SIZES = dict(num_blocks=16, block_size=4, max_num_seqs=2, max_num_tokens=8)

BAD_RUNNER_ARGS = {
    "dtype as a string": (dict(dtype="float16"), "dtype: expected a floating torch.dtype"),
    "max_num_seqs=0": (dict(max_num_seqs=0), "max_num_seqs: expected an int >= 1, got 0"),
    "max_num_seqs=1.5": (dict(max_num_seqs=1.5), r"max_num_seqs: expected an int >= 1, got 1.5 "
                                                 r"\(float\)"),
    "max_model_len=-1": (dict(max_model_len=-1), "max_model_len: expected an int >= 1, got -1"),
    "block_size=True": (dict(block_size=True), r"block_size: expected an int >= 1, got True"),
    "num_blocks='16'": (dict(num_blocks="16"), r"num_blocks: expected an int >= 1, got '16'"),
    "vocab_size=0": (dict(vocab_size=0), "vocab_size: expected an int >= 1"),
    "num_blocks past int32": (dict(num_blocks=2**31), "num_blocks: expected at most 2147483647"),
    "max_num_tokens=2**70": (dict(max_num_tokens=2**70),
                             "max_num_tokens: expected at most 2147483647"),
    "KV caches larger than the machine": (dict(num_blocks=2**30),
                                          r"KV caches \(.* GiB.*lower num_blocks"),
    "step buffers larger than the machine": (dict(max_num_seqs=2**28, max_model_len=2**20),
                                             r"step buffers .*lower max_num_seqs"),
}


@pytest.mark.parametrize("case", list(BAD_RUNNER_ARGS))
def test_a_bad_runner_argument_is_refused_when_built(case):
    changes, message = BAD_RUNNER_ARGS[case]
    model = make_model("llama")
    config = kvgraph.CompilationConfig(graph_mode="eager")
    with pytest.raises(kvgraph.ConfigError, match=message):
        kvgraph.ModelRunner(model, config, **{**SIZES, **changes})
    # Nothing was claimed or bound: a runner with good arguments is built on the same model.
    runner = kvgraph.ModelRunner(model, config, **SIZES)
    assert runner.execute([RequestChunk([1, 2], 0, [3])]).shape[0] == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3"], ids=["no index", "index 3"])
def test_a_device_this_process_cannot_use_is_refused_naming_what_it_has(device):
    with pytest.raises(kvgraph.PlatformError, match=f"device {device}: this process sees 0 cuda"):
        kvgraph.ModelRunner(make_model("llama"), kvgraph.CompilationConfig(graph_mode="eager"),
                            device=device, **SIZES)


@pytest.mark.parametrize("field", ["cache_dir", "debug_dump_path"])
def test_a_path_with_a_nul_character_is_refused(field):
    with pytest.raises(kvgraph.ConfigError, match=f"{field}: a path cannot contain a NUL"):
        kvgraph.CompilationConfig(**{field: "/tmp/kv\0graph"})


def test_a_debug_dump_path_that_is_a_file_is_refused(tmp_path):
    path = tmp_path / "dump"
    path.write_text("")
    with pytest.raises(kvgraph.ConfigError, match="debug_dump_path: .* is not a directory"):
        kvgraph.CompilationConfig(debug_dump_path=str(path))


def test_a_debug_dump_that_cannot_be_written_is_refused_before_compiling():
    # /proc takes no new directories, whoever asks: the dump cannot be made.
    with pytest.raises(kvgraph.ConfigError, match="debug_dump_path: cannot write a debug dump "
                       "in /proc/kvgraph-dump"):
        make_runner("llama", "piecewise", debug_dump_path="/proc/kvgraph-dump")
    assert compile_counters.dynamo_graphs == 0


def test_splitting_ops_naming_no_registered_op_are_treated_like_none(caplog):
    with caplog.at_level(logging.WARNING):
        config = kvgraph.CompilationConfig(graph_mode="piecewise", splitting_ops=("foo::bar",))
    assert config.splitting_ops == () and config.graph_mode is GraphMode.FULL
    assert "splitting_ops ['foo::bar'] name no registered op" in caplog.text
    mixed = kvgraph.CompilationConfig(splitting_ops=("kvgraph::unified_attention", "foo::bar"))
    assert mixed.splitting_ops == ("kvgraph::unified_attention",)
    assert mixed.graph_mode is GraphMode.PIECEWISE


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_splitting_ops_the_graph_never_calls_make_the_runner_capture_full_graphs(mode, caplog):
    # aten::mm is registered but never in a Dynamo graph (which calls torch functions): no piece
    # would hold attention on its own, so attention must not end up inside piecewise graphs.
    with caplog.at_level(logging.WARNING):
        runner = assert_matches_eager("llama", mode, splitting_ops=("aten::mm",),
                                      attn_backend="torch_native")
    assert "splitting_ops ['aten::mm'] match no op of the traced graph" in caplog.text
    # torch_native captures attention for uniform decode only: full decode graphs, the rest
    # without graphs; never a piecewise one.
    assert runner.config.graph_mode is GraphMode.FULL_DECODE_ONLY
    assert runner.config.splitting_ops == ()
    hits = runner.stats()["hits"]
    assert hits and not any("piecewise" in key for key in hits), hits
    assert any("full" in key for key in hits), hits
    assert runner.stats()["graphs"]["captures"] == len([s for s in CAPTURE_SIZES if s <= 8])
