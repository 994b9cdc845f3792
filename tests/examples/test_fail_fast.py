"""The first hour of a new user, as the scripts themselves run it: a mistake in how
examples/serve.py or examples/generate.py is started is refused before anything is built, in one
line on stderr naming the flag, exit status 2 and no traceback; `serve.py --help` works without
the serve extra.

"Before anything is built" shows as what the process printed: serve.py logs at INFO, so a start
(the engine's process, a kernel build, the KV cache, a compile) would add lines; the one line
is all there is. The timeout is a guard against a hang, not a measurement.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from tests.support.scripts import REPO, SCRIPT_ENV

# Runs serve.py as `python examples/serve.py` would, with fastapi and uvicorn unimportable.
WITHOUT_SERVE_EXTRA = (
    "import runpy, sys\n"
    "sys.modules['fastapi'] = sys.modules['uvicorn'] = None  # import fails, as when missing\n"
    "sys.path.insert(0, 'examples')  # what running the file as a script does\n"
    "sys.argv = ['serve.py', *sys.argv[1:]]\n"
    "runpy.run_path('examples/serve.py', run_name='__main__')\n"
)


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *command], cwd=REPO, env=SCRIPT_ENV,
                          capture_output=True, text=True, timeout=120)


def refused(script: str, *flags: str) -> str:
    """The one line `script` refuses `flags` with, checked to be all it printed, exit 2."""
    result = run([f"examples/{script}", *flags])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{script}: error: ")
    return line.removeprefix(f"{script}: error: ")


@pytest.mark.parametrize("script", ["serve.py", "generate.py"])
def test_a_model_path_that_does_not_exist(script, tmp_path):
    assert refused(script, "--model", str(tmp_path / "llama-3-8b")).startswith(
        f"--model {tmp_path / 'llama-3-8b'}: no such directory; expected a local Hugging Face "
        "checkpoint directory or an example model")


def test_a_directory_without_config_json(tmp_path):
    assert refused("serve.py", "--model", str(tmp_path)) == (
        f"--model {tmp_path}: config.json is missing (a checkpoint directory holds config.json, "
        "*.safetensors weights and tokenizer.json)")


def test_a_config_json_that_is_not_json(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint, tmp_path / "checkpoint")
    (path / "config.json").write_text("{'architectures': ['LlamaForCausalLM']}")
    assert refused("generate.py", "--model", str(path)).startswith(
        f"--model {path}: config.json cannot be read as JSON: Expecting property name")


def test_an_architecture_these_examples_do_not_serve(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint, tmp_path / "checkpoint")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["PhiForCausalLM"]}))
    assert refused("serve.py", "--model", str(path)) == (
        f"--model {path}: config.json's architectures ['PhiForCausalLM'] are not served by these "
        "examples; supported: ['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM']")


def test_a_port_in_use():
    pytest.importorskip("uvicorn")  # or the missing serve extra is what is refused
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert refused("serve.py", "--preset", "tiny", "--port", str(port)) == (
            f"--port {port}: address already in use (host 127.0.0.1)")


@pytest.mark.parametrize("script, flags, line", [
    ("serve.py", ["--device", "cuda:1", "--tensor-parallel-size", "2"],
     "--device cuda:1 names one device, but 2 tensor-parallel ranks need one each"),
    ("generate.py", ["--preset", "tiny", "--capture-sizes", "100000"],
     "--capture-sizes 100000: capture_sizes must lie in [1, max_num_tokens="),
])
def test_flags_the_engine_would_refuse_once_built(script, flags, line):
    assert refused(script, *flags).startswith(line)


def test_help_needs_no_serve_extra():
    result = run(["-c", WITHOUT_SERVE_EXTRA, "--help"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--port" in result.stdout and "--model" in result.stdout


def test_serving_without_the_serve_extra_says_what_to_install():
    result = run(["-c", WITHOUT_SERVE_EXTRA, "--preset", "tiny"])
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.splitlines() == [
        "serve.py: error: the server needs fastapi, which does not import (import of fastapi "
        'halted; None in sys.modules): pip install -e ".[serve]"']
