"""The entry points' start-up checks (examples/engine/preflight.py): each mistake a new user made
is refused, naming the flag, before anything is built; what only the build can find is one line
too; a genuine bug still raises.

Checkpoints are the `checkpoint` fixture's (tests/support/checkpoints.py), or configs written by
transformers' own `save_pretrained`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import sys

import pytest

from examples import generate, serve
from examples.engine.preflight import UsageError, bind, check_start, require
from examples.models import MODELS

TINY = ["--preset", "tiny", "--max-model-len", "64"]


def refusal(*flags: str) -> str:
    """The message check_start refuses `flags` with (it must refuse them)."""
    with pytest.raises(UsageError) as info:
        check_start(generate.parse_args(list(flags)), MODELS)
    return str(info.value)


@pytest.fixture
def no_kvgraph_env(monkeypatch):
    for name in [name for name in os.environ if name.startswith("KVGRAPH_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    """A copy of the checkpoint's files, less those named."""
    def copy(*without: str):
        target = tmp_path / "copy"
        shutil.copytree(checkpoint, target,
                        ignore=lambda _, names: [n for n in names if n in without])
        return target
    return copy


def test_what_the_scripts_run_by_default_passes(checkpoint, no_kvgraph_env):
    for flags in ([], TINY, ["--model", "mla", *TINY], ["--model", str(checkpoint)]):
        check_start(serve.parse_args(flags), MODELS)


def test_a_model_that_is_neither_an_example_nor_a_directory(tmp_path):
    assert refusal("--model", str(tmp_path / "nowhere")) == (
        f"--model {tmp_path / 'nowhere'}: no such directory; expected a local Hugging Face "
        "checkpoint directory or an example model, one of ['deepseek_mla', 'llama', 'mla']")
    (tmp_path / "file").write_text("")
    assert refusal("--model", str(tmp_path / "file")).startswith(
        f"--model {tmp_path / 'file'}: not a directory;")


def test_an_unknown_preset_names_the_model_s_presets():
    assert refusal("--model", "mla", "--preset", "huge") == (
        f"--preset huge: expected a preset of the example model 'mla', one of "
        f"{sorted(MODELS['mla'].presets)}")


def test_a_directory_without_config_json(tmp_path):
    assert refusal("--model", str(tmp_path)) == (
        f"--model {tmp_path}: config.json is missing (a checkpoint directory holds config.json, "
        "*.safetensors weights and tokenizer.json)")


