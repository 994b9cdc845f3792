"""The compile cache's key: a digest of everything a graph's builds depend on (versions, device,
threads, passes, settings, the traced source files), and the graph fingerprints that name
each piece's builds within it.

Two decoder layers give one fingerprint, so identical pieces build once; `cache_key` says,
beside the key, what it was made of, for the debug dump and for telling why a key changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any, Iterable

import sympy
import torch
from torch import fx

from kvgraph.compilation.npu_piece_compilers import NPU_PIECE_COMPILERS, why_not_cached
from kvgraph.config import CompilationConfig
from kvgraph.distributed import tensor_parallel_group
from kvgraph.version import __version__

# Config fields that change no compiled artifact: the compile cache key leaves them out.
NOT_IN_CACHE_KEY = ("capture_sizes", "num_speculative_tokens", "cache_dir", "debug_dump_path",
                    "check_guards", "check_graph_inputs", "check_rank_agreement",
                    "on_compile_error", "verify", "verify_every", "verify_action",
                    "verify_tolerance")


def digest(*parts: object) -> str:
    """A stable sha256 hex digest of the `repr` of each part."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(repr(part).encode())
        hasher.update(b"\0")
    return hasher.hexdigest()


def source_files_digest(paths: Iterable[str]) -> str:
    """The digest of the contents of the given source files (missing files count as absent)."""
    hasher = hashlib.sha256()
    for path in sorted(set(paths)):
        try:
            content = Path(path).read_bytes()
        except OSError:
            content = None
        hasher.update(repr((path, None if content is None else hashlib.sha256(content).digest()))
                      .encode())
    return hasher.hexdigest()


def source_file_digests(paths: Iterable[str]) -> dict[str, str | None]:
    """Each source file's sha256 (None if missing): the readable form of `source_files_digest`."""
    digests: dict[str, str | None] = {}
    for path in sorted(set(paths)):
        try:
            digests[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        except OSError:
            digests[path] = None
    return digests


def _describe(value: Any, symbols: dict) -> str:
    """A placeholder's type and shape, with symbols named by first appearance."""
    def name(expr: Any) -> str:
        if isinstance(expr, torch.SymInt):
            expr = expr.node.expr
        if isinstance(expr, sympy.Expr):
            return str(expr.xreplace({s: symbols.setdefault(s, sympy.Symbol(f"n{len(symbols)}"))
                                      for s in expr.free_symbols}))
        return str(expr)

    if isinstance(value, torch.Tensor):
        return (f"T({[name(d) for d in value.shape]},{[name(s) for s in value.stride()]},"
                f"{value.dtype},{value.device.type})")
    return f"{type(value).__name__}({name(value)})"


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A digest of a graph's structure and input types, blind to node and symbol names.

    Two decoder layers give the same fingerprint, so identical pieces compile once.
    """
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    symbols: dict = {}

    def arg(a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: f"%{index[n]}")

    lines = []
    for node in gm.graph.nodes:
        target = node.target
        if callable(target):
            # The qualified name, not __qualname__: boolean-dispatched functions share one of those.
            target = fx.node._get_qualified_name(target)
        if node.op == "placeholder":
            lines.append(f"in {_describe(node.meta.get('example_value', node.meta.get('val')), symbols)}")
        else:
            lines.append(f"{node.op} {target} {arg(node.args)} {arg(node.kwargs)}")
    return digest(*lines)


def inductor_cpu_threads() -> int | str:
    """The thread count inductor's C++ kernels are generated for ("dynamic": read at run time).

    Inductor decides at build time which loops run in parallel, for this many threads, and
    builds for one thread without OpenMP at all: a piece built in a one-thread process runs
    on one core in any other, so the compile cache keys CPU builds by it.
    """
    from torch._inductor import config as inductor_config  # loaded by compiling anyway

    cpp = inductor_config.cpp
    if cpp.dynamic_threads:
        return "dynamic"
    return cpp.threads if cpp.threads >= 1 else torch.get_num_threads()


def traced_source_files() -> list[str]:
    """The files of the code Dynamo traced for the graph being compiled (none outside a trace)."""
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return []
    return [code.co_filename for code in context.get_traced_code() or []]


def cache_key(config: CompilationConfig, device: str, passes_uuid: Any
              ) -> tuple[str, dict[str, Any]]:
    """The key of a graph's builds on `device` (a device type), and the factors it digests,
    each source file's digest included."""
    settings = {name: value for name, value in dataclasses.asdict(config).items()
                if name not in NOT_IN_CACHE_KEY}
    sources = traced_source_files()
    tp = tensor_parallel_group()
    # Ranks build the same artifacts (shard shapes are in each piece's fingerprint, the
    # group is a name in the graph), so ranks share them; TP sizes never do.
    factors = {"torch": torch.__version__, "kvgraph": __version__, "device": device,
               "passes": passes_uuid, "settings": settings,
               "tensor_parallel": {"world_size": tp.world_size, "backend": tp.backend}}
    if device == "cpu":
        factors["cpu_threads"] = inductor_cpu_threads()
    key = digest(*factors.values(), source_files_digest(sources))
    factors["source_files"] = source_file_digests(sources)
    return key, factors


def why_no_cache(config: CompilationConfig) -> str:
    """Why a config compiles without the compile cache (where it does)."""
    if not config.use_compile_cache:
        return "use_compile_cache is off"
    if config.piece_compiler in NPU_PIECE_COMPILERS:
        return why_not_cached(config.piece_compiler)
    return f"piece_compiler {config.piece_compiler!r} builds nothing to keep"
