"""Compute threads: the default as a function of (cores, ranks, asked), the flag, and the
engine build that sets them before compiling."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.engine import add_engine_args, build_engine
from examples.engine.threads import (bind_compute_threads, choose_threads, set_compute_threads,
                                     usable_cores)
from examples.engine.tp_launch import ranks_on_node
from examples.models import MODELS


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
    engine, summary = build_engine(args, MODELS)
    engine.runner.close()
    assert torch.get_num_threads() == summary["threads"] == threads


# In a process of its own: binding confines the calling thread (pytest's) to one core.
BIND_CHECK = """
import json, os, sys, torch
from examples.engine.threads import bind_compute_threads
threads = int(sys.argv[1])
torch.set_num_threads(threads)
placed = bind_compute_threads(threads)
torch.ones(1 << 20).sum()  # a parallel region after binding runs on the bound threads
affinities = sorted(sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task"))
print(json.dumps({"placed": placed, "main": sorted(os.sched_getaffinity(0)),
                  "affinities": affinities}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity calls")
@pytest.mark.parametrize("threads", [1, 2])
def test_bound_threads_each_keep_one_of_the_first_usable_cores(threads):
    cores = sorted(os.sched_getaffinity(0))
    if threads > len(cores):
        pytest.skip(f"{len(cores)} usable core(s)")
    from kvgraph.cpu import build
    try:
        build.load_kernels()  # built here once, so the child only loads them
    except build.KernelBuildError as error:
        pytest.skip(str(error))
    done = subprocess.run([sys.executable, "-c", BIND_CHECK, str(threads)], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[3], timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["placed"] == cores[:threads]
    assert result["main"] == cores[:1]  # the caller is OpenMP's thread 0
    for core in cores[:threads]:  # each core holds one bound thread
        assert [core] in result["affinities"]


def test_binding_is_skipped_saying_why_where_it_cannot_be_one_thread_per_core(caplog):
    before = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    with caplog.at_level(logging.WARNING, logger="examples.engine.threads"):
        assert bind_compute_threads(1, ranks=2) == []
        assert bind_compute_threads(len(os.sched_getaffinity(0)) + 1) == []
    assert "several ranks share this node" in caplog.text
    assert "threads for" in caplog.text and "usable cores" in caplog.text
    if before is not None:
        assert os.sched_getaffinity(0) == before  # nothing was bound


def test_the_engine_binds_only_when_asked():
    args = add_engine_args(argparse.ArgumentParser()).parse_args(["--preset", "tiny"])
    assert args.bind_threads is False
    assert add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--preset", "tiny", "--bind-threads"]).bind_threads is True


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity calls")
def test_a_core_outside_the_affinity_mask_is_refused_naming_it():
    from kvgraph.cpu import build
    try:
        build.load_kernels()
    except build.KernelBuildError as error:
        pytest.skip(str(error))
    outside = max(os.sched_getaffinity(0)) + 1000
    code = ("import torch; from kvgraph.cpu.build import load_kernels; "
            f"load_kernels(); torch.ops.kvgraph_cpu.bind_compute_threads([{outside}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[3], timeout=300)
    assert done.returncode != 0
    assert f"could not bind thread 0 to CPU {outside}" in done.stderr
