"""A process that built an engine exits without noise (examples/engine/startup_gc.py).

The engine freezes its start-up objects out of the garbage collector; the interpreter's last
collection skips frozen objects, so without the thaw at exit their cycles were never released
and Triton's nanobind bindings printed ~30 "leaked" lines at every exit.
"""

import importlib.util
import subprocess
import sys

import pytest

from tests.support.scripts import REPO, SCRIPT_ENV

# A cycle that only the interpreter's last collection can free; its finaliser reports it.
FROZEN_CYCLE = """
import os
from examples.engine.startup_gc import freeze_startup_objects

class Node:
    def __init__(self):
        self.other = self

    def __del__(self, write=os.write):
        write(1, b"released\\n")

node = Node()
freeze_startup_objects()
del node
"""


def test_a_cycle_frozen_at_start_up_is_released_at_exit():
    done = subprocess.run([sys.executable, "-c", FROZEN_CYCLE], cwd=REPO, env=SCRIPT_ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["released"]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="the leak reports came from Triton's bindings, which are not installed")
def test_the_demo_prints_nothing_at_exit():
    done = subprocess.run(
        [sys.executable, "examples/generate.py", "--preset", "tiny", "--graph-mode", "eager",
         "--max-model-len", "64", "--num-prompts", "1", "--max-new-tokens", "2"],
        cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "graph replays" in done.stdout.splitlines()[-1]  # the report ran to its end
    assert "nanobind" not in done.stderr and "leaked" not in done.stderr, done.stderr
