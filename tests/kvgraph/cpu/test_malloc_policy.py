"""Freed memory kept in the process (kvgraph.cpu.malloc_policy): blocks past glibc's largest mmap
threshold stop faulting their pages in anew once freed memory is kept, a C library that is not
glibc is left alone and said so, and the engine keeps freed memory on the CPU unless told not
to. The allocator's behaviour is measured in child processes: it is the whole process's."""

import argparse
import logging
import subprocess
import sys
import textwrap

import pytest

from kvgraph.cpu import malloc_policy
from kvgraph.cpu.malloc_policy import MallocPolicy, keep_freed_memory
from tests.support.measured import assert_measured

GLIBC = pytest.mark.skipif(
    not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
    reason="glibc's malloc only")

# Page faults of allocating, touching and freeing a 48 MiB tensor (past glibc's largest mmap
# threshold, 32 MiB), the last of five rounds; with `keep` first.
FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from kvgraph.cpu.malloc_policy import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory().kept
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.ones(12 << 20)
        del x
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults)
""")


def _last_round_faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True,
                          timeout=120, check=True)
    return int(done.stdout.split()[-1])


@GLIBC
def test_kept_memory_is_reused_without_faulting_its_pages_in_again():
    pages = (48 << 20) // 4096
    assert _last_round_faults("default") > pages // 2  # a fresh mapping each time
    assert _last_round_faults("keep") < pages // 20


def test_another_c_library_is_left_alone_and_said_so(monkeypatch, caplog):
    monkeypatch.setattr(malloc_policy.platform, "libc_ver", lambda: ("musl", "1.2"))
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        policy = keep_freed_memory()
    assert policy == MallocPolicy(False, policy.reason) and "not glibc" in policy.reason
    assert "musl" in caplog.text


@pytest.mark.parametrize("flags, kept", [([], True), (["--no-keep-freed-memory"], False)])
def test_the_engine_keeps_freed_memory_on_the_cpu_unless_told_not_to(monkeypatch, flags, kept):
    from examples.engine import add_engine_args, build_engine
    from examples.models import MODELS

    calls = []  # the engine asks the CPU platform, which sets the policy
    monkeypatch.setattr(malloc_policy, "keep_freed_memory", lambda: calls.append(True))
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--preset", "tiny", "--graph-mode", "eager", "--max-model-len", "64", *flags])
    engine, _ = build_engine(args, MODELS)
    engine.runner.close()
    assert calls == ([True] if kept else [])


@pytest.mark.slow  # starts two engine processes
def test_the_benchmark_times_both_settings(tmp_path):
    from examples.benchmarks import freed_memory
    payload = freed_memory.main(["--preset", "tiny", "--rounds", "1",
                                 "--kvgraph-arg=--piece-compiler=eager",
                                 "--json", str(tmp_path / "fm.json")])
    assert set(payload["results"]) == {"prefill_tok_s", "decode_b16_ms"}
    assert all(set(by) == {"default", "kept"} for by in payload["results"].values())
    assert_measured(v for by in payload["results"].values() for v in by.values())
    assert (tmp_path / "fm.json").exists()
