"""CompilationConfig and GraphMode: defaults, capture sizes, validation, options, env and CLI."""

from __future__ import annotations

import argparse
import dataclasses
import os

import pytest

import kvgraph
from kvgraph import CompilationConfig, GraphMode
from kvgraph.config import DEFAULT_MAX_NUM_TOKENS

ALL_MODES = ["eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]
FIELDS = [
    "graph_mode", "max_num_tokens", "capture_sizes", "compile_sizes", "num_speculative_tokens",
    "piece_compiler",
    "splitting_ops", "passes", "mode", "use_compile_cache", "cache_dir", "debug_dump_path",
    "check_guards", "check_graph_inputs", "check_rank_agreement", "on_compile_error", "verify",
    "verify_every", "verify_action", "verify_tolerance",
]


def make(**kwargs) -> CompilationConfig:
    """A config with a fixed cache_dir, so equality does not depend on the environment."""
    kwargs.setdefault("cache_dir", "/tmp/kvgraph-test-cache")
    return CompilationConfig(**kwargs)


# --- GraphMode ---------------------------------------------------------------------------------


def test_graph_mode_members_and_values():
    assert {m.name: m.value for m in GraphMode} == {
        "EAGER": "eager",
        "NONE": "none",
        "PIECEWISE": "piecewise",
        "FULL": "full",
        "FULL_DECODE_ONLY": "full_decode_only",
        "FULL_AND_PIECEWISE": "full_and_piecewise",
    }


@pytest.mark.parametrize("text, expected", [
    ("piecewise", GraphMode.PIECEWISE),
    ("PIECEWISE", GraphMode.PIECEWISE),
    ("Full_Decode_Only", GraphMode.FULL_DECODE_ONLY),
    ("none", GraphMode.NONE),
    (GraphMode.FULL, GraphMode.FULL),
])
def test_graph_mode_parse(text, expected):
    assert GraphMode.parse(text) is expected


# Each predicate and the modes it is true for, by name: anything else must make it false.
PREDICATES = {
    "compiles": {"none", "piecewise", "full", "full_decode_only", "full_and_piecewise"},
    "has_graphs": {"piecewise", "full", "full_decode_only", "full_and_piecewise"},
    "has_full_graphs": {"full", "full_decode_only", "full_and_piecewise"},
    "has_piecewise_graphs": {"piecewise", "full_and_piecewise"},
    "only_full_graphs": {"full", "full_decode_only"},
    "is_runtime_mode": {"none", "piecewise", "full"},
}


@pytest.mark.parametrize("predicate", sorted(PREDICATES))
def test_graph_mode_predicate_is_true_for_exactly_its_modes(predicate):
    assert {m.value for m in GraphMode if getattr(m, predicate)} == PREDICATES[predicate]
    assert all(type(getattr(m, predicate)) is bool for m in GraphMode)


def test_graph_mode_parse_unknown_lists_valid_modes():
    with pytest.raises(ValueError) as info:
        GraphMode.parse("cudagraph")
    message = str(info.value)
    assert "graph_mode" in message and "cudagraph" in message
    for mode in ALL_MODES:
        assert mode in message


# --- defaults ----------------------------------------------------------------------------------


def test_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    config = CompilationConfig()
    assert [f.name for f in dataclasses.fields(CompilationConfig)] == FIELDS
    assert config.graph_mode is GraphMode.PIECEWISE
    assert config.max_num_tokens is None
    assert config.capture_sizes is None
    assert config.compile_sizes == ()
    assert config.piece_compiler == "inductor"
    assert config.splitting_ops == (
        "kvgraph::unified_attention",
        "kvgraph::unified_mla_attention",
        "kvgraph::encoder_attention",
    )
    assert config.passes == ("noop_elimination",)
    assert config.mode == "default"
    assert config.use_compile_cache is True
    assert config.cache_dir == os.path.join(str(tmp_path), "kvgraph")
    assert config.debug_dump_path is None
    assert config.check_guards is False
    assert config.check_graph_inputs is False
    assert config.check_rank_agreement is False
    assert config.on_compile_error == "eager"
    assert (config.verify, config.verify_every, config.verify_action) == (False, 0, "warn")
    assert config.verify_tolerance is None
    assert config.inductor_options == {}


def test_default_capture_size_list_for_default_max():
    expected = (1, 2, 4) + tuple(range(8, 513, 8))
    assert make().capture_size_list == expected
    assert expected[-1] == 512 and len(expected) == 67
    assert DEFAULT_MAX_NUM_TOKENS == 512
    assert make(max_num_tokens=DEFAULT_MAX_NUM_TOKENS).capture_size_list == expected


@pytest.mark.parametrize("max_num_tokens, expected", [
    (1, (1,)),
    (2, (1, 2)),
    (3, (1, 2, 3)),
    (4, (1, 2, 4)),
    (5, (1, 2, 4, 5)),
    (8, (1, 2, 4, 8)),
    (20, (1, 2, 4, 8, 16, 20)),
    (24, (1, 2, 4, 8, 16, 24)),
    (33, (1, 2, 4, 8, 16, 24, 32, 33)),
])
def test_default_capture_size_list_small_max(max_num_tokens, expected):
    assert make(max_num_tokens=max_num_tokens).capture_size_list == expected


def test_default_capture_sizes_stop_at_512_whatever_max_num_tokens():
    assert make(max_num_tokens=8192).capture_size_list == make().capture_size_list
    assert make(max_num_tokens=8192).capture_size_list[-1] == 512
    assert make(max_num_tokens=516).capture_size_list[-2:] == (504, 512)


def test_user_capture_sizes_sorted_and_deduplicated():
    config = make(max_num_tokens=64, capture_sizes=[16, 1, 4, 16, 2, 64])
    assert config.capture_sizes == (1, 2, 4, 16, 64)
    assert config.capture_size_list == (1, 2, 4, 16, 64)
    assert make(compile_sizes=[8, 1, 8]).compile_sizes == (1, 8)


# --- validation --------------------------------------------------------------------------------


def test_unknown_graph_mode_rejected():
    with pytest.raises(ValueError) as info:
        make(graph_mode="cuda_graphs")
    message = str(info.value)
    assert "graph_mode" in message and "cuda_graphs" in message
    for mode in ALL_MODES:
        assert mode in message


@pytest.mark.parametrize("field", ["capture_sizes", "compile_sizes"])
@pytest.mark.parametrize("bad", [0, 65, -1])
def test_sizes_out_of_range_rejected(field, bad):
    with pytest.raises(ValueError) as info:
        make(max_num_tokens=64, **{field: (1, bad)})
    message = str(info.value)
    assert field in message
    assert "64" in message  # the upper bound of the valid range
    assert str(bad) in message


def test_size_equal_to_max_accepted():
    assert make(max_num_tokens=64, capture_sizes=(64,)).capture_size_list == (64,)


def test_max_num_tokens_must_be_positive():
    with pytest.raises(ValueError, match="max_num_tokens"):
        make(max_num_tokens=0)


def test_unset_max_num_tokens_bounds_sizes_only_from_below():
    config = make(capture_sizes=(1, 4096), compile_sizes=(8192,))
    assert config.max_num_tokens is None and config.capture_size_list == (1, 4096)
    for field in ("capture_sizes", "compile_sizes"):
        with pytest.raises(ValueError, match=rf"^{field} must be >= 1, got \[-1, 0\]$"):
            make(**{field: (-1, 0, 1)})


def test_unknown_piece_compiler_rejected():
    with pytest.raises(ValueError) as info:
        make(piece_compiler="tvm")
    message = str(info.value)
    assert "piece_compiler" in message and "tvm" in message
    assert "inductor" in message and "eager" in message


def test_unknown_pass_rejected():
    with pytest.raises(ValueError) as info:
        make(passes=("noop_elimination", "fuse_everything"))
    message = str(info.value)
    assert "passes" in message and "fuse_everything" in message
    assert "noop_elimination" in message


def test_empty_pass_list_allowed():
    assert make(passes=()).passes == ()


@pytest.mark.parametrize("bad", ["unified_attention", "kvgraph.unified_attention", "a::b::c"])
def test_bad_splitting_op_name_rejected(bad):
    with pytest.raises(ValueError) as info:
        make(splitting_ops=("kvgraph::unified_attention", bad))
    message = str(info.value)
    assert "splitting_ops" in message and bad in message
    assert "namespace::op" in message


@pytest.mark.parametrize("bad", ["kvgraph::", "::unified_attention", "kvgraph::unified_attention.default"])
def test_splitting_op_with_empty_part_or_overload_rejected(bad):
    with pytest.raises(ValueError, match="splitting_ops"):
        make(splitting_ops=(bad,))


def test_splitting_ops_list_becomes_tuple():
    config = make(splitting_ops=["kvgraph::unified_attention"])
    assert config.splitting_ops == ("kvgraph::unified_attention",)


def test_unknown_torch_compile_mode_rejected():
    with pytest.raises(ValueError) as info:
        make(mode="fastest")
    message = str(info.value)
    assert "mode" in message and "fastest" in message
    for mode in ("default", "max-autotune", "max-autotune-no-cudagraphs"):
        assert mode in message


# --- from_options ------------------------------------------------------------------------------


def test_from_options_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError) as info:
        CompilationConfig.from_options({"grpah_mode": "full"})
    message = str(info.value)
    assert "grpah_mode" in message
    for field in FIELDS:
        assert field in message


