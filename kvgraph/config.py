"""How kvgraph compiles and runs a model: graph modes and one frozen, validated config.

The same settings come from `torch.compile(options=...)`, `KVGRAPH_*` environment variables
and command-line flags; each source is parsed here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from kvgraph.attention.op_names import ATTENTION_OPS
from passes import REGISTERED_PASSES

PIECE_COMPILERS = ("inductor", "eager")
PASSES = tuple(REGISTERED_PASSES)
# torch.compile's modes kvgraph accepts; "reduce-overhead" (graphs on) is refused: kvgraph's
# graphs are chosen by graph_mode, and inductor must never add graphs of its own.
TORCH_COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs")
ENV_PREFIX = "KVGRAPH_"
# DESIGN.md names the dump variable without the `_PATH` suffix.
ENV_ALIASES = {"debug_dump_path": "KVGRAPH_DEBUG_DUMP"}

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

    @classmethod
    def parse(cls, value: GraphMode | str) -> GraphMode:
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"unknown graph_mode {value!r}; valid: {[m.value for m in cls]}"
            ) from None


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "kvgraph")


@dataclass(frozen=True)
class CompilationConfig:
    """Every setting of compilation and graph capture, validated on construction.

    `capture_sizes` None means the default list for `max_num_tokens` (see `capture_size_list`).
    `compile_sizes` get a static build each; other sizes run the general (dynamic) build.
    """

    graph_mode: GraphMode = GraphMode.PIECEWISE
    max_num_tokens: int = 512
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

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("graph_mode", GraphMode.parse(self.graph_mode))
        for name in ("capture_sizes", "compile_sizes"):
            sizes = getattr(self, name)
            if sizes is not None:
                set_(name, _check_sizes(name, sizes, self.max_num_tokens))
        set_("splitting_ops", tuple(self.splitting_ops))
        set_("passes", tuple(self.passes))
        if not self.splitting_ops and self.graph_mode.has_piecewise_graphs:
            # Nothing to split at: the one piece is the whole forward, attention inside, which
            # is a full graph per descriptor (vLLM does the same).
            logger.warning("kvgraph: splitting_ops is empty, so graph_mode %r captures the whole "
                           "forward per descriptor: it runs as 'full'", self.graph_mode.value)
            set_("graph_mode", GraphMode.FULL)
        if self.max_num_tokens < 1:
            raise ValueError(f"max_num_tokens must be >= 1, got {self.max_num_tokens}")
        _check_choice("piece_compiler", self.piece_compiler, PIECE_COMPILERS)
        if self.mode == "reduce-overhead":
            raise ValueError(
                "mode='reduce-overhead' (torch.compile's graphs) is not a kvgraph mode: kvgraph "
                "captures graphs itself, as graph_mode says (piecewise by default; "
                "full_and_piecewise for full decode graphs)")
        _check_choice("mode", self.mode, TORCH_COMPILE_MODES)
        for name in self.passes:
            _check_choice("passes", name, PASSES)
        for op in self.splitting_ops:
            namespace, _, name = op.partition("::")
            if not namespace or not name or "::" in name or "." in name:
                raise ValueError(
                    f"splitting_ops entries are 'namespace::op' (no overload), got {op!r}"
                )

    @property
    def capture_size_list(self) -> tuple[int, ...]:
        """The capture sizes in force: the user's, or 1, 2, 4, 8, then steps of 8 up to the max."""
        if self.capture_sizes is not None:
            return self.capture_sizes
        sizes = [s for s in (1, 2, 4) if s < self.max_num_tokens]
        sizes += range(8, self.max_num_tokens + 1, 8)
        if sizes[-1:] != [self.max_num_tokens]:
            sizes.append(self.max_num_tokens)
        return tuple(sorted(set(sizes)))

    @property
    def inductor_options(self) -> dict[str, Any]:
        return {"max_autotune": True} if self.mode.startswith("max-autotune") else {}

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None, **overrides: Any) -> CompilationConfig:
        """A config from `torch.compile(options=...)`-style keys (field names), strings allowed."""
        values = {**(options or {}), **overrides}
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - fields)
        if unknown:
            raise ValueError(f"unknown kvgraph option(s) {unknown}; valid: {sorted(fields)}")
        return cls(**{k: _parse_value(k, v) for k, v in values.items()})

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> CompilationConfig:
        """A config from `KVGRAPH_<FIELD>` variables (`KVGRAPH_DEBUG_DUMP` for the dump path)."""
        environ = os.environ if environ is None else environ
        values = {}
        for f in dataclasses.fields(cls):
            name = ENV_ALIASES.get(f.name, ENV_PREFIX + f.name.upper())
            if name in environ:
                values[f.name] = environ[name]
        return cls.from_options(values, **overrides)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None
                      ) -> CompilationConfig:
        """A config from `add_cli_args` flags; flags not given fall back to the environment."""
        given = {
            field: getattr(args, dest)
            for field, dest in _CLI_FIELDS.items()
            if getattr(args, dest, None) is not None
        }
        return cls.from_env(environ, **{k: _parse_value(k, v) for k, v in given.items()})

    def replace(self, **changes: Any) -> CompilationConfig:
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}: {value!r} is not one of {list(choices)}")


