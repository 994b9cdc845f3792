"""The `kvgraph` torch.compile backend: passes, split at attention, per-size piece builds.

`torch.compile(model, backend="kvgraph", options={...})` finds `kvgraph_backend` through the
`torch_dynamo_backends` entry point; `options` keys are `CompilationConfig` fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from kvgraph.attention.op_names import ATTENTION_OPS
from kvgraph.compilation.cache import (
    CompileCache,
    digest,
    graph_fingerprint,
    source_files_digest,
)
from kvgraph.compilation.counters import CompileCounters
from kvgraph.compilation.debug import DebugDump
from kvgraph.compilation.graph_wrapper import GraphWrapper
from kvgraph.compilation.piece_compiler import make_piece_compiler
from kvgraph.compilation.piecewise import PiecewiseBackend, build_piece, token_symbols
from kvgraph.config import CompilationConfig, GraphMode, without_pieces
from kvgraph.version import __version__
from passes import (
    REGISTERED_PASSES,
    InplaceAttentionPass,
    PassManager,
    split_at_attention,
)
from passes.op_match import is_op_call

logger = logging.getLogger(__name__)
# Config fields that change no compiled artifact: the compile cache key leaves them out.
NOT_IN_CACHE_KEY = ("capture_sizes", "cache_dir", "debug_dump_path", "check_guards",
                    "check_graph_inputs", "on_compile_error")


def _example_values(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


def _device_of(values: list[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


def _traced_source_files() -> list[str]:
    context = torch._guards.TracingContext.try_get()
    if context is None:
        return []
    return [code.co_filename for code in context.get_traced_code() or []]


class KVGraphBackend:
    """Compiles each Dynamo graph it is given according to one `CompilationConfig`.

    `counters` count what it did (the process's totals count it too).
    """

    def __init__(self, config: CompilationConfig | None = None):
        self.config = config or CompilationConfig()
        self.pass_manager = PassManager([REGISTERED_PASSES[name] for name in self.config.passes])
        self.counters = CompileCounters()

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any],
                 mode: str | None = None, options: Mapping[str, Any] | None = None) -> Callable:
        if mode or options:
            raise ValueError(
                "this KVGraphBackend already has its config; pass mode/options to "
                "CompilationConfig instead, or use backend='kvgraph'"
            )
        self.counters.add("dynamo_graphs")
        if not self.config.graph_mode.compiles:
            return gm
        start = time.perf_counter()
        self._downgrade_if_nothing_splits(gm)
        values = _example_values(gm)
        if not token_symbols(values):
            logger.warning(
                "kvgraph: the token dimension was traced static, so each new batch size makes "
                "Dynamo trace again. Mark it dynamic before the first call "
                "(kvgraph.mark_token_dims(input_ids, positions)), or use kvgraph.compile_model "
                "or kvgraph.ModelRunner, which do."
            )
        cache = self._compile_cache(gm)
        dump = DebugDump.open(self.config.debug_dump_path) if self.config.debug_dump_path else None
        if dump:
            dump.json("config", dataclasses.asdict(self.config))
            dump.graph("dynamo", gm)
        with cache.inductor_dir() if cache else contextlib.nullcontext():
            self.pass_manager(gm, dump and (lambda name, g: dump.graph(f"pass-{name}", g)))
            compiled = self._compile(gm, values, cache, dump)
        self.counters.add("compile_seconds", time.perf_counter() - start)
        if dump:
            dump.json("counters", self.counters.snapshot())
        if self.config.graph_mode.has_full_graphs:
            compiled = GraphWrapper(compiled, GraphMode.FULL, "full", last=True)
        return compiled

    def _downgrade_if_nothing_splits(self, gm: fx.GraphModule) -> None:
        """Treat splitting ops that this graph never calls like none at all: otherwise attention
        would run inside a piecewise graph, which freezes its metadata."""
        config = self.config
        if not config.graph_mode.has_piecewise_graphs:
            return
        if any(is_op_call(node, config.splitting_ops) for node in gm.graph.nodes):
            return
        mode = without_pieces(config.graph_mode, f"splitting_ops {list(config.splitting_ops)} "
                              "match no op of the traced graph")
        self.config = config.replace(splitting_ops=(), graph_mode=mode)

    def _compile(self, gm: fx.GraphModule, values: list[Any], cache: CompileCache | None,
                 dump: DebugDump | None) -> Callable:
        config = self.config
        # Modes whose only graphs are full ones build the whole graph, attention included.
        if config.graph_mode.only_full_graphs or not config.splitting_ops:
            patches = dict(config.inductor_options)
            patches["post_grad_custom_post_pass"] = InplaceAttentionPass(config.splitting_ops
                                                                         or ATTENTION_OPS)
            compiler = make_piece_compiler(config.piece_compiler, cache, self.counters, patches,
                                           config.on_compile_error)
            self.counters.add("pieces")
            return build_piece(gm, values, config.compile_sizes, compiler,
                               graph_fingerprint(gm), self.counters)
        return self._compile_pieces(gm, cache, dump)

    def _compile_pieces(self, gm: fx.GraphModule, cache: CompileCache | None,
                        dump: DebugDump | None) -> fx.GraphModule:
        config = self.config
        compiler = make_piece_compiler(config.piece_compiler, cache, self.counters,
                                       config.inductor_options, config.on_compile_error)
        split = split_at_attention(gm, config.splitting_ops)
        if dump:
            dump.graph("split", split.split_module)
        built: dict[str, PiecewiseBackend] = {}
        last = [piece for piece in split.pieces if not piece.is_splitting_op][-1].name
        for piece in split.pieces:
            if dump:
                dump.graph(f"piece-{piece.name}", piece.graph_module)
            if piece.is_splitting_op:
                continue
            self.counters.add("pieces")
            fingerprint = graph_fingerprint(piece.graph_module)
            if fingerprint not in built:
                built[fingerprint] = build_piece(
                    piece.graph_module, _example_values(piece.graph_module),
                    config.compile_sizes, compiler, fingerprint, self.counters,
                )
            runnable: Callable = built[fingerprint]
            if config.graph_mode.has_piecewise_graphs:
                # One wrapper per position: identical pieces share builds, never graphs.
                runnable = GraphWrapper(runnable, GraphMode.PIECEWISE, piece.name,
                                        last=piece.name == last)
            # setattr rejects non-Modules; the split module's forward finds it in __dict__.
            split.split_module.__dict__[piece.name] = runnable
        return split.split_module

    def _compile_cache(self, gm: fx.GraphModule) -> CompileCache | None:
        config = self.config
        if not config.uses_compile_cache:
            return None
        settings = {name: value for name, value in dataclasses.asdict(config).items()
                    if name not in NOT_IN_CACHE_KEY}
        key = digest(
            torch.__version__, __version__, _device_of(_example_values(gm)).type,
            self.pass_manager.uuid(), settings, source_files_digest(_traced_source_files()),
        )
        return CompileCache.open(config.cache_dir, key, self.counters)


def kvgraph_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                    options: Mapping[str, Any] | None = None) -> Callable:
    """The entry point torch.compile calls for `backend="kvgraph"`.

    `KVGRAPH_*` environment variables give the defaults; `options` and `mode` override them.
    """
    overrides = {**(options or {}), **({"mode": mode} if mode else {})}
    config = CompilationConfig.from_env(**overrides)
    return KVGraphBackend(config)(gm, example_inputs)
