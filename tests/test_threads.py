"""Compute threads: the default as a function of (cores, ranks, asked), the flag, and the
engine build that sets them before compiling."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from examples.engine import add_engine_args, build_engine
from examples.engine.threads import choose_threads, set_compute_threads, usable_cores
from examples.engine.tp_launch import ranks_on_node
from examples.models import DeepseekMLA, Llama


@pytest.mark.parametrize("cores, ranks, threads", [
    (1, 1, 1), (2, 1, 1), (3, 1, 2), (16, 1, 15),  # a core left for the server's threads
    (2, 2, 1), (16, 2, 7), (16, 4, 3), (4, 8, 1),  # ranks share what is left, at least 1 each
])
def test_the_default_leaves_a_core_and_shares_the_rest(cores, ranks, threads):
    choice = choose_threads(cores, ranks)
    assert (choice.threads, choice.cores) == (threads, cores)
    assert choice.why.startswith("default")


@pytest.mark.parametrize("cores, ranks", [(1, 1), (2, 1), (16, 4)])
def test_threads_asked_for_are_each_ranks_whatever_the_cores(cores, ranks):
    choice = choose_threads(cores, ranks, requested=6)
    assert choice.threads == 6 and "--threads" in choice.why


@pytest.mark.parametrize("cores, ranks, requested, named", [
    (2, 1, 0, "threads"), (0, 1, None, "cores"), (2, 0, None, "ranks")])
def test_impossible_counts_are_refused_naming_them(cores, ranks, requested, named):
    with pytest.raises(ValueError, match=named):
        choose_threads(cores, ranks, requested)


def test_setting_threads_sets_torch_and_logs_one_line(caplog):
    with caplog.at_level(logging.INFO, logger="examples.engine.threads"):
        choice = set_compute_threads(requested=3, who="engine")
    assert torch.get_num_threads() == choice.threads == 3
    [record] = caplog.records
    assert record.getMessage() == (f"engine: 3 compute threads ({usable_cores()} cores usable; "
                                   "as asked (--threads))")


def test_the_flag_takes_a_positive_count():
    parser = add_engine_args(argparse.ArgumentParser())
    assert parser.parse_args(["--threads", "4"]).threads == 4
    assert parser.parse_args([]).threads is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "0"])


def test_ranks_on_node_are_torchruns_local_ones_or_all(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_on_node(4) == 4  # spawned: every rank on this node
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert ranks_on_node(4) == 2  # torchrun over two nodes of two


@pytest.mark.parametrize("flag, threads", [
    ([], choose_threads(usable_cores()).threads), (["--threads", "3"], 3)])
def test_building_the_engine_sets_its_threads(flag, threads):
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--preset", "tiny", "--graph-mode", "eager", "--max-model-len", "64", *flag])
    torch.set_num_threads(threads + 1)
    engine, summary = build_engine(args, {"llama": Llama, "mla": DeepseekMLA})
    engine.runner.close()
    assert torch.get_num_threads() == summary["threads"] == threads