def test_from_options_parses_strings():
    config = CompilationConfig.from_options({
        "graph_mode": "FULL_AND_PIECEWISE",
        "max_num_tokens": "64",
        "capture_sizes": "4, 1,2,4",
        "compile_sizes": "1,2,4",
        "splitting_ops": "kvgraph::unified_attention,kvgraph::unified_mla_attention",
        "passes": "",
        "use_compile_cache": "off",
        "check_guards": "1",
        "debug_dump_path": "/tmp/dumps",
        "cache_dir": "/tmp/cc",
    })
    assert config.graph_mode is GraphMode.FULL_AND_PIECEWISE
    assert config.max_num_tokens == 64
    assert config.capture_sizes == (1, 2, 4)
    assert config.compile_sizes == (1, 2, 4)
    assert config.splitting_ops == ("kvgraph::unified_attention", "kvgraph::unified_mla_attention")
    assert config.passes == ()
    assert config.use_compile_cache is False
    assert config.check_guards is True
    assert config.debug_dump_path == "/tmp/dumps"
    assert config.cache_dir == "/tmp/cc"


@pytest.mark.parametrize("text, expected", [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("Off", False),
    (True, True), (False, False),
])
def test_from_options_boolean_strings(text, expected):
    config = CompilationConfig.from_options({"use_compile_cache": text, "check_guards": text,
                                             "cache_dir": "/tmp/x"})
    assert config.use_compile_cache is expected
    assert config.check_guards is expected


