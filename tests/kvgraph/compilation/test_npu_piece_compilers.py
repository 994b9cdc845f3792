"""The npugraph_ex and torchair piece compilers, against fakes of torch_npu's compile entry points.

The fakes do what the real backends do up to the device (read from torchair's sources,
npugraph_ex/npugraph_ex/npu_fx_compiler.py and configs/compiler_config.py, 2026-06): options
are set on the CompilerConfig by name (an unknown one is a ValueError), the piece goes through
aot_autograd keeping input mutations in the graph, and npugraph_ex runs
`post_grad_custom_pre_pass` on the ATen graph; then the ATen graph runs on the CPU. They refuse
options kvgraph must not pass, and record every build and every call. torch_npu itself is never
imported: `sys.modules` gets stand-ins for one test.
"""

from __future__ import annotations

import functools
import logging
import subprocess
import sys
import types

import pytest
import torch
from torch._functorch.aot_autograd import aot_module_simplified

import kvgraph
from kvgraph.compilation.counters import CompileCounters, compile_counters
from kvgraph.compilation.piece_compiler import make_piece_compiler
from kvgraph.errors import CompileError, ConfigError, PlatformError
from tests.support.scenario import assert_matches_eager, dynamo_capture, make_runner

pytestmark = pytest.mark.usefixtures("fresh_compile_state")
COMPILERS = ("npugraph_ex", "torchair")
LOGGER = "kvgraph.compilation.npu_piece_compilers"
# What kvgraph must pass npugraph_ex: no capture of its own, no input or output clones.
MUST = {"force_eager": True, "inplace_pass": False, "clone_input": False, "clone_output": False}


