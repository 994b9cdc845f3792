"""How kvgraph compiles and runs a model: graph modes and one frozen, validated config.

The same settings come from `torch.compile(options=...)`, `KVGRAPH_*` environment variables
and the flags of kvgraph/config_flags.py; their strings are parsed in kvgraph/config_sources.py,
and every value, whatever its source, is checked here, in the constructor.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import numbers
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from kvgraph.attention.op_names import ATTENTION_OPS
from kvgraph.cache_dir import check_cache_dir
from kvgraph.config_sources import build, env_settings
from kvgraph.errors import ConfigError
from passes import REGISTERED_PASSES

PIECE_COMPILERS = ("inductor", "eager")
# What happens to a piece inductor fails to build: run it uncompiled (with a warning), or raise.
ON_COMPILE_ERROR = ("eager", "raise")
PASSES = tuple(REGISTERED_PASSES)
DEFAULT_MAX_NUM_TOKENS = 512  # the batch bound where max_num_tokens is unset and no runner sets it
MAX_DEFAULT_CAPTURE_SIZE = 512  # the largest default capture size (see capture_size_list)
# torch.compile's modes kvgraph accepts; "reduce-overhead" (graphs on) is refused: kvgraph's
# graphs are chosen by graph_mode, and inductor must never add graphs of its own.
TORCH_COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")

logger = logging.getLogger(__name__)


class GraphMode(enum.Enum):
    """Which parts of a forward run as captured graphs (see DESIGN.md, contract 4)."""

    EAGER = "eager"
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_full_graphs(self) -> bool:
        """Whether some steps run as one graph of the whole forward, attention included."""
        return self in (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY, GraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise_graphs(self) -> bool:
        """Whether some steps run as graphs of the pieces between attention ops."""
        return self in (GraphMode.PIECEWISE, GraphMode.FULL_AND_PIECEWISE)

    @property
    def has_graphs(self) -> bool:
        """Whether some steps run as captured graphs (full or piecewise): not eager, not none."""
        return self.has_full_graphs or self.has_piecewise_graphs

    @property
    def compiles(self) -> bool:
        """Whether the forward is compiled at all: every mode but eager."""
        return self is not GraphMode.EAGER

    @property
    def only_full_graphs(self) -> bool:
        """Whether the whole forward is built as one piece, attention included (never split)."""
        return self in (GraphMode.FULL, GraphMode.FULL_DECODE_ONLY)

    @property
    def is_runtime_mode(self) -> bool:
        """Whether one step can run as this mode: none, piecewise or full (not eager, not a mix)."""
        return self in (GraphMode.NONE, GraphMode.PIECEWISE, GraphMode.FULL)

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        if isinstance(value, cls):
            return value
        valid = [m.value for m in cls]
        if not isinstance(value, str):
            raise ConfigError("graph_mode", f"graph_mode: expected a GraphMode or one of {valid}, "
                              f"got {value!r} ({type(value).__name__})")
        try:
            return cls(value.lower())
        except ValueError:
            raise ConfigError("graph_mode",
                              f"unknown graph_mode {value!r}; valid: {valid}") from None


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "kvgraph")


@dataclass(frozen=True)
class CompilationConfig:
    """Every setting of compilation and graph capture, checked (types and values) on construction.

    `max_num_tokens` None means not set: the ModelRunner's, or DEFAULT_MAX_NUM_TOKENS where
    torch.compile uses the backend alone; sizes are checked against it only where it is set.
    `capture_sizes` None means the default list (see `capture_size_list`); an empty one is
    allowed only where no graphs are captured (graph_mode "eager" or "none").
    `compile_sizes` get a static build each; other sizes run the general (dynamic) build.
    `on_compile_error`: what a piece that inductor fails to build does ("eager": runs uncompiled,
    with a warning; "raise": the error propagates).
    """

    graph_mode: GraphMode = GraphMode.PIECEWISE
    max_num_tokens: int | None = None
    capture_sizes: tuple[int, ...] | None = None
    compile_sizes: tuple[int, ...] = ()
    piece_compiler: str = "inductor"
    splitting_ops: tuple[str, ...] = ATTENTION_OPS
    passes: tuple[str, ...] = PASSES
    mode: str = "default"
    use_compile_cache: bool = True
    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)
    debug_dump_path: str | None = None
    check_guards: bool = False
    check_graph_inputs: bool = False
    on_compile_error: str = "eager"

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(name, getattr(self, name)))
        upper = self.max_num_tokens  # None: sizes are only checked to be >= 1
        for name in ("capture_sizes", "compile_sizes"):
            bad = [s for s in getattr(self, name) or () if not 1 <= s <= (upper or s)]
            if bad:
                bound = "be >= 1" if upper is None else f"lie in [1, max_num_tokens={upper}]"
                raise ConfigError(name, f"{name} must {bound}, got {bad}")
        if not self.splitting_ops and self.graph_mode.has_piecewise_graphs:
            # Nothing to split at: the one piece is the whole forward, attention inside, which
            # is a full graph per descriptor (vLLM does the same).
            logger.warning("kvgraph: splitting_ops is empty, so graph_mode %r captures the whole "
                           "forward per descriptor: it runs as 'full'", self.graph_mode.value)
            object.__setattr__(self, "graph_mode", GraphMode.FULL)
        if self.capture_sizes == () and self.graph_mode.has_graphs:
            raise ConfigError("capture_sizes", f"capture_sizes is empty, so graph_mode "
                              f"{self.graph_mode.value!r} would capture no graph: for no graphs "
                              "use graph_mode='none' (compiled) or 'eager'; for the default "
                              "sizes leave capture_sizes unset")
        if self.uses_compile_cache:
            check_cache_dir(self.cache_dir)

    @property
    def capture_size_list(self) -> tuple[int, ...]:
        """The capture sizes in force: the user's, or 1, 2, 4, 8, then steps of 8 up to
        `max_num_tokens` (DEFAULT_MAX_NUM_TOKENS where unset) or 512, whichever is smaller.

        Above 512 tokens a step's kernels dwarf their launches, so graphs would buy nothing
        for the capture time and memory they cost; larger batches run without graphs.
        """
        if self.capture_sizes is not None:
            return self.capture_sizes
        largest = min(self.max_num_tokens or DEFAULT_MAX_NUM_TOKENS, MAX_DEFAULT_CAPTURE_SIZE)
        sizes = {1, 2, 4, *range(8, largest + 1, 8), largest}
        return tuple(sorted(s for s in sizes if s <= largest))

    @property
    def uses_compile_cache(self) -> bool:
        """Whether compiling reads and writes `cache_dir` (only inductor's builds are kept)."""
        return (self.use_compile_cache and self.piece_compiler == "inductor"
                and self.graph_mode.compiles)

    @property
    def inductor_options(self) -> dict[str, Any]:
        return {"max_autotune": True} if self.mode.startswith("max-autotune") else {}

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **overrides: Any) -> CompilationConfig:
        """A config from `torch.compile(options=...)`-style keys (field names), strings allowed;
        `cache_dir` None or blank means the default cache dir."""
        return build(cls, {k: (v, None) for k, v in {**(options or {}), **overrides}.items()})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CompilationConfig:
        """A config from `KVGRAPH_<FIELD>` variables (`KVGRAPH_DEBUG_DUMP` for the dump path)."""
        given = env_settings(_FIELD_NAMES, os.environ if environ is None else environ)
        return build(cls, {**given, **{k: (v, None) for k, v in overrides.items()}})

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
                      ) -> CompilationConfig:
        """A config from `add_cli_args` flags; flags not given fall back to the environment."""
        from kvgraph.config_flags import flag_settings  # config_flags is built on this module
        given = env_settings(_FIELD_NAMES, os.environ if environ is None else environ)
        return build(cls, {**given, **flag_settings(args)})

    def replace(self, **changes: Any) -> CompilationConfig:
        return dataclasses.replace(self, **changes)