def test_from_options_bad_boolean_rejected():
    with pytest.raises(ValueError, match="use_compile_cache"):
        CompilationConfig.from_options({"use_compile_cache": "maybe"})


def test_from_options_bad_sizes_rejected():
    with pytest.raises(ValueError, match="capture_sizes"):
        CompilationConfig.from_options({"capture_sizes": "1,two,4"})


def test_from_options_auto_capture_sizes_means_default():
    config = CompilationConfig.from_options({"capture_sizes": "auto", "max_num_tokens": "20",
                                             "cache_dir": "/tmp/x"})
    assert config.capture_sizes is None
    assert config.capture_size_list == (1, 2, 4, 8, 16, 20)


def test_from_options_overrides_win():
    config = CompilationConfig.from_options({"graph_mode": "full", "cache_dir": "/tmp/x"},
                                            graph_mode="eager")
    assert config.graph_mode is GraphMode.EAGER


def test_from_options_none_is_default():
    assert CompilationConfig.from_options(None, cache_dir="/tmp/x") == make(cache_dir="/tmp/x")


# --- from_env ----------------------------------------------------------------------------------


def test_from_env_reads_kvgraph_variables():
    environ = {
        "KVGRAPH_GRAPH_MODE": "Full",
        "KVGRAPH_MAX_NUM_TOKENS": "32",
        "KVGRAPH_CAPTURE_SIZES": "1,2,4",
        "KVGRAPH_COMPILE_SIZES": "4",
        "KVGRAPH_PIECE_COMPILER": "eager",
        "KVGRAPH_MODE": "max-autotune",
        "KVGRAPH_USE_COMPILE_CACHE": "false",
        "KVGRAPH_CACHE_DIR": "/tmp/kv-cache",
        "KVGRAPH_DEBUG_DUMP": "/tmp/kv-dump",
        "KVGRAPH_CHECK_GUARDS": "yes",
        "KVGRAPH_PASSES": "noop_elimination",
        "KVGRAPH_SPLITTING_OPS": "kvgraph::unified_attention",
        # unrelated variables are ignored
        "PATH": "/usr/bin",
        "HOME": "/root",
        "MY_KVGRAPH_GRAPH_MODE": "eager",
        "GRAPH_MODE": "eager",
    }
    config = CompilationConfig.from_env(environ)
    assert config == CompilationConfig(
        graph_mode=GraphMode.FULL, max_num_tokens=32, capture_sizes=(1, 2, 4),
        compile_sizes=(4,), piece_compiler="eager", mode="max-autotune",
        use_compile_cache=False, cache_dir="/tmp/kv-cache", debug_dump_path="/tmp/kv-dump",
        check_guards=True, passes=("noop_elimination",),
        splitting_ops=("kvgraph::unified_attention",),
    )


