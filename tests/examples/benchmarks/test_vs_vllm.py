"""The vLLM comparison's own logic, without vLLM: flags, medians and ratios, the table, the
checkpoint both engines read, and the version shim of vLLM's environment."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys

import pytest
import torch

from examples.benchmarks import vllm_env
from examples.benchmarks.vs_vllm import (PRESET, cpus_for, format_table, parse_args, summarize,
                                         write_checkpoint)
from examples.models.llama import PRESETS


def test_flags_pick_parts_dtypes_threads_and_rounds():
    args = parse_args(["--parts", "decode", "serve", "--dtypes", "float32", "--threads", "1",
                       "--rounds", "2", "--kvgraph-arg=--max-num-tokens=1024"])
    assert (args.parts, args.dtypes, args.threads, args.rounds) == (
        ["decode", "serve"], ["float32"], ["1"], 2)
    assert args.kvgraph_arg == ["--max-num-tokens=1024"] and args.graph_mode == "full"
    defaults = parse_args([])
    assert defaults.parts == ["decode", "prefill", "serve"] and defaults.parity


def test_parity_needs_float32_unless_switched_off(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--dtypes", "bfloat16"])
    assert "add float32 to --dtypes, or pass --no-parity" in capsys.readouterr().err
    assert parse_args(["--dtypes", "bfloat16", "--no-parity"]).dtypes == ["bfloat16"]
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])


def test_one_thread_is_one_cpu_and_all_is_every_allowed_cpu():
    assert len(cpus_for("1")) == 1
    assert cpus_for("all")[:1] == cpus_for("1") and len(cpus_for("all")) >= 1


def test_ratios_are_of_medians_and_know_which_way_is_better():
    samples = {"decode_b1_ms": {"kvgraph": [10.0, 30.0, 12.0], "vllm": [8.0, 100.0, 10.0]},
               "prefill_tok_s": {"kvgraph": [900.0], "vllm": [1000.0]}}
    decode, prefill = summarize(samples)
    assert (decode["kvgraph"], decode["vllm"], decode["ratio"]) == (12.0, 10.0, 1.2)
    assert not decode["higher_is_better"] and not decode["kvgraph_ahead"]
    assert prefill["ratio"] == 0.9 and prefill["higher_is_better"] and not prefill["kvgraph_ahead"]
    table = format_table("float32, threads 1", [decode, prefill])
    assert "| decode step, batch 1 (ms) | 12.00 | 10.00 | 1.20x | lower |" in table
    assert "| prefill 16x64 (tokens/s) | 900.00 | 1000.00 | 0.90x | higher |" in table


def test_the_checkpoint_loads_in_kvgraph_with_a_tokenizer_covering_the_vocabulary(tmp_path):
    from examples.engine.checkpoint import load_checkpoint
    from examples.models import MODELS

    path = write_checkpoint(tmp_path, seed=0)
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == PRESETS[PRESET]["vocab_size"]
    assert config["hidden_size"] == PRESETS[PRESET]["hidden_size"]
    model, tokenizer = load_checkpoint(path, MODELS, torch.float32, "cpu")
    assert tokenizer.tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.decode(tokenizer.encode("paged attention, über alles")) == \
        "paged attention, über alles"
    assert tokenizer.eos_token_ids == {config["eos_token_id"]}


def test_the_version_shim_answers_for_vllm(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setattr(vllm_env, "_site_packages", lambda root: site)
    vllm_env._write_version_shim(tmp_path, "0.32.0")
    monkeypatch.syspath_prepend(str(site))
    assert importlib.metadata.version("vllm") == "0.32.0+cpu"
    assert str(site) in sys.path


def test_vllm_runs_bound_to_the_settings_cpus_with_its_openmp_preloaded(tmp_path):
    env = vllm_env.VllmEnv(tmp_path, "0.32.0")
    assert env.python == tmp_path / "bin" / "python" and env.cli == tmp_path / "bin" / "vllm"
    assert env.environ([0, 1], preload=True)["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    assert env.environ([0], preload=True)["LD_PRELOAD"].split(":")[0] == \
        str(tmp_path / "lib" / "libiomp5.so")
    assert env.environ([0], preload=False).get("LD_PRELOAD") == os.environ.get("LD_PRELOAD")


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_turns_wait_until_the_other_engines_processes_stop_burning_a_core(tmp_path, monkeypatch):
    import subprocess
    import time

    from examples.benchmarks import quiet
    from examples.benchmarks.quiet import process_tree, wait_until_quiet
    # A parent that idles while its child spins, as vLLM's worker polls after a request. The
    # spin is 0.8 s of the child's own CPU time, not of the clock (on a loaded machine it gets
    # a share of a core, so it lasts longer, never shorter), and its end leaves a file.
    spun = tmp_path / "spun"
    spin = (f"import pathlib, time\nwhile time.process_time() < 0.8: pass\n"
            f"pathlib.Path({str(spun)!r}).touch()")
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               f"subprocess.run([sys.executable, '-c', {spin!r}]); "
                               "time.sleep(60)"])
    try:
        deadline = time.time() + 60
        while len(process_tree([parent.pid])) < 2 and time.time() < deadline:
            time.sleep(0.02)
        assert len(process_tree([parent.pid])) == 2  # the child is part of the tree
        # Quiet: not one CPU tick (10 ms) in a second. The benchmark's own window (a tenth of
        # a core over 0.2 s) is for a machine running nothing else; on a loaded one a spinning
        # process can get less than that share of a core, yet some of it every second.
        waited = wait_until_quiet([parent.pid], window_s=1.0, busy_share=0.01, timeout_s=60)
        assert spun.exists()  # it waited until the child's spin ended...
        assert waited < 60  # ...and stopped on a quiet window, not at its timeout

        class CountedWindows:
            """quiet.py's clock, counting the windows it waits."""
            perf_counter = staticmethod(time.perf_counter)

            def __init__(self):
                self.windows: list[float] = []

            def sleep(self, seconds: float) -> None:
                self.windows.append(seconds)
                time.sleep(seconds)

        clock = CountedWindows()
        monkeypatch.setattr(quiet, "time", clock)
        wait_until_quiet([parent.pid], window_s=0.2)
        assert clock.windows == [0.2]  # quiet now: one window
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")
def test_the_engine_not_being_timed_is_stopped_for_the_turn_and_resumed_after_it():
    import contextlib
    import subprocess
    import time

    from examples.benchmarks.quiet import cpu_seconds, paused, process_tree
    # A parent whose child spins: pausing the parent must stop the child too.
    spin = "while True: pass"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                               f"subprocess.run([sys.executable, '-c', {spin!r}])"])
    tree: set[int] = set()
    try:
        deadline = time.time() + 60
        while len(process_tree([parent.pid])) < 2 and time.time() < deadline:
            time.sleep(0.02)
        tree = process_tree([parent.pid])
        assert len(tree) == 2

        def used_in(seconds: float) -> float:
            before = cpu_seconds(tree)
            time.sleep(seconds)
            return cpu_seconds(tree) - before

        def spins() -> bool:
            """Whether the tree uses 0.2 s of CPU within a minute: a spinning process does at
            any share of a core a loaded machine leaves it, a stopped one never does."""
            before, deadline = cpu_seconds(tree), time.monotonic() + 60
            while cpu_seconds(tree) - before < 0.2:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.02)
            return True

        assert spins()
        with pytest.raises(RuntimeError), paused([parent.pid]):
            assert used_in(0.5) < 0.05  # stopped, child included
            raise RuntimeError("the timed turn failed")
        assert spins()  # resumed although the turn raised
    finally:
        for pid in tree | process_tree([parent.pid]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
        parent.wait()
