"""Local Hugging Face checkpoints: a tiny random Llama written to disk, loaded and served.

The checkpoint is tests/support/checkpoints.py's `write_checkpoint`, which the server tests serve
too (the `checkpoint` fixture, tests/examples/conftest.py).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.engine.checkpoint import load_checkpoint
from examples.generate import main as generate_main
from examples.models import MODELS, Llama


def test_weights_and_tokenizer_load_as_written(checkpoint):
    model, tokenizer = load_checkpoint(checkpoint, MODELS, torch.float32, "cpu")
    config = json.loads((checkpoint / "config.json").read_text())
    written = Llama.from_hf(config, seed=3)
    for (name, got), (_, want) in zip(model.state_dict().items(), written.state_dict().items()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)
    text = "hello graphs, über alles"
    ids = tokenizer.encode(text)
    assert ids[0] == config["bos_token_id"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_ids == {config["eos_token_id"]}


def test_chat_template_renders_the_chat_prompt(checkpoint):
    _, tokenizer = load_checkpoint(checkpoint, MODELS, torch.float32, "cpu")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"
    assert tokenizer.render_chat(messages) == expected
    assert tokenizer.encode_chat(messages) == tokenizer.encode(expected, add_special_tokens=False)


def test_unsupported_or_incomplete_checkpoints_are_clear_errors(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHead"]}))
    with pytest.raises(NotImplementedError, match="GPT2LMHead"):
        load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")


def test_a_missing_or_unreadable_tokenizer_is_an_error_naming_the_file(checkpoint, tmp_path):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(checkpoint / name, tmp_path / name)
    file = tmp_path / "tokenizer.json"
    with pytest.raises(FileNotFoundError, match=f"checkpoint: {re.escape(str(file))} is missing"):
        load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")
    file.write_text('{"model": "not a tokenizer"}')
    with pytest.raises(ValueError, match=f"checkpoint: {re.escape(str(file))} is not a "
                       "tokenizer"):
        load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")


def test_generate_serves_a_checkpoint(checkpoint, capsys):
    assert generate_main(["--model", str(checkpoint), "--graph-mode", "piecewise",
                          "--piece-compiler", "eager", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "piecewise:" in out


def test_generate_as_a_script_needs_only_the_core_dependencies():
    # The README's quick start runs on a machine with torch, numpy, sympy and tqdm only.
    serving = ("fastapi", "uvicorn", "prometheus_client", "safetensors", "tokenizers")
    code = (
        "import runpy, sys\n"
        "sys.path.insert(0, 'examples')  # what running the file as a script does\n"
        "sys.argv = ['generate.py', '--preset', 'tiny', '--piece-compiler', 'eager',"
        " '--max-new-tokens', '3']\n"
        "try:\n    runpy.run_path('examples/generate.py', run_name='__main__')\n"
        "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
        f"print('LOADED', [m for m in {serving!r} if m in sys.modules])\n"
    )
    root = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "tokens/s" in result.stdout
    assert "LOADED []" in result.stdout
