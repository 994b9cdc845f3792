"""Real kvgraph debug dumps for the `kvgraph.inspect` tests, written by running a runner.

`make_dump(directory, mode, **config)` runs tests/support/scenario.py's tiny Llama runner with
`debug_dump_path=directory` and returns the directory.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.scenario import generate, make_runner


def make_dump(directory: Path, mode: str, **config) -> Path:
    """A runner's dump: compile, capture, the generation schedule, close (which writes stats)."""
    torch._dynamo.reset()
    runner = make_runner("llama", mode, debug_dump_path=str(directory), **config)
    try:
        runner.capture()
        generate(runner, runner.model.config.vocab_size)
    finally:
        runner.close()
        torch._dynamo.reset()
    return directory
