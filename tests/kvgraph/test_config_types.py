"""CompilationConfig refuses values of the wrong type, empty capture sizes where graphs are
asked for, and a cache_dir that is no directory; strings are parsed only from options, the
environment and flags, and each error names the setting, what was expected and what came."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvgraph
from kvgraph import CompilationConfig, GraphMode
from kvgraph.config import default_cache_dir
from kvgraph.errors import ConfigError

GRAPH_MODES_WITH_GRAPHS = ["piecewise", "full", "full_decode_only", "full_and_piecewise"]


def make(**kwargs) -> CompilationConfig:
    kwargs.setdefault("cache_dir", "/tmp/kvgraph-test-cache")
    return CompilationConfig(**kwargs)


def refused(field: str, **kwargs) -> str:
    """The message of the ConfigError that `make(**kwargs)` raises for `field`."""
    with pytest.raises(ConfigError) as info:
        make(**kwargs)
    assert info.value.field == field
    return str(info.value)


# --- the constructor checks types --------------------------------------------------------------


@pytest.mark.parametrize("field, value, expected", [
    ("max_num_tokens", True, "int"),
    ("max_num_tokens", 64.0, "int"),
    ("max_num_tokens", "64", "int"),
    ("max_num_tokens", 0, "int >= 1"),
    ("capture_sizes", "12", "tuple or list of ints"),
    ("capture_sizes", 12, "tuple or list of ints"),
    ("capture_sizes", [1.5, 2], "ints"),
    ("capture_sizes", [True, 2], "ints"),
    ("capture_sizes", ["1", "2"], "ints"),
    ("compile_sizes", "4", "tuple or list of ints"),
    ("compile_sizes", None, "tuple or list of ints"),
    ("compile_sizes", [2.0], "ints"),
    ("use_compile_cache", "false", "True or False"),
    ("use_compile_cache", 0, "True or False"),
    ("check_guards", 1, "True or False"),
    ("check_graph_inputs", None, "True or False"),
    ("check_rank_agreement", "yes", "True or False"),
    ("piece_compiler", 3, "inductor"),
    ("piece_compiler", "Inductor", "inductor"),
    ("mode", None, "max-autotune"),
    ("splitting_ops", "kvgraph::unified_attention", "tuple or list of str"),
    ("splitting_ops", [1], "tuple or list of str"),
    ("passes", "noop_elimination", "tuple or list of str"),
    ("passes", [None], "tuple or list of str"),
    ("cache_dir", None, "path"),
    ("cache_dir", "", "path"),
    ("cache_dir", 3, "path"),
    ("cache_dir", b"/tmp/x", "path"),
    ("debug_dump_path", "", "path"),
    ("debug_dump_path", 1, "path"),
    ("graph_mode", 3, "GraphMode"),
    ("graph_mode", None, "GraphMode"),
    ("on_compile_error", "ignore", "raise"),
    ("on_compile_error", True, "raise"),
    ("verify", 1, "True or False"),
    ("verify", "yes", "True or False"),
    ("verify_every", -1, "int >= 0"),
    ("verify_every", 2.0, "int >= 0"),
    ("verify_every", True, "int >= 0"),
    ("verify_action", "ignore", "warn"),
    ("verify_tolerance", 0, "finite number > 0"),
    ("verify_tolerance", float("nan"), "finite number > 0"),
    ("verify_tolerance", "0.1", "finite number > 0"),
])
def test_wrong_type_refused_naming_field_expected_and_got(field, value, expected):
    message = refused(field, **{field: value})
    assert field in message and expected in message and repr(value) in message


def test_a_string_of_sizes_is_refused_and_pointed_at_the_parsers():
    message = refused("capture_sizes", capture_sizes="12")
    assert "'12' (str)" in message and "from_options" in message


def test_max_num_tokens_none_means_unset_from_every_source():
    assert make(max_num_tokens=None).max_num_tokens is None
    assert CompilationConfig.from_options({"max_num_tokens": None, "cache_dir": "/tmp/x"}
                                          ).max_num_tokens is None
    assert CompilationConfig.from_env({"KVGRAPH_CACHE_DIR": "/tmp/x"}).max_num_tokens is None
    args = kvgraph.add_cli_args(argparse.ArgumentParser()).parse_args([])
    assert CompilationConfig.from_cli_args(args, {"KVGRAPH_CACHE_DIR": "/tmp/x"}
                                           ).max_num_tokens is None


def test_refused_config_errors_are_value_errors():
    with pytest.raises(ValueError):
        make(max_num_tokens="64")


def test_right_types_are_normalised():
    import numpy as np

    config = make(max_num_tokens=np.int64(64), capture_sizes=range(1, 5),
                  compile_sizes={8, np.int32(2)}, splitting_ops=["kvgraph::unified_attention"],
                  passes=[], cache_dir=Path("/tmp/kv-path"), debug_dump_path=Path("/tmp/dump"))
    assert config.max_num_tokens == 64 and type(config.max_num_tokens) is int
    assert config.capture_sizes == (1, 2, 3, 4)
    assert config.compile_sizes == (2, 8) and all(type(s) is int for s in config.compile_sizes)
    assert config.splitting_ops == ("kvgraph::unified_attention",) and config.passes == ()
    assert config.cache_dir == "/tmp/kv-path" and config.debug_dump_path == "/tmp/dump"
    assert make(cache_dir="~/kv").cache_dir == os.path.expanduser("~/kv")


# --- strings are parsed only from options, environment and flags -------------------------------


def test_options_parse_strings_and_pass_other_values_to_the_checks():
    config = CompilationConfig.from_options({"capture_sizes": "12", "use_compile_cache": "false",
                                             "cache_dir": "/tmp/x"})
    assert config.capture_sizes == (12,) and config.use_compile_cache is False
    with pytest.raises(ConfigError, match=r"capture_sizes: expected ints, got 1\.5"):
        CompilationConfig.from_options({"capture_sizes": [1.5, 2], "cache_dir": "/tmp/x"})
    with pytest.raises(ConfigError, match="use_compile_cache: expected True or False, got 0"):
        CompilationConfig.from_options({"use_compile_cache": 0, "cache_dir": "/tmp/x"})


def test_env_error_names_the_variable():
    with pytest.raises(ConfigError) as info:
        CompilationConfig.from_env({"KVGRAPH_MAX_NUM_TOKENS": "1.5"})
    assert "max_num_tokens" in str(info.value) and "KVGRAPH_MAX_NUM_TOKENS" in str(info.value)
    with pytest.raises(ConfigError, match=r"KVGRAPH_ON_COMPILE_ERROR"):
        CompilationConfig.from_env({"KVGRAPH_ON_COMPILE_ERROR": "ignore"})


def test_on_compile_error_from_options_env_and_flag():
    assert CompilationConfig.from_options({"on_compile_error": "raise", "cache_dir": "/tmp/x"}
                                          ).on_compile_error == "raise"
    env = {"KVGRAPH_ON_COMPILE_ERROR": "raise", "KVGRAPH_CACHE_DIR": "/tmp/x"}
    assert CompilationConfig.from_env(env).on_compile_error == "raise"
    parser = kvgraph.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--on-compile-error", "raise"])
    assert CompilationConfig.from_cli_args(args, {"KVGRAPH_CACHE_DIR": "/tmp/x"}
                                           ).on_compile_error == "raise"
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--on-compile-error", "ignore"])
    assert info.value.code == 2  # argparse's usage error


# --- no capture sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("mode", GRAPH_MODES_WITH_GRAPHS)
def test_empty_capture_sizes_refused_where_graphs_are_asked_for(mode):
    message = refused("capture_sizes", graph_mode=mode, capture_sizes=())
    assert mode in message and "graph_mode='none'" in message and "eager" in message


@pytest.mark.parametrize("mode", ["eager", "none"])
def test_empty_capture_sizes_allowed_without_graphs(mode):
    config = make(graph_mode=mode, capture_sizes=[])
    assert config.capture_sizes == () and config.capture_size_list == ()


def test_empty_capture_sizes_refused_after_the_splitting_ops_downgrade():
    assert "'full'" in refused("capture_sizes", splitting_ops=(), capture_sizes=())


@pytest.mark.parametrize("text", [" , ", ",", ", ,,"])
def test_blank_capture_size_lists_from_options_env_and_flags_refused(text):
    with pytest.raises(ConfigError, match="capture_sizes is empty"):
        CompilationConfig.from_options({"capture_sizes": text, "cache_dir": "/tmp/x"})
    with pytest.raises(ConfigError, match="KVGRAPH_CAPTURE_SIZES"):
        CompilationConfig.from_env({"KVGRAPH_CAPTURE_SIZES": text, "KVGRAPH_CACHE_DIR": "/tmp/x"})
    args = kvgraph.add_cli_args(argparse.ArgumentParser()).parse_args(["--capture-sizes", text])
    with pytest.raises(ConfigError, match="--capture-sizes"):
        CompilationConfig.from_cli_args(args, {"KVGRAPH_CACHE_DIR": "/tmp/x"})
    config = CompilationConfig.from_env({"KVGRAPH_CAPTURE_SIZES": text, "KVGRAPH_GRAPH_MODE":
                                         "none", "KVGRAPH_CACHE_DIR": "/tmp/x"})
    assert config.capture_size_list == ()


def test_unset_capture_sizes_from_env_mean_the_default():
    for text in ("", "  ", "auto"):
        config = CompilationConfig.from_env({"KVGRAPH_CAPTURE_SIZES": text,
                                             "KVGRAPH_MAX_NUM_TOKENS": "8"})
        assert config.capture_sizes is None and config.capture_size_list == (1, 2, 4, 8)


# --- cache_dir ---------------------------------------------------------------------------------


@pytest.fixture
def default_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return default_cache_dir()


def test_cache_dir_none_or_blank_from_options_or_env_is_the_default(default_dir):
    assert CompilationConfig.from_options({"cache_dir": None}).cache_dir == default_dir
    assert CompilationConfig.from_options(cache_dir="").cache_dir == default_dir
    assert CompilationConfig.from_env({"KVGRAPH_CACHE_DIR": ""}).cache_dir == default_dir
    assert CompilationConfig.from_env({"KVGRAPH_CACHE_DIR": "   "}).cache_dir == default_dir
    args = kvgraph.add_cli_args(argparse.ArgumentParser()).parse_args(["--compile-cache-dir", ""])
    assert CompilationConfig.from_cli_args(args, {}).cache_dir == default_dir
    assert default_dir not in ("None", "", os.getcwd())


def test_cache_dir_that_is_a_file_refused_naming_its_source(tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    message = refused("cache_dir", cache_dir=str(a_file))
    assert str(a_file) in message and "not a directory" in message
    for settings_name in ("cache_dir", "--compile-cache-dir", "KVGRAPH_CACHE_DIR"):
        assert settings_name in message  # how to choose another
    with pytest.raises(ConfigError, match=r"\(from KVGRAPH_CACHE_DIR\)$"):
        CompilationConfig.from_env({"KVGRAPH_CACHE_DIR": str(a_file)})
    args = kvgraph.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--compile-cache-dir", str(a_file)])
    with pytest.raises(ConfigError, match=r"\(from --compile-cache-dir\)$"):
        CompilationConfig.from_cli_args(args, {})


def test_cache_dir_is_checked_only_where_the_cache_is_used(tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    for unused in ({"piece_compiler": "eager"}, {"use_compile_cache": False},
                   {"graph_mode": "eager"}):
        config = make(cache_dir=str(a_file), **unused)
        assert not config.uses_compile_cache
    assert make(cache_dir=str(tmp_path / "missing" / "dir")).uses_compile_cache


# --- property: whatever comes, the answer is a config or a ConfigError -------------------------

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.floats(allow_nan=False),
                 st.text(max_size=12), st.lists(st.one_of(st.integers(-3, 600), st.floats(),
                                                          st.booleans()), max_size=4))


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from([f for f in CompilationConfig.__dataclass_fields__
                              if f != "cache_dir"]), value=JUNK)
def test_any_value_gives_a_config_or_a_config_error(field, value):
    try:
        config = make(**{field: value})
    except ConfigError as error:
        assert error.field == field or error.field == "capture_sizes", (field, value, error)
        return
    assert isinstance(config.graph_mode, GraphMode)
    assert config.max_num_tokens is None or type(config.max_num_tokens) is int
    assert all(type(s) is int for s in config.capture_size_list + config.compile_sizes)


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(list(CompilationConfig.__dataclass_fields__)),
       text=st.text(max_size=12))
def test_any_env_string_gives_a_config_or_a_config_error_naming_the_variable(field, text):
    from kvgraph.config_sources import env_name

    environ = {"KVGRAPH_PIECE_COMPILER": "eager", env_name(field): text}
    try:
        CompilationConfig.from_env(environ)
    except ConfigError as error:
        assert env_name(error.field) in str(error), error
