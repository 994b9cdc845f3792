"""The engine's flag defaults that depend on the device: the token budget per step and the
graph mode."""

from __future__ import annotations

import argparse

import pytest

from examples.engine import add_engine_args
from kvgraph import GraphMode

from examples.engine.engine_args import (
    DEFAULT_TOKEN_BUDGET,
    DEFAULT_TOKEN_BUDGETS,
    compilation_config,
)


def budget(*flags: str) -> int:
    return compilation_config(add_engine_args(argparse.ArgumentParser()).parse_args(
        list(flags))).max_num_tokens


def test_the_cpu_budget_is_what_its_prefill_does_best(monkeypatch):
    monkeypatch.delenv("KVGRAPH_MAX_NUM_TOKENS", raising=False)
    assert budget() == budget("--device", "cpu") == DEFAULT_TOKEN_BUDGETS["cpu"] == 1024


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
