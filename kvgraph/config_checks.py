"""The checks of single config fields: each returns the value as stored, or raises a
ConfigError naming the field, what it expected and what came."""

from __future__ import annotations

import numbers
import os
from typing import Any, Callable

from kvgraph.errors import ConfigError
from passes import REGISTERED_PASSES

# npugraph_ex, torchair: Ascend NPUs, via torch_npu (kvgraph/compilation/npu_piece_compilers.py).
PIECE_COMPILERS = ("inductor", "eager", "npugraph_ex", "torchair")
# What happens to a piece that fails to build: run it uncompiled (with a warning), or raise.
ON_COMPILE_ERROR = ("eager", "raise")
# What a verify step that finds graphs and eager apart does: log a warning, or raise.
VERIFY_ACTIONS = ("warn", "raise")
PASSES = tuple(REGISTERED_PASSES)
# torch.compile's modes kvgraph accepts; "reduce-overhead" (graphs on) is refused: kvgraph's
# graphs are chosen by graph_mode, and inductor must never add graphs of its own.
TORCH_COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")

# Token offsets (query_start_loc) are int32, so no step can hold more tokens.
MAX_NUM_TOKENS = 2**31 - 1

STRINGS_HINT = ("; strings are parsed only by CompilationConfig.from_options, from_env and "
                "from_cli_args (e.g. '1,2,4')")


def got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


def is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, f"{name}: expected True or False, {got(value)}")
    return value


def positive_int(name: str, value: Any) -> int:
    if not is_int(value) or value < 1:
        raise ConfigError(name, f"{name}: expected an int >= 1, {got(value)}")
    return int(value)


def bounded_int(name: str, value: Any, upper: int, why: str) -> int:
    """A positive int at most `upper` (`why` says what bounds it)."""
    value = positive_int(name, value)
    if value > upper:
        raise ConfigError(name, f"{name}: expected at most {upper} ({why}), got {value}")
    return value


def non_negative_int(name: str, value: Any) -> int:
    if not is_int(value) or value < 0:
        raise ConfigError(name, f"{name}: expected an int >= 0, {got(value)}")
    return int(value)


def positive_float(name: str, value: Any) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not 0 < float(value) < float("inf")):
        raise ConfigError(name, f"{name}: expected a finite number > 0, {got(value)}")
    return float(value)


def token_count(name: str, value: Any) -> int:
    """A positive int that int32 token offsets can hold."""
    return bounded_int(name, value, MAX_NUM_TOKENS, "token offsets are int32")


def sizes(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple, set, frozenset, range)):
        hint = STRINGS_HINT if isinstance(value, str) else ""
        raise ConfigError(name, f"{name}: expected a tuple or list of ints, {got(value)}{hint}")
    bad = [s for s in value if not is_int(s)]
    if bad:
        raise ConfigError(name, f"{name}: expected ints, got {bad[0]!r} ({type(bad[0]).__name__}) "
                          f"in {value!r}")
    return tuple(sorted({int(s) for s in value}))


def json_object(name: str, label: str, value: Any, known: list[str], hint: str = "") -> dict:
    """`value`, a parsed JSON config, if it is an object of `known` fields only; a ConfigError
    under `name` otherwise (`label` names the config, `hint` shows a valid one)."""
    if not isinstance(value, dict):
        raise ConfigError(name, f"{label}: expected an object, got {type(value).__name__}"
                          + (f"; {hint}" if hint else ""))
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(name, f"{label}: unknown field(s) {unknown}; valid: {known}")
    return value


def optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def names(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(name, f"{name}: expected a tuple or list of str, {got(value)}")
    return tuple(value)


def choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(name, f"{name}: {value!r} is not one of {list(choices)}")
        return value
    return check


def passes(name: str, value: Any) -> tuple[str, ...]:
    return tuple(choice(PASSES)(name, v) for v in names(name, value))


def splitting_ops(name: str, value: Any) -> tuple[str, ...]:
    for op in names(name, value):
        namespace, _, op_name = op.partition("::")
        if not namespace or not op_name or "::" in op_name or "." in op_name:
            raise ConfigError(name, f"splitting_ops entries are 'namespace::op' (no overload), "
                              f"got {op!r}")
    return tuple(value)


def mode(name: str, value: Any) -> str:
    if value == "reduce-overhead":
        raise ConfigError(name, "mode='reduce-overhead' (torch.compile's graphs) is not a kvgraph "
                          "mode: kvgraph captures graphs itself, as graph_mode says (piecewise by "
                          "default; full_and_piecewise for full decode graphs)")
    return choice(TORCH_COMPILE_MODES)(name, value)


def path(name: str, value: Any) -> str:
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str) or not path:
        raise ConfigError(name, f"{name}: expected a path (a non-empty str or os.PathLike), "
                          f"{got(value)}; leave it out for the default")
    if "\0" in path:
        raise ConfigError(name, f"{name}: a path cannot contain a NUL character, got {path!r}")
    return os.path.expanduser(path)


def dump_dir(name: str, value: Any) -> str:
    """A path where a directory is or can be made."""
    value = path(name, value)
    if os.path.exists(value) and not os.path.isdir(value):
        raise ConfigError(name, f"{name}: {value} exists and is not a directory; give a "
                          "directory (kvgraph makes it if missing)")
    return value
