"""Every numeric flag of the entry points is bounded where it is parsed: a value out of range is
refused by argparse, naming the flag, before anything is built.

The cases are the ones an adversarial user ran (`--threads 100000` exhausted the machine's
threads, `--burst-gap-ms inf` stopped the engine at its first request, `--seed 2**64` was
refused without naming the flag, `--port 70000` raised after the engine was built, ...), and a
sweep that fails for any numeric flag left with a bare int or float type.
"""

from __future__ import annotations

import argparse

import pytest

from examples import generate, serve
from examples.engine import build_engine
from examples.engine.burst_window import BurstWindow
from examples.engine.threads import usable_cores

CASES = [
    ("--threads", "100000"), ("--threads", "0"), ("--burst-gap-ms", "inf"),
    ("--burst-gap-ms", "1e300"), ("--burst-gap-ms", "nan"), ("--burst-gap-ms", "-1"),
    ("--max-num-seqs", "1000000000"), ("--seed", str(2**64)), ("--seed", "-1"),
    ("--port", "70000"), ("--port", "-1"), ("--distributed-timeout", "inf"),
    ("--distributed-timeout", "0"), ("--stuck-step-timeout", "inf"),
    ("--shutdown-timeout", "-1"), ("--tensor-parallel-size", "100000"),
    ("--max-model-len", str(2**40)), ("--block-size", "0"), ("--num-blocks", str(2**31)),
    ("--kv-cache-memory", "0"), ("--gpu-memory-utilization", "1.5"),
    ("--gpu-memory-utilization", "nan"), ("--max-num-tokens", str(2**31)),
    ("--max-num-tokens", "0"), ("--verify-every", "-1"), ("--verify-tolerance", "inf"),
    ("--threads", "1.5"),
]


@pytest.mark.parametrize("flag, value", CASES)
def test_an_out_of_range_flag_is_refused_naming_it(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        serve.parse_args([flag, value])
    assert exit_info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


def test_threads_are_bounded_by_the_cores_this_process_may_use(capsys):
    bound = 4 * usable_cores()
    assert serve.parse_args(["--threads", str(bound)]).threads == bound
    with pytest.raises(SystemExit):
        serve.parse_args(["--threads", str(bound + 1)])
    assert f"must lie in [1, {bound}]" in capsys.readouterr().err


@pytest.mark.parametrize("parse_args", [serve.parse_args, generate.parse_args])
def test_no_numeric_flag_takes_a_bare_int_or_float(parse_args, monkeypatch):
    """A bare `type=int` or `type=float` accepts inf, nan or any size: each must be bounded."""
    parsers = []
    original = argparse.ArgumentParser.parse_args

    def keep(self, *args, **kwargs):
        parsers.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    parse_args([])
    bare = [action.option_strings[0] for action in parsers[0]._actions
            if action.type in (int, float)]
    assert bare == []


def test_a_burst_window_is_finite():
    with pytest.raises(ValueError, match=r"must lie in \[0, 1\] seconds, got inf"):
        BurstWindow(float("inf"))


def test_a_cache_no_machine_can_hold_is_refused_naming_the_flags_that_asked_for_it():
    args = serve.parse_args(["--preset", "tiny", "--graph-mode", "eager", "--block-size", "1",
                             "--max-model-len", "40000", "--max-num-seqs", "65536"])
    with pytest.raises(ValueError, match=r"--max-num-seqs 65536 x 40000 blocks of --max-model-len "
                       r"40000 = 2621440000 blocks: more than the 2147483647 block ids"):
        build_engine(args, serve.MODELS)