# --- checks of one field each: the value as stored, or a ConfigError naming the field ---------

STRINGS_HINT = ("; strings are parsed only by CompilationConfig.from_options, from_env and "
                "from_cli_args (e.g. '1,2,4')")


def _got(value: Any) -> str:
    return f"got {value!r} ({type(value).__name__})"


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, f"{name}: expected True or False, {_got(value)}")
    return value


def _positive_int(name: str, value: Any) -> int:
    if not _is_int(value) or value < 1:
        raise ConfigError(name, f"{name}: expected an int >= 1, {_got(value)}")
    return int(value)


def _sizes(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple, set, frozenset, range)):
        hint = STRINGS_HINT if isinstance(value, str) else ""
        raise ConfigError(name, f"{name}: expected a tuple or list of ints, {_got(value)}{hint}")
    bad = [s for s in value if not _is_int(s)]
    if bad:
        raise ConfigError(name, f"{name}: expected ints, got {bad[0]!r} ({type(bad[0]).__name__}) "
                          f"in {value!r}")
    return tuple(sorted({int(s) for s in value}))


def _optional(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda name, value: None if value is None else check(name, value)


def _names(name: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ConfigError(name, f"{name}: expected a tuple or list of str, {_got(value)}")
    return tuple(value)


def _choice(choices: tuple[str, ...]) -> Callable[[str, Any], str]:
    def check(name: str, value: Any) -> str:
        if not isinstance(value, str) or value not in choices:
            raise ConfigError(name, f"{name}: {value!r} is not one of {list(choices)}")
        return value
    return check


def _passes(name: str, value: Any) -> tuple[str, ...]:
    return tuple(_choice(PASSES)(name, v) for v in _names(name, value))


def _splitting_ops(name: str, value: Any) -> tuple[str, ...]:
    for op in _names(name, value):
        namespace, _, op_name = op.partition("::")
        if not namespace or not op_name or "::" in op_name or "." in op_name:
            raise ConfigError(name, f"splitting_ops entries are 'namespace::op' (no overload), "
                              f"got {op!r}")
    return tuple(value)


def _mode(name: str, value: Any) -> str:
    if value == "reduce-overhead":
        raise ConfigError(name, "mode='reduce-overhead' (torch.compile's graphs) is not a kvgraph "
                          "mode: kvgraph captures graphs itself, as graph_mode says (piecewise by "
                          "default; full_and_piecewise for full decode graphs)")
    return _choice(TORCH_COMPILE_MODES)(name, value)


def _path(name: str, value: Any) -> str:
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(path, str) or not path:
        raise ConfigError(name, f"{name}: expected a path (a non-empty str or os.PathLike), "
                          f"{_got(value)}; leave it out for the default")
    return os.path.expanduser(path)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "graph_mode": lambda name, value: GraphMode.parse(value),
    "max_num_tokens": _optional(_positive_int),
    "capture_sizes": _optional(_sizes),
    "compile_sizes": _sizes,
    "piece_compiler": _choice(PIECE_COMPILERS),
    "splitting_ops": _splitting_ops,
    "passes": _passes,
    "mode": _mode,
    "use_compile_cache": _bool,
    "cache_dir": _path,
    "debug_dump_path": _optional(_path),
    "check_guards": _bool,
    "check_graph_inputs": _bool,
    "on_compile_error": _choice(ON_COMPILE_ERROR),
}
_FIELD_NAMES = list(_CHECKS)