def test_from_env_empty_environment_gives_defaults(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert CompilationConfig.from_env({"PATH": "/bin", "OTHER": "x"}) == CompilationConfig()


def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("KVGRAPH_GRAPH_MODE", "full_decode_only")
    monkeypatch.setenv("KVGRAPH_CACHE_DIR", "/tmp/from-os-environ")
    config = CompilationConfig.from_env()
    assert config.graph_mode is GraphMode.FULL_DECODE_ONLY
    assert config.cache_dir == "/tmp/from-os-environ"


def test_from_env_invalid_value_names_field():
    with pytest.raises(ValueError) as info:
        CompilationConfig.from_env({"KVGRAPH_GRAPH_MODE": "warp"})
    assert "graph_mode" in str(info.value) and "warp" in str(info.value)


# --- CLI ---------------------------------------------------------------------------------------


def parse(argv):
    parser = kvgraph.add_cli_args(argparse.ArgumentParser())
    return parser.parse_args(argv)


def test_cli_flags_parsed():
    args = parse(["--graph-mode", "full", "--max-num-tokens", "128", "--capture-sizes", "8,1,4,4",
                  "--compile-sizes", "1,8", "--piece-compiler", "eager",
                  "--compile-cache-dir", "/tmp/cli-cache", "--debug-dump-path", "/tmp/cli-dump",
                  "--check-guards"])
    config = CompilationConfig.from_cli_args(args, {})
    assert config.graph_mode is GraphMode.FULL
    assert config.max_num_tokens == 128
    assert config.capture_sizes == (1, 4, 8)
    assert config.compile_sizes == (1, 8)
    assert config.piece_compiler == "eager"
    assert config.cache_dir == "/tmp/cli-cache"
    assert config.debug_dump_path == "/tmp/cli-dump"
    assert config.check_guards is True
    assert config.use_compile_cache is True


def test_cli_flags_override_env_and_env_fills_the_rest():
    environ = {
        "KVGRAPH_GRAPH_MODE": "full",
        "KVGRAPH_MAX_NUM_TOKENS": "64",
        "KVGRAPH_USE_COMPILE_CACHE": "1",
        "KVGRAPH_DEBUG_DUMP": "/tmp/env-dump",
        "KVGRAPH_CACHE_DIR": "/tmp/env-cache",
    }
    args = parse(["--graph-mode", "eager", "--no-compile-cache", "--capture-sizes", "2,1"])
    config = CompilationConfig.from_cli_args(args, environ)
    assert config.graph_mode is GraphMode.EAGER  # flag beats env
    assert config.use_compile_cache is False  # flag beats env
    assert config.capture_sizes == (1, 2)  # flag only
    assert config.max_num_tokens == 64  # env only
    assert config.debug_dump_path == "/tmp/env-dump"  # env only
    assert config.cache_dir == "/tmp/env-cache"  # env only


def test_verify_settings_from_flags_and_environment():
    args = parse(["--verify", "--verify-every", "16", "--verify-action", "raise",
                  "--verify-tolerance", "0.01"])
    config = CompilationConfig.from_cli_args(args, {})
    assert (config.verify, config.verify_every, config.verify_action) == (True, 16, "raise")
    assert config.verify_tolerance == 0.01
    config = CompilationConfig.from_env({"KVGRAPH_VERIFY": "1", "KVGRAPH_VERIFY_EVERY": "4",
                                         "KVGRAPH_VERIFY_TOLERANCE": "1e-3"})
    assert (config.verify, config.verify_every, config.verify_tolerance) == (True, 4, 1e-3)
    with pytest.raises(kvgraph.ConfigError, match="KVGRAPH_VERIFY_EVERY"):
        CompilationConfig.from_env({"KVGRAPH_VERIFY_EVERY": "-2"})


def test_cli_no_compile_cache_without_env():
    config = CompilationConfig.from_cli_args(parse(["--no-compile-cache"]), {})
    assert config.use_compile_cache is False
    config = CompilationConfig.from_cli_args(parse(["--compile-cache"]),
                                             {"KVGRAPH_USE_COMPILE_CACHE": "0"})
    assert config.use_compile_cache is True


def test_cli_nothing_given_equals_env_config():
    environ = {"KVGRAPH_GRAPH_MODE": "none", "KVGRAPH_CACHE_DIR": "/tmp/e"}
    assert CompilationConfig.from_cli_args(parse([]), environ) == \
        CompilationConfig.from_env(environ)


def test_cli_rejects_unknown_graph_mode(capsys):
    with pytest.raises(SystemExit) as info:
        parse(["--graph-mode", "turbo"])
    assert info.value.code == 2  # argparse's usage error
    error = capsys.readouterr().err
    assert "--graph-mode" in error and "'turbo'" in error, error


def test_cli_sizes_are_validated_against_env_max():
    args = parse(["--capture-sizes", "1,100"])
    with pytest.raises(ValueError, match="capture_sizes"):
        CompilationConfig.from_cli_args(args, {"KVGRAPH_MAX_NUM_TOKENS": "64"})


# --- frozen, hashable, replace, inductor options -----------------------------------------------


def test_config_is_frozen():
    config = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.graph_mode = GraphMode.FULL  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_num_tokens = 3  # type: ignore[misc]


def test_config_equal_and_hashable_by_value():
    a = make(graph_mode="full", capture_sizes=[4, 2, 2], splitting_ops=["kvgraph::unified_attention"])
    b = make(graph_mode=GraphMode.FULL, capture_sizes=(2, 4),
             splitting_ops=("kvgraph::unified_attention",))
    c = make(graph_mode=GraphMode.FULL, capture_sizes=(2, 4, 8),
             splitting_ops=("kvgraph::unified_attention",))
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert len({a, b, c}) == 2
    assert {a: "x"}[b] == "x"


def test_replace_revalidates():
    config = make(max_num_tokens=64, capture_sizes=(1, 64))
    assert config.replace(graph_mode="eager").graph_mode is GraphMode.EAGER
    with pytest.raises(ValueError, match="capture_sizes"):
        config.replace(max_num_tokens=32)


def test_inductor_options_by_mode():
    # exactly max_autotune: nothing else (no inductor cudagraphs: kvgraph captures graphs itself)
    assert make(mode="max-autotune").inductor_options == {"max_autotune": True}
    assert make(mode="max-autotune-no-cudagraphs").inductor_options == {"max_autotune": True}
    assert make(mode="default").inductor_options == {}
    with pytest.raises(ValueError, match="'reduce-overhead'.*kvgraph captures graphs itself"):
        make(mode="reduce-overhead")
