"""On a terminal the scripts say they are starting before they import torch (seconds of
imports), so a person sees a line at once; off a terminal a mistake stays one line."""

import os
import re
import subprocess
import sys

import pytest

from tests.support.scripts import REPO, SCRIPT_ENV


def run_on_a_terminal(*argv: str) -> list[str]:
    """The lines a terminal shows while `python -X importtime argv...` runs to its end."""
    controller, terminal = os.openpty()
    with subprocess.Popen([sys.executable, "-X", "importtime", *argv], cwd=REPO,
                          env=SCRIPT_ENV, stdin=terminal, stdout=terminal,
                          stderr=terminal) as process:
        os.close(terminal)
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: the process has exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        process.wait(timeout=120)
    os.close(controller)
    return b"".join(chunks).decode(errors="replace").splitlines()


@pytest.mark.parametrize("script", ["generate.py", "serve.py"])
def test_a_terminal_hears_before_torch_is_imported(script, tmp_path):
    lines = run_on_a_terminal(f"examples/{script}", "--model", str(tmp_path / "missing"))
    starting = lines.index(f"{script}: starting (importing torch and kvgraph)")
    torch_imported = next(i for i, line in enumerate(lines)
                          if re.search(r"\|\s+torch\s*$", line))
    assert starting < torch_imported
    assert any(line.startswith(f"{script}: error: --model ") for line in lines[starting:])


def test_help_on_a_terminal_is_only_the_help():
    lines = run_on_a_terminal("examples/generate.py", "--help")
    assert not any("starting" in line for line in lines)
    assert any(line.startswith("usage: generate.py") for line in lines)
