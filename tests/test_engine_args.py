"""The engine's flag defaults that depend on the device: the token budget per step."""

from __future__ import annotations

import argparse

import pytest

from examples.engine import add_engine_args
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