class FakeBackends:
    """Stand-ins for torch_npu, npugraph_ex and torchair; `builds` and `runs` record each."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.builds: list[dict] = []  # per build: compiler, options, the ATen code that runs
        self.runs: list[set[int]] = []  # per call of a build: its tensor arguments' addresses

    def install(self, monkeypatch) -> None:
        monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
        configs = {"npugraph_ex": self.npugraph_ex_config, "torchair": self.torchair_config}
        for name, config in configs.items():
            module = types.ModuleType(name)
            module.CompilerConfig = config
            module.get_npu_backend = functools.partial(self.get_npu_backend, name)
            monkeypatch.setitem(sys.modules, name, module)

    @staticmethod
    def npugraph_ex_config():  # npugraph_ex.CompilerConfig's defaults, for the options used
        return types.SimpleNamespace(force_eager=False, inplace_pass=True, clone_input=True,
                                     clone_output=False, post_grad_custom_pre_pass=None)

    @staticmethod
    def torchair_config():  # kvgraph sets nothing on it
        return types.SimpleNamespace(post_grad_custom_pre_pass=None)

    def get_npu_backend(self, name, *, compiler_config=None, custom_decompositions=None):
        return functools.partial(self.backend, name, compiler_config)

    def backend(self, name, config, gm, example_inputs, **kwargs):
        options = kwargs.get("options", {})
        for option, value in options.items():
            if not hasattr(config, option):
                raise ValueError(f"Invalid option '{option}'")
            setattr(config, option, value)
        if name == "npugraph_ex" and any(getattr(config, k) != v for k, v in MUST.items()):
            raise ValueError(f"kvgraph must pass {MUST}, got {options}")
        if self.fail:
            raise RuntimeError("the fake refuses to build\nsecond line")
        build = {"compiler": name, "options": dict(options), "code": None}
        self.builds.append(build)

        def fw_compiler(aten_gm, aten_inputs):
            if config.post_grad_custom_pre_pass is not None:
                config.post_grad_custom_pre_pass(aten_gm, aten_inputs, config)
            build["code"] = aten_gm.code

            def run(*args):
                self.runs.append({a.data_ptr() for a in args if isinstance(a, torch.Tensor)})
                return aten_gm(*args)
            return run

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw_compiler,
                                     keep_inference_input_mutations=True)


@pytest.fixture
def fakes(monkeypatch):
    backends = FakeBackends()
    backends.install(monkeypatch)
    return backends


def assert_built_without_fallbacks(fakes, name):
    assert fakes.builds and {b["compiler"] for b in fakes.builds} == {name}
    assert compile_counters.builds == len(fakes.builds) and compile_counters.build_fallbacks == 0
    assert compile_counters.cache_hits == 0


@pytest.mark.parametrize("name", COMPILERS)
def test_piecewise_logits_and_caches_match_eager(fakes, name):
    assert_matches_eager("llama", "piecewise", piece_compiler=name, compile_sizes=(4,))
    assert_built_without_fallbacks(fakes, name)
    # A general build and a static one (size 4) of each of the 3 distinct pieces.
    assert compile_counters.unique_pieces == 3 and len(fakes.builds) == 6
    expected = MUST if name == "npugraph_ex" else {}
    assert all(build["options"] == expected for build in fakes.builds)


@pytest.mark.parametrize("name", COMPILERS)
def test_a_whole_graph_gets_the_caches_as_inputs_and_writes_them(fakes, name):
    runner = assert_matches_eager("llama", "full_decode_only", piece_compiler=name)
    assert_built_without_fallbacks(fakes, name)
    (build,) = fakes.builds
    caches = {t.data_ptr() for cache in runner.kv_caches.values() for t in cache}
    assert fakes.runs and all(caches <= run for run in fakes.runs)
    if name == "npugraph_ex":  # kvgraph's pass: the op writes the caches, not a copy of them
        assert set(build["options"]) == {*MUST, "post_grad_custom_pre_pass"}
        assert "torch.ops.kvgraph.unified_attention.default(" in build["code"]
        assert "auto_functionalized" not in build["code"]


def test_the_compile_cache_is_skipped_and_said_once(fakes, caplog, tmp_path):
    config = kvgraph.CompilationConfig(piece_compiler="npugraph_ex", cache_dir=str(tmp_path))
    assert config.use_compile_cache and not config.uses_compile_cache
    with caplog.at_level(logging.INFO, logger=LOGGER):
        make_runner("llama", "piecewise", piece_compiler="npugraph_ex", compile_sizes=(2, 4),
                    cache_dir=str(tmp_path)).compile()
    said = [r for r in caplog.records if "keeps no artifacts kvgraph can cache" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, caplog.text
    assert "'npugraph_ex'" in said[0].getMessage() and len(fakes.builds) == 9
    assert list(tmp_path.iterdir()) == []


def test_the_dump_says_why_nothing_was_cached():
    from kvgraph.compilation.cache_key import why_no_cache as _why_no_cache

    config = kvgraph.CompilationConfig(piece_compiler="torchair")
    assert _why_no_cache(config) == "piece_compiler 'torchair' keeps no artifacts kvgraph can cache"
    assert _why_no_cache(config.replace(piece_compiler="eager")).endswith("builds nothing to keep")
    assert _why_no_cache(config.replace(use_compile_cache=False)) == "use_compile_cache is off"


def traced_piece():
    capture = dynamo_capture(lambda x: (x * 2 + 1,), torch.ones(3))
    return capture.gm, list(capture.args)


@pytest.mark.parametrize("name", COMPILERS)
def test_builds_are_reported_and_a_failed_one_runs_the_fx_code(monkeypatch, caplog, name):
    gm, inputs = traced_piece()
    FakeBackends().install(monkeypatch)
    records, counters = [], CompileCounters()
    built = make_piece_compiler(name, None, counters, on_build=records.append).compile(
        gm, inputs, "abc-general")
    torch.testing.assert_close(built(*inputs)[0], gm(*inputs)[0])
    assert built is not gm and [r.outcome for r in records] == ["built"]
    FakeBackends(fail=True).install(monkeypatch)
    compiler = make_piece_compiler(name, None, counters, on_build=records.append)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert compiler.compile(gm, inputs, "abc-general") is gm
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{name} could not build abc-general" in warning
    assert "the fake refuses to build (on_compile_error='raise'" in warning
    assert "second line" not in warning and records[-1].outcome == "fallback"
    assert counters.builds == 1 and counters.build_fallbacks == 1
    raising = make_piece_compiler(name, None, counters, on_error="raise")
    with pytest.raises(RuntimeError, match="the fake refuses to build"):
        raising.compile(gm, inputs, "abc-general")


@pytest.mark.parametrize("name", COMPILERS)
def test_without_torch_npu_the_runner_says_why_and_what_to_do(monkeypatch, name):
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(CompileError) as info:
        make_runner("llama", "piecewise", piece_compiler=name).compile()
    message = str(info.value)
    assert message.count("\n") == 0 and "PlatformError" in message
    assert f"piece_compiler {name!r}" in message and "torch_npu is not installed" in message
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in message


def test_a_torch_npu_without_the_toolkit_is_named(monkeypatch, tmp_path):
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text("raise OSError('libascendcl.so: cannot open shared "
                                         "object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    with pytest.raises(PlatformError) as info:
        make_piece_compiler("npugraph_ex", None, CompileCounters())
    message = str(info.value)
    assert "libascendcl.so" in message and "Ascend toolkit" in message
    assert "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in message and info.value.__cause__ is None


@pytest.mark.parametrize("name, other", [("npugraph_ex", "torchair"), ("torchair", "npugraph_ex")])
def test_a_torch_npu_without_the_compiler_names_the_other(fakes, monkeypatch, name, other):
    monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(PlatformError, match=f"does not provide {name} .*'{other}'"):
        make_piece_compiler(name, None, CompileCounters())


def test_the_config_and_the_flag_accept_them_and_list_the_choices():
    for name in COMPILERS:
        assert kvgraph.CompilationConfig(piece_compiler=name).piece_compiler == name
        args = kvgraph.add_cli_args(__import__("argparse").ArgumentParser()).parse_args(
            ["--piece-compiler", name])
        assert kvgraph.CompilationConfig.from_cli_args(args, environ={}).piece_compiler == name
    with pytest.raises(ConfigError) as info:
        kvgraph.CompilationConfig(piece_compiler="npugraph")
    assert str(info.value) == ("piece_compiler: 'npugraph' is not one of "
                               "['inductor', 'eager', 'npugraph_ex', 'torchair']")


def test_importing_kvgraph_and_configs_load_no_npu_module():
    code = ("import sys, kvgraph\n"
            "from kvgraph.compilation import backend, npu_piece_compilers\n"
            "for name in ('npugraph_ex', 'torchair'):\n"
            "    kvgraph.CompilationConfig(piece_compiler=name)\n"
            "loaded = {'torch_npu', 'npugraph_ex', 'torchair'} & set(sys.modules)\n"
            "assert not loaded, loaded\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
