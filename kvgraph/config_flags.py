"""kvgraph's command-line flags: add_cli_args and which config field each flag sets.

`CompilationConfig.from_cli_args` reads the flags back through `flag_settings`; their strings
are parsed in kvgraph/config_sources.py and checked by the config's constructor. Numeric flags
are checked as they are parsed too, by the same field checks, so argparse names the flag and
exits before a server loads its model.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

from kvgraph.config_checks import (
    ON_COMPILE_ERROR,
    PIECE_COMPILERS,
    VERIFY_ACTIONS,
    non_negative_int,
    positive_float,
    token_count,
)
from kvgraph.errors import ConfigError
from kvgraph.graph_mode import GraphMode

# Flag dest -> the config field it sets; every flag defaults to None so the environment can
# fill in.
_CLI_FIELDS = {
    "graph_mode": "graph_mode",
    "max_num_tokens": "max_num_tokens",
    "capture_sizes": "capture_sizes",
    "compile_sizes": "compile_sizes",
    "piece_compiler": "piece_compiler",
    "compile_cache_dir": "cache_dir",
    "compile_cache": "use_compile_cache",
    "debug_dump_path": "debug_dump_path",
    "check_guards": "check_guards",
    "check_graph_inputs": "check_graph_inputs",
    "check_rank_agreement": "check_rank_agreement",
    "on_compile_error": "on_compile_error",
    "verify": "verify",
    "verify_every": "verify_every",
    "verify_action": "verify_action",
    "verify_tolerance": "verify_tolerance",
}


def flag_settings(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """The flags that were given, as {field: (value, flag)}."""
    return {field: (getattr(args, dest), "--" + dest.replace("_", "-"))
            for dest, field in _CLI_FIELDS.items() if getattr(args, dest, None) is not None}


def _checked(convert: Callable[[str], Any], check: Callable[[str, Any], Any], field: str
             ) -> Callable[[str], Any]:
    """An argparse type: `convert` the text, then the config's own check of `field`."""
    def parse(text: str) -> Any:
        try:
            return check(field, convert(text))
        except ValueError as error:  # ConfigError is one; argparse shows this message
            kind = "an int" if convert is int else "a number"
            message = str(error) if isinstance(error, ConfigError) else \
                f"expected {kind}, got {text!r}"
            raise argparse.ArgumentTypeError(message) from None
    return parse


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add kvgraph's flags (graph mode, sizes, cache and dump dirs) to any server's parser."""
    group = parser.add_argument_group("kvgraph", "graph compilation and capture")
    group.add_argument("--graph-mode", choices=[m.value for m in GraphMode],
                       help="which parts of a forward run as captured graphs (default piecewise)")
    group.add_argument("--max-num-tokens", type=_checked(int, token_count, "max_num_tokens"),
                       help="largest batch, in tokens")
    group.add_argument("--capture-sizes", help="comma-separated token counts to capture graphs for")
    group.add_argument("--compile-sizes", help="comma-separated token counts to build statically")
    group.add_argument("--piece-compiler", choices=PIECE_COMPILERS,
                       help="what compiles the pieces between attention ops")
    group.add_argument("--on-compile-error", choices=ON_COMPILE_ERROR,
                       help="a piece its compiler fails to build: run it uncompiled (eager, "
                            "the default, with a warning) or raise")
    group.add_argument("--compile-cache-dir", help="where compiled artifacts are kept")
    group.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=None,
                       help="reuse compiled artifacts across processes (default on)")
    group.add_argument("--debug-dump-path", help="write every compile stage under this directory")
    group.add_argument("--check-guards", action="store_true", default=None,
                       help="re-check Dynamo guards on every call (debugging)")
    group.add_argument("--check-graph-inputs", action="store_true", default=None,
                       help="check on every replay that graph inputs did not move (debugging)")
    group.add_argument("--check-rank-agreement", action="store_true", default=None,
                       help="under tensor parallelism, check every step's batch descriptor is "
                            "the same on all ranks (debugging)")
    group.add_argument("--verify", action="store_true", default=None,
                       help="check graphs against eager on the first step of each descriptor")
    group.add_argument("--verify-every",
                       type=_checked(int, non_negative_int, "verify_every"),
                       help="with --verify, also check every N-th step (default 0: none)")
    group.add_argument("--verify-action", choices=VERIFY_ACTIONS,
                       help="a verify step that finds graphs and eager apart: warn (default) "
                            "or raise")
    group.add_argument("--verify-tolerance",
                       type=_checked(float, positive_float, "verify_tolerance"),
                       help="largest logit difference, relative to their scale, verify accepts "
                            "(default by dtype)")
    return parser