@pytest.mark.parametrize("text, why", [
    ("{'architectures': ['LlamaForCausalLM']}", "cannot be read as JSON: Expecting property name"),
    ('["LlamaForCausalLM"]', "holds a JSON list, not an object"),
    ("\udcff", "cannot be read as JSON"),
])
def test_a_config_json_that_is_not_a_json_object(tmp_path, text, why):
    (tmp_path / "config.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    assert refusal("--model", str(tmp_path)).startswith(f"--model {tmp_path}: config.json {why}")


def test_an_architecture_these_examples_do_not_serve(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1)
    config.save_pretrained(tmp_path)  # on its own: no architectures
    assert refusal("--model", str(tmp_path)) == (
        f"--model {tmp_path}: config.json names no architecture (model_type 'gpt2'); supported: "
        "['LlamaForCausalLM', 'MistralForCausalLM', 'Qwen2ForCausalLM']")
    config.architectures = ["GPT2LMHeadModel"]  # as a model's save_pretrained writes it
    config.save_pretrained(tmp_path)
    assert refusal("--model", str(tmp_path)) == (
        f"--model {tmp_path}: config.json's architectures ['GPT2LMHeadModel'] are not served by "
        "these examples; supported: ['LlamaForCausalLM', 'MistralForCausalLM', "
        "'Qwen2ForCausalLM']")


def test_a_served_architecture_with_a_setting_its_model_does_not_implement(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, hidden_act="gelu")
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(tmp_path)
    assert refusal("--model", str(tmp_path)) == (
        f"--model {tmp_path}: LlamaConfig: hidden_act='gelu' is not implemented by this example "
        "model; only 'silu' is supported")


def test_weights_only_as_pytorch_pickles(copy_of):
    path = copy_of("model.safetensors")
    (path / "pytorch_model.bin").write_bytes(b"")
    assert refusal("--model", str(path)) == (
        f"--model {path}: no *.safetensors weights file (a checkpoint directory holds "
        "config.json, *.safetensors weights and tokenizer.json); pytorch_model.bin: PyTorch "
        "pickle weights, not read")


def test_no_tokenizer_json(copy_of):
    path = copy_of("tokenizer.json")
    assert refusal("--model", str(path)).startswith(f"--model {path}: tokenizer.json is missing")


def test_a_broken_generation_config(copy_of):
    path = copy_of()
    (path / "generation_config.json").write_text("{")
    assert refusal("--model", str(path)).startswith(
        f"--model {path}: generation_config.json cannot be read as JSON")


def test_a_checkpoint_without_the_packages_that_read_it(checkpoint, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)
    assert refusal("--model", str(checkpoint)).startswith(
        f"--model {checkpoint}: reading a checkpoint needs safetensors, which does not import")


def test_the_serve_extra_is_named_when_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(UsageError) as info:
        require(("fastapi", "uvicorn"), "the server")
    assert str(info.value) == ("the server needs uvicorn, which does not import (import of "
                               'uvicorn halted; None in sys.modules): pip install -e ".[serve]"')


def test_a_tensor_parallel_size_other_than_torchrun_s(monkeypatch):
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    assert refusal("--tensor-parallel-size", "3").startswith(
        "--tensor-parallel-size 3 does not match torchrun's WORLD_SIZE=2")


def test_one_device_for_several_ranks():
    assert refusal("--device", "cuda:1", "--tensor-parallel-size", "2").startswith(
        "--device cuda:1 names one device, but 2 tensor-parallel ranks need one each")


def test_a_device_kvgraph_has_no_platform_for():
    assert refusal("--device", "tpu") == ("--device tpu: no kvgraph platform for device 'tpu'; "
                                          "have cpu, cuda, npu")


def test_an_accelerator_this_process_does_not_see():
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert refusal("--device", f"cuda:{count}").startswith(
        f"--device cuda:{count}: device cuda:{count}: this process sees {count} cuda device(s)")


def test_kvgraph_s_own_checks_name_the_flag_or_variable(monkeypatch, no_kvgraph_env):
    # Past the CPU's token budget (a device default, so kvgraph's message names no flag).
    assert refusal("--capture-sizes", "100000").startswith(
        "--capture-sizes 100000: capture_sizes must lie in [1, max_num_tokens=")
    assert refusal("--capture-sizes", "1,x").endswith(
        "(from --capture-sizes): expected comma-separated integers, got '1,x'")
    monkeypatch.setenv("KVGRAPH_GRAPH_MODE", "fastest")
    message = refusal()
    assert message.startswith("unknown graph_mode 'fastest'") and "KVGRAPH_GRAPH_MODE" in message


def test_a_debug_dump_under_a_file(tmp_path, no_kvgraph_env):
    (tmp_path / "file").write_text("")
    assert refusal("--debug-dump-path", str(tmp_path / "file" / "dump")) == (
        f"--debug-dump-path {tmp_path / 'file' / 'dump'}: expected a directory this user may "
        f"write (or make), but {tmp_path / 'file'} is a file")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write any directory")
def test_a_debug_dump_in_a_read_only_directory(tmp_path, no_kvgraph_env):
    tmp_path.chmod(0o500)
    try:
        assert refusal("--debug-dump-path", str(tmp_path / "a" / "b")).endswith(
            f"but {tmp_path} is not writable")
    finally:
        tmp_path.chmod(0o700)


def test_a_port_in_use_is_refused_naming_the_port_and_host():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(UsageError) as info:
            bind("127.0.0.1", port)
    assert str(info.value) == f"--port {port}: address already in use (host 127.0.0.1)"


def test_a_host_that_is_not_this_machine_s():
    with pytest.raises(UsageError) as info:
        bind("192.0.2.1", 0)  # TEST-NET-1: never a local address
    assert str(info.value) == ("--host 192.0.2.1: not an address of this machine (cannot assign "
                               "requested address)")
    assert os.strerror(errno.EADDRNOTAVAIL).lower() == "cannot assign requested address"


def test_port_zero_binds_a_free_port_for_the_server():
    with bind("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))


# --- the checks run before anything is built -------------------------------------------------

def never(*args, **kwargs):
    raise AssertionError("the engine was built before the flags were checked")


def test_serve_refuses_a_bad_model_before_starting_the_engine(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(serve, "start_engine", never)
    with pytest.raises(SystemExit) as info:
        serve.main(["--model", str(tmp_path)])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"serve.py: error: --model {tmp_path}: config.json is missing (a checkpoint directory "
        "holds config.json, *.safetensors weights and tokenizer.json)"]


def test_serve_refuses_a_port_in_use_before_starting_the_engine(monkeypatch, capsys):
    pytest.importorskip("uvicorn")  # or the missing serve extra is what is refused
    monkeypatch.setattr(serve, "start_engine", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            serve.main([*TINY, "--port", str(port)])
    assert info.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"serve.py: error: --port {port}: address already in use (host 127.0.0.1)"]


def test_generate_refuses_a_bad_flag_before_building_the_engine(monkeypatch, capsys):
    monkeypatch.setattr(generate, "build_engine", never)
    with pytest.raises(SystemExit) as info:
        generate.main(["--device", "tpu"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines() == [
        "generate.py: error: --device tpu: no kvgraph platform for device 'tpu'; have cpu, "
        "cuda, npu"]


def test_generate_says_in_one_line_what_only_the_build_finds(copy_of, capsys):
    path = copy_of()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    assert generate.main(["--model", str(path), "--graph-mode", "eager"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("generate.py: cannot start: model.layers.0.mlp.")  # the first
    assert ".weight: expected the shape (" in line and "96" in line and "128" in line


def test_a_genuine_bug_while_building_still_raises(monkeypatch):
    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(generate, "build_engine", bug)
    with pytest.raises(ZeroDivisionError):
        generate.main(TINY)
