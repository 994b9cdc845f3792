"""Start-up says each stage as it begins and ends with where the time went
(examples/engine/startup_stages.py, build_engine)."""

import argparse
import logging

from examples.engine import add_engine_args, build_engine
from examples.models import MODELS

STAGES = ["load weights", "prepare weights", "size KV cache", "compile", "capture"]
# What each stage's first line says, in order; kvgraph's own lines fall between them.
SAYS = ["engine: loading the example 'llama' (tiny preset", "engine: preparing the weights",
        "engine: sizing the KV cache", "engine: compiling (piecewise graph mode, eager pieces)",
        "kvgraph: Dynamo traced the model; building", "kvgraph: pieces ready in",
        "engine: capturing graphs", "kvgraph: captured", "engine ready in"]


def test_each_stage_is_said_before_it_runs_and_timed_in_the_summary(caplog):
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--preset", "tiny", "--graph-mode", "piecewise", "--piece-compiler", "eager",
         "--max-model-len", "64"])
    with caplog.at_level(logging.INFO):
        engine, summary = build_engine(args, MODELS)
    engine.runner.close()
    messages = [record.getMessage() for record in caplog.records]
    said = [next(i for i, message in enumerate(messages) if message.startswith(line))
            for line in SAYS]
    assert said == sorted(said), messages

    assert list(summary["stages"]) == STAGES
    assert all(seconds >= 0 for seconds in summary["stages"].values())
    assert sum(summary["stages"].values()) <= summary["seconds"]
    ready = messages[said[-1]]
    for stage in STAGES:
        assert f"{stage} {summary['stages'][stage]:.1f} s" in ready
    compiled = summary["compile"]
    assert f"{compiled['builds']} piece builds compiled and {compiled['cache_hits']} loaded" in ready
