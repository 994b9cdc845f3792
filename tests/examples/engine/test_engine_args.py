"""The engine's flag defaults that depend on the device, its platform's answers: the token
budget per step, the graph mode and the capture sizes (on the CPU, decode sizes only: an engine
so built generates what one capturing every size does, running its larger steps without
graphs)."""

from __future__ import annotations

import argparse

import pytest

from examples.engine import SamplingParams, add_engine_args, build_engine
from examples.generate import MODELS, parse_args
from kvgraph import GraphMode
from kvgraph.runtime import platforms
from kvgraph.runtime.platforms.cpu import CPUPlatform
from kvgraph.runtime.platforms.npu import npu_platform
from kvgraph.runtime.platforms.stream import StreamPlatform
from tests.support import fake_torch_npu

from examples.engine.engine_args import compilation_config

DEFAULT_TOKEN_BUDGET = StreamPlatform.default_max_num_tokens


@pytest.fixture(autouse=True)
def npu(monkeypatch):
    """The NPU platform over torch_npu's stand-in (the real one is never imported in tests)."""
    fake_torch_npu.install(monkeypatch)
    monkeypatch.setitem(platforms._platforms, "npu", npu_platform())


def budget(*flags: str) -> int:
    return compilation_config(add_engine_args(argparse.ArgumentParser()).parse_args(
        list(flags))).max_num_tokens


def test_the_cpu_budget_is_what_its_prefill_does_best(monkeypatch):
    monkeypatch.delenv("KVGRAPH_MAX_NUM_TOKENS", raising=False)
    assert budget() == budget("--device", "cpu") == CPUPlatform.default_max_num_tokens == 1024


# Ids without "cuda": that keyword marks a test that needs a GPU.
@pytest.mark.parametrize("device", ["cuda", "cuda:1", "npu:0"], ids=["gpu", "gpu1", "npu"])
def test_other_devices_keep_their_budget(monkeypatch, device):
    monkeypatch.delenv("KVGRAPH_MAX_NUM_TOKENS", raising=False)
    assert budget("--device", device) == DEFAULT_TOKEN_BUDGET == 128


def test_a_budget_asked_for_wins(monkeypatch):
    assert budget("--max-num-tokens", "64") == 64
    monkeypatch.setenv("KVGRAPH_MAX_NUM_TOKENS", "96")
    assert budget() == 96


def mode(*flags: str) -> GraphMode:
    return compilation_config(add_engine_args(argparse.ArgumentParser()).parse_args(
        list(flags))).graph_mode


@pytest.mark.parametrize("device, expected", [
    ("cpu", GraphMode.FULL), ("cuda", GraphMode.PIECEWISE), ("npu:0", GraphMode.PIECEWISE),
], ids=["cpu", "gpu", "npu"])
def test_the_graph_mode_follows_the_device(monkeypatch, device, expected):
    monkeypatch.delenv("KVGRAPH_GRAPH_MODE", raising=False)
    assert mode("--device", device) is expected


def test_a_graph_mode_asked_for_wins(monkeypatch):
    monkeypatch.delenv("KVGRAPH_GRAPH_MODE", raising=False)
    assert mode("--graph-mode", "piecewise") is GraphMode.PIECEWISE
    monkeypatch.setenv("KVGRAPH_GRAPH_MODE", "none")
    assert mode() is GraphMode.NONE
    help_text = add_engine_args(argparse.ArgumentParser()).format_help()
    assert "full on the CPU" in " ".join(help_text.split())


def capture_sizes(*flags: str) -> tuple[int, ...]:
    return compilation_config(add_engine_args(argparse.ArgumentParser()).parse_args(
        list(flags))).capture_size_list


def test_the_cpu_captures_decode_sizes_only(monkeypatch):
    monkeypatch.delenv("KVGRAPH_CAPTURE_SIZES", raising=False)
    assert capture_sizes() == capture_sizes("--max-num-seqs", "16") == (1, 2, 4, 8, 16)
    assert capture_sizes("--max-num-seqs", "12") == (1, 2, 4, 8, 12)
    assert capture_sizes("--max-num-seqs", "40") == (1, 2, 4, 8, 16, 24, 32, 40)
    # Never past the token budget: no step is larger.
    assert capture_sizes("--max-num-seqs", "64", "--max-num-tokens", "20") == (1, 2, 4, 8, 16, 20)


@pytest.mark.parametrize("device", ["cuda", "npu:0"], ids=["gpu", "npu"])
def test_other_devices_capture_every_default_size(monkeypatch, device):
    monkeypatch.delenv("KVGRAPH_CAPTURE_SIZES", raising=False)
    sizes = capture_sizes("--device", device)
    assert sizes[:5] == (1, 2, 4, 8, 16) and max(sizes) == DEFAULT_TOKEN_BUDGET


def test_capture_sizes_asked_for_win(monkeypatch):
    monkeypatch.delenv("KVGRAPH_CAPTURE_SIZES", raising=False)
    assert capture_sizes("--capture-sizes", "3,5") == (3, 5)
    assert max(capture_sizes("--capture-sizes", "auto")) == 512  # kvgraph's own default list
    monkeypatch.setenv("KVGRAPH_CAPTURE_SIZES", "2,6")
    assert capture_sizes() == (2, 6)
    help_text = " ".join(add_engine_args(argparse.ArgumentParser()).format_help().split())
    assert "on the CPU only those up to" in help_text


def test_a_cpu_engine_with_decode_graphs_only_generates_what_one_with_every_size_does(
        monkeypatch):
    monkeypatch.delenv("KVGRAPH_CAPTURE_SIZES", raising=False)
    flags = ["--preset", "tiny", "--piece-compiler", "eager", "--max-num-seqs", "4",
             "--max-num-tokens", "32", "--max-model-len", "64", "--no-enable-prefix-caching"]
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [42], [5] * 20, [9] * 13]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens, stats = [], []
    for extra in ([], ["--capture-sizes", "auto"]):
        engine, summary = build_engine(parse_args([*flags, *extra]), MODELS)
        try:
            tokens.append([c.token_ids for c in engine.generate(prompts, greedy)])
            stats.append((summary["descriptors"], engine.runner.stats()))
        finally:
            engine.runner.close()
    assert tokens[0] == tokens[1]
    (decode_only, decode_stats), (every, every_stats) = stats
    assert decode_only < every
    # Prompt-sized steps ran without graphs in the first engine, from graphs in the second.
    assert decode_stats["fallbacks"] > 0 and every_stats["fallbacks"] == 0