def _check_sizes(name: str, sizes: Any, max_num_tokens: int) -> tuple[int, ...]:
    sizes = tuple(sorted(set(int(s) for s in sizes)))
    bad = [s for s in sizes if not 1 <= s <= max_num_tokens]
    if bad:
        raise ValueError(f"{name} must lie in [1, max_num_tokens={max_num_tokens}], got {bad}")
    return sizes


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false, yes/no, on/off), got {value!r}")


def _parse_list(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        return tuple(v.strip() for v in value.split(",") if v.strip())
    return tuple(value)


def _parse_sizes(value: Any) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in _parse_list(value))
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {value!r}") from None


def _parse_optional_str(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "graph_mode": GraphMode.parse,
    "max_num_tokens": int,
    "capture_sizes": lambda v: None if v in (None, "", "auto") else _parse_sizes(v),
    "compile_sizes": _parse_sizes,
    "piece_compiler": str,
    "splitting_ops": _parse_list,
    "passes": _parse_list,
    "mode": str,
    "use_compile_cache": _parse_bool,
    "cache_dir": lambda v: os.path.expanduser(str(v)),
    "debug_dump_path": _parse_optional_str,
    "check_guards": _parse_bool,
    "check_graph_inputs": _parse_bool,
}


def _parse_value(field: str, value: Any) -> Any:
    try:
        return _PARSERS[field](value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"bad value for {field}: {error}") from None


# CLI flag dest -> config field; every flag defaults to None so the environment can fill in.
_CLI_FIELDS = {
    "graph_mode": "graph_mode",
    "max_num_tokens": "max_num_tokens",
    "capture_sizes": "capture_sizes",
    "compile_sizes": "compile_sizes",
    "piece_compiler": "piece_compiler",
    "cache_dir": "compile_cache_dir",
    "use_compile_cache": "compile_cache",
    "debug_dump_path": "debug_dump_path",
    "check_guards": "check_guards",
    "check_graph_inputs": "check_graph_inputs",
}


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add kvgraph's flags (graph mode, sizes, cache and dump dirs) to any server's parser."""
    group = parser.add_argument_group("kvgraph", "graph compilation and capture")
    group.add_argument("--graph-mode", choices=[m.value for m in GraphMode],
                       help="which parts of a forward run as captured graphs (default piecewise)")
    group.add_argument("--max-num-tokens", type=int, help="largest batch, in tokens")
    group.add_argument("--capture-sizes", help="comma-separated token counts to capture graphs for")
    group.add_argument("--compile-sizes", help="comma-separated token counts to build statically")
    group.add_argument("--piece-compiler", choices=PIECE_COMPILERS,
                       help="what compiles the pieces between attention ops")
    group.add_argument("--compile-cache-dir", help="where compiled artifacts are kept")
    group.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse compiled artifacts across processes (default on)")
    group.add_argument("--debug-dump-path", help="write every compile stage under this directory")
    group.add_argument("--check-guards", action="store_true", default=None,
                       help="re-check Dynamo guards on every call (debugging)")
    group.add_argument("--check-graph-inputs", action="store_true", default=None,
                       help="check on every replay that graph inputs did not move (debugging)")
    return parser
