"""The engine's KV cache size: from --num-blocks, a byte budget, or the default, said in the
start-up log; a size that cannot hold one sequence is refused naming the flag."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import kvgraph
from examples.engine import build_engine
from examples.engine.kv_sizing import block_bytes, profiling_batch
from examples.generate import MODELS, parse_args
from tests.support.scenario import make_model

FLAGS = ["--preset", "tiny", "--graph-mode", "eager", "--block-size", "4", "--max-num-seqs", "4",
         "--max-model-len", "64", "--max-num-tokens", "32"]
PER_BLOCK = block_bytes(make_model("llama"), 4, torch.float32)


def engine_for(*flags: str):
    return build_engine(parse_args([*FLAGS, *flags]), MODELS)


def test_a_byte_budget_gives_the_blocks_it_holds(caplog):
    with caplog.at_level(logging.INFO):
        engine, summary = engine_for("--kv-cache-memory", str(40 * PER_BLOCK + 7))
    assert summary["num_blocks"] == 40 and engine.runner.limits.num_blocks == 40
    assert engine.allocator.num_blocks == 40
    assert "KV cache: 40 blocks of 4 tokens" in caplog.text
    assert f"--kv-cache-memory {40 * PER_BLOCK + 7} bytes / {PER_BLOCK} bytes per block" in caplog.text


def test_num_blocks_overrides_a_budget_and_the_default_is_every_sequence_at_full_length():
    _, summary = engine_for("--num-blocks", "20", "--kv-cache-memory", str(40 * PER_BLOCK))
    assert summary["num_blocks"] == 20 and summary["num_blocks_why"] == "--num-blocks"
    _, summary = engine_for()
    assert summary["num_blocks"] == 4 * 16  # 4 sequences of 64 tokens in blocks of 4


@pytest.mark.parametrize("flags, message", [
    (("--kv-cache-memory", str(10 * PER_BLOCK)), "--kv-cache-memory .* gives 10 KV cache blocks, "
                                                 "fewer than the 16 one sequence"),
    (("--num-blocks", "3"), "--num-blocks gives 3 KV cache blocks"),
    (("--gpu-memory-utilization", "0.9"), "--gpu-memory-utilization needs a CUDA or NPU device"),
])
def test_a_size_that_cannot_serve_is_refused_naming_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        engine_for(*flags)


@pytest.mark.parametrize("flags, message", [
    (("--num-blocks", "0"), r"argument --num-blocks: must lie in \[1, 2147483647\]"),
    (("--gpu-memory-utilization", "1.5"),
     r"argument --gpu-memory-utilization: must be a finite number in \(0, 1\]"),
])
def test_a_size_out_of_range_is_refused_as_the_flag_is_parsed(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, *flags])
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("max_num_tokens, max_model_len, max_num_seqs", [
    (32, 64, 4), (100, 30, 8), (100, 30, 2), (7, 64, 1)])
def test_the_profiling_batch_is_the_largest_step_a_runner_accepts(max_num_tokens, max_model_len,
                                                                  max_num_seqs):
    batch = profiling_batch(max_num_tokens, max_model_len, max_num_seqs, 4)
    tokens = [len(chunk.token_ids) for chunk in batch]
    assert sum(tokens) == min(max_num_tokens, max_num_seqs * max_model_len)
    assert max(tokens) <= max_model_len and len(batch) <= max_num_seqs
    blocks = sum(len(chunk.block_ids) for chunk in batch)
    runner = kvgraph.ModelRunner(make_model("llama"), kvgraph.CompilationConfig(graph_mode="eager"),
                                 num_blocks=blocks, block_size=4, max_num_seqs=max_num_seqs,
                                 max_num_tokens=max_num_tokens, max_model_len=max_model_len)
    assert runner.execute(batch).shape[0] == len(batch)
