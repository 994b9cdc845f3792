"""Start-up objects frozen out of the garbage collector's scans (examples/engine/startup_gc.py)."""

import argparse
import gc
import socket

from examples.engine import add_engine_args, build_engine
from examples.engine.startup_gc import freeze_startup_objects
from examples.models import MODELS
from tests.support.measured import assert_measured


class Node:
    def __init__(self):
        self.other = self  # a reference cycle: only the cyclic collector frees it


def test_freezing_keeps_collecting_what_comes_after():
    survivor = Node()
    frozen = freeze_startup_objects()
    # Not equal: a frozen object whose last reference goes (another test's thread, a frame's
    # temporaries) leaves the permanent generation by reference counting.
    assert 0 < gc.get_freeze_count() <= frozen
    assert not any(o is survivor for o in gc.get_objects())  # out of every scanned generation
    Node()  # garbage made after the freeze: still found by a collection
    assert gc.collect() >= 1
    assert gc.get_freeze_count() > frozen // 2  # a collection does not thaw the frozen ones
    gc.unfreeze()
    assert any(o is survivor for o in gc.get_objects())  # handed back


def test_the_engine_freezes_after_start_up():
    gc.unfreeze()
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--preset", "tiny", "--graph-mode", "eager", "--max-model-len", "64"])
    engine, _ = build_engine(args, MODELS)
    try:
        assert gc.get_freeze_count() > 0
    finally:
        engine.runner.close()


def test_the_benchmark_times_both(tmp_path):
    from examples.benchmarks import startup_gc
    payload = startup_gc.main(["--preset", "tiny", "--graph-mode", "eager", "--max-model-len",
                               "128", "--batch-sizes", "2", "--rounds", "2", "--decode-base", "2",
                               "--decode-steps", "2", "--json", str(tmp_path / "gc.json")])
    (row,) = payload["results"]
    assert payload["frozen_objects"] > 0 and set(row["ms"]) == {"frozen", "unfrozen"}
    assert_measured(row["ms"].values())
    assert (tmp_path / "gc.json").exists()


def test_the_server_process_freezes_its_own_start_up_objects_before_serving(monkeypatch):
    """With the engine in a process of its own, the server's process (torch, the tokenizer,
    the app) froze nothing: a full collection there held requests back from the engine."""
    from types import SimpleNamespace

    import uvicorn

    import examples.serve as serve

    frozen_at_run = []
    monkeypatch.setattr(uvicorn.Server, "run",
                        lambda server, sockets=None: frozen_at_run.append(gc.get_freeze_count()))
    gc.unfreeze()
    engine = SimpleNamespace(tokenizer=None, on_fatal=None, fatal_error=None)
    with socket.socket() as listener:
        assert serve.serve(engine, serve.parse_args(["--model", "llama", "--preset", "tiny"]),
                           listener) is None
    assert frozen_at_run and frozen_at_run[0] > 0
