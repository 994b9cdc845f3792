"""How kvgraph compiles and runs a model: one frozen, validated config (and its GraphMode).

The same settings come from `torch.compile(options=...)`, `KVGRAPH_*` environment variables
and the flags of kvgraph/config_flags.py; their strings are parsed in kvgraph/config_sources.py,
and every value, whatever its source, is checked here, in the constructor.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import kvgraph.config_checks as checks
from kvgraph.attention.op_names import ATTENTION_OPS
from kvgraph.cache_dir import check_cache_dir
from kvgraph.config_checks import (  # noqa: F401
    ON_COMPILE_ERROR,
    PASSES,
    PIECE_COMPILERS,
    TORCH_COMPILE_MODES,
    VERIFY_ACTIONS,
)
from kvgraph.config_flags import flag_settings
from kvgraph.config_sources import build, env_settings
from kvgraph.errors import ConfigError
from kvgraph.graph_mode import GraphMode
from passes.op_match import op_exists

DEFAULT_MAX_NUM_TOKENS = 512  # the batch bound where max_num_tokens is unset and no runner sets it
MAX_DEFAULT_CAPTURE_SIZE = 512  # the largest default capture size (see capture_size_list)

logger = logging.getLogger(__name__)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(base, "kvgraph")


def without_pieces(mode: GraphMode, why: str) -> GraphMode:
    """What `mode` becomes with nothing to split at, with a warning saying `why`.

    The one piece is the whole forward, attention inside, which is a full graph per descriptor
    (vLLM does the same).
    """
    logger.warning("kvgraph: %s, so graph_mode %r captures the whole forward per descriptor: it "
                   "runs as 'full'", why, mode.value)
    return GraphMode.FULL


def multiples_of(sizes: tuple[int, ...], query_len: int, bound: int | None
                 ) -> tuple[int, ...]:
    """`sizes` each rounded up to a multiple of `query_len`, sorted without duplicates; one
    rounded above `bound` (None: no bound) becomes the largest multiple within it (at least
    `query_len`), so rounding never grows the largest size past the bound."""
    if query_len == 1:
        return sizes
    top = None if bound is None else max(bound // query_len, 1) * query_len
    rounded = (-(-size // query_len) * query_len for size in sizes)
    return tuple(sorted({size if top is None else min(size, top) for size in rounded}))


@dataclass(frozen=True)
class CompilationConfig:
    """Every setting of compilation and graph capture, checked (types and values) on construction.

    `max_num_tokens` None means not set: the ModelRunner's, or DEFAULT_MAX_NUM_TOKENS where
    torch.compile uses the backend alone; sizes are checked against it only where it is set.
    `capture_sizes` None means the default list (see `capture_size_list`); an empty one is
    allowed only where no graphs are captured (graph_mode "eager" or "none").
    `compile_sizes` get a static build each; other sizes run the general (dynamic) build.
    `num_speculative_tokens` (K): the draft tokens a speculative verify step checks per request,
    so such a step is a uniform batch of `uniform_decode_query_len` (1 + K) tokens a request;
    with K > 0 every capture size is rounded up to a multiple of 1 + K (see
    `capture_size_list`). 0: no speculation.
    `piece_compiler`: what builds each piece: "inductor" (its builds kept in the compile cache),
    "eager" (the traced FX code), or on Ascend NPUs "npugraph_ex" or "torchair" (torch_npu's
    compilers, imported only when chosen; nothing of theirs is cached).
    `on_compile_error`: what a piece that its piece compiler fails to build does ("eager": runs
    uncompiled, with a warning; "raise": the error propagates).
    `verify`: the ModelRunner also runs the first step of each descriptor that runs on graphs
    (and every `verify_every`-th step, 0 for none) eagerly on a copy of its cache blocks and
    compares logits and cache writes; a difference above `verify_tolerance` (relative to the
    logits' scale; None: by dtype) is a warning or, with `verify_action="raise"`, a VerifyError.
    Off, it costs nothing.
    `check_rank_agreement`: under tensor parallelism, each step's descriptor is checked to be
    the same on every rank before it runs (a host exchange per step; debugging). Captures are
    always checked.
    """

    graph_mode: GraphMode = GraphMode.PIECEWISE
    max_num_tokens: int | None = None
    capture_sizes: tuple[int, ...] | None = None
    compile_sizes: tuple[int, ...] = ()
    num_speculative_tokens: int = 0
    piece_compiler: str = "inductor"
    splitting_ops: tuple[str, ...] = ATTENTION_OPS
    passes: tuple[str, ...] = PASSES
    mode: str = "default"
    use_compile_cache: bool = True
    cache_dir: str = dataclasses.field(default_factory=default_cache_dir)
    debug_dump_path: str | None = None
    check_guards: bool = False
    check_graph_inputs: bool = False
    check_rank_agreement: bool = False
    on_compile_error: str = "eager"
    verify: bool = False
    verify_every: int = 0
    verify_action: str = "warn"
    verify_tolerance: float | None = None

    def __post_init__(self) -> None:
        for name, check in _CHECKS.items():
            object.__setattr__(self, name, check(name, getattr(self, name)))
        upper = self.max_num_tokens  # None: sizes are only checked to be >= 1
        for name in ("capture_sizes", "compile_sizes"):
            bad = [s for s in getattr(self, name) or () if not 1 <= s <= (upper or s)]
            if bad:
                bound = "be >= 1" if upper is None else f"lie in [1, max_num_tokens={upper}]"
                raise ConfigError(name, f"{name} must {bound}, got {bad}")
        if upper is not None and self.uniform_decode_query_len > upper:
            raise ConfigError("num_speculative_tokens", f"num_speculative_tokens="
                              f"{self.num_speculative_tokens}: a verify step of one request has "
                              f"{self.uniform_decode_query_len} tokens, more than "
                              f"max_num_tokens={upper}")
        unknown = [op for op in self.splitting_ops if not op_exists(op)]
        if unknown:
            logger.warning("kvgraph: splitting_ops %s name no registered op, so nothing is split "
                           "at them (fix the names, or register the ops before building the "
                           "config)", unknown)
            object.__setattr__(self, "splitting_ops",
                               tuple(op for op in self.splitting_ops if op not in unknown))
        if not self.splitting_ops and self.graph_mode.has_piecewise_graphs:
            object.__setattr__(self, "graph_mode", without_pieces(self.graph_mode, "splitting_ops "
                                                                  "is empty"))
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
        With speculation (`uniform_decode_query_len` q > 1) each size is rounded up to a
        multiple of q, so a verify step pads to whole requests of q tokens (`multiples_of`).
        """
        if self.capture_sizes is not None:
            return multiples_of(self.capture_sizes, self.uniform_decode_query_len,
                                self.max_num_tokens)
        largest = min(self.max_num_tokens or DEFAULT_MAX_NUM_TOKENS, MAX_DEFAULT_CAPTURE_SIZE)
        sizes = {1, 2, 4, *range(8, largest + 1, 8), largest}
        return multiples_of(tuple(sorted(s for s in sizes if s <= largest)),
                            self.uniform_decode_query_len, largest)

    @property
    def uniform_decode_query_len(self) -> int:
        """The tokens each request adds in a uniform verify step: 1 + num_speculative_tokens
        (1, a decode step, without speculation)."""
        return 1 + self.num_speculative_tokens

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
        given = env_settings(_FIELD_NAMES, os.environ if environ is None else environ)
        return build(cls, {**given, **flag_settings(args)})

    def replace(self, **changes: Any) -> CompilationConfig:
        return dataclasses.replace(self, **changes)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "graph_mode": lambda name, value: GraphMode.parse(value),
    "max_num_tokens": checks.optional(checks.token_count),
    "capture_sizes": checks.optional(checks.sizes),
    "compile_sizes": checks.sizes,
    "num_speculative_tokens": checks.non_negative_int,
    "piece_compiler": checks.choice(PIECE_COMPILERS),
    "splitting_ops": checks.splitting_ops,
    "passes": checks.passes,
    "mode": checks.mode,
    "use_compile_cache": checks.check_bool,
    "cache_dir": checks.path,
    "debug_dump_path": checks.optional(checks.dump_dir),
    "check_guards": checks.check_bool,
    "check_graph_inputs": checks.check_bool,
    "check_rank_agreement": checks.check_bool,
    "on_compile_error": checks.choice(ON_COMPILE_ERROR),
    "verify": checks.check_bool,
    "verify_every": checks.non_negative_int,
    "verify_action": checks.choice(VERIFY_ACTIONS),
    "verify_tolerance": checks.optional(checks.positive_float),
}
_FIELD_NAMES = list(_CHECKS)

