"""The `kvgraph` torch.compile backend: passes, split at attention, per-size piece builds.

`torch.compile(model, backend="kvgraph", options={...})` finds `kvgraph_backend` through the
`torch_dynamo_backends` entry point; `options` keys are `CompilationConfig` fields.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import fx

from kvgraph.attention.op_names import ATTENTION_OPS
from kvgraph.compilation.build_record import BuildRecord
from kvgraph.compilation.cache import CompileCache
from kvgraph.compilation.cache_key import cache_key, graph_fingerprint, why_no_cache
from kvgraph.compilation.counters import CompileCounters
from kvgraph.compilation.debug import DumpSession
from kvgraph.compilation.graph_wrapper import GraphWrapper
from kvgraph.compilation.graph_report import node_signatures, node_table, pass_summary, split_report
from kvgraph.compilation.piece_compiler import PieceCompiler, make_piece_compiler
from kvgraph.compilation.piecewise import PiecewiseBackend, build_piece, static_sizes, token_symbols
from kvgraph.config import CompilationConfig, GraphMode, without_pieces
from kvgraph.progress import Progress
from passes import (
    REGISTERED_PASSES,
    PassManager,
    SplitGraph,
    split_at_attention,
)
from passes.op_match import is_op_call

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompiledPiece:
    """One compute piece as the backend built it, for debugging and verification.

    `graph_module` is the piece's FX code after the passes; `holder[key]` is what runs in its
    place (a build, or a GraphWrapper around one), so a checker may swap it for a while.
    `is_whole_graph`: the piece is the whole forward, attention inside (full-graph modes).
    """

    name: str
    graph_module: fx.GraphModule
    holder: dict
    key: str
    is_whole_graph: bool = False


def _example_values(gm: fx.GraphModule) -> list[Any]:
    return [n.meta["example_value"] for n in gm.graph.nodes if n.op == "placeholder"]


def _device_of(values: list[Any]) -> torch.device:
    return next((v.device for v in values if isinstance(v, torch.Tensor)), torch.device("cpu"))


class KVGraphBackend:
    """Compiles each Dynamo graph it is given according to one `CompilationConfig`.

    `counters` count what it did (the process's totals count it too).
    """

    def __init__(self, config: CompilationConfig | None = None, dump: DumpSession | None = None):
        self.config = config or CompilationConfig()
        self._dump = dump
        self.pass_manager = PassManager([REGISTERED_PASSES[name] for name in self.config.passes])
        self.counters = CompileCounters()
        self.pieces: list[CompiledPiece] = []  # of every graph compiled, in execution order

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
        dump = self.dump
        dump.begin_compile()  # first: the warnings of the compile belong to it
        try:
            return self._compile_graph(gm, dump)
        finally:
            dump.end_compile()

    def _compile_graph(self, gm: fx.GraphModule, dump: DumpSession) -> Callable:
        """Passes, split, builds: what the backend makes of one Dynamo graph, dumped."""
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
        if self.counters.dynamo_graphs > 1:
            logger.warning("kvgraph: Dynamo gave this backend graph %d: the model was traced "
                           "again (a guard failed) or a graph break split it",
                           self.counters.dynamo_graphs)
        dump.json("config", "config", dataclasses.asdict(self.config))
        dump.graph("dynamo", "dynamo", gm)
        dump.text("dynamo", "dynamo-nodes", lambda: node_table(gm), suffix=".md")
        cache = self._compile_cache(gm, dump)
        with cache.inductor_dir() if cache else contextlib.nullcontext():
            self._run_passes(gm, dump)
            compiled = self._compile(gm, values, cache, dump)
        seconds = time.perf_counter() - start
        self.counters.add("compile_seconds", seconds)
        logger.info("kvgraph: pieces ready in %.1f s: %d builds compiled, %d loaded from the "
                    "compile cache", seconds, self.counters.builds, self.counters.cache_hits)
        dump.json("counters", "counters", self.counters.snapshot(), seconds=seconds)
        if self.config.graph_mode.has_full_graphs:
            compiled = GraphWrapper(compiled, GraphMode.FULL, "full", last=True)
            if self._builds_whole_graph:
                self.pieces.append(CompiledPiece("full", gm, compiled.__dict__, "runnable",
                                                 is_whole_graph=True))
        return compiled

    def release(self) -> None:
        """Let go of the pieces and close the dump: torch keeps a backend it compiled with for
        the process's life, so what it holds would stay too."""
        self.pieces.clear()
        if self._dump is not None:
            self._dump.close()

    @property
    def dump(self) -> DumpSession:
        """The debug dump this backend writes to: the runner's, else its own (opened on the first
        compile, in `debug_dump_path` or, without one, for the structured trace alone)."""
        if self._dump is None:
            self._dump = DumpSession.open(self.config.debug_dump_path)
        return self._dump

    def _run_passes(self, gm: fx.GraphModule, dump: DumpSession) -> None:
        """The passes, each dumped as the graph after it, then one summary of what each did."""
        if not dump.active:
            self.pass_manager(gm)
            return
        summaries = []
        before, last = node_signatures(gm), time.perf_counter()
        start = last

        def observe(name: str, graph: fx.GraphModule) -> None:
            nonlocal before, last
            now = time.perf_counter()
            summaries.append({"pass": name, "seconds": now - last, **pass_summary(before, graph)})
            dump.graph("pass", f"pass-{name}", graph, seconds=now - last)
            before, last = node_signatures(graph), time.perf_counter()

        self.pass_manager(gm, observe)
        dump.json("passes", "passes", summaries, seconds=time.perf_counter() - start)

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

    def _piece_compiler(self, cache: CompileCache | None, dump: DumpSession,
                        patches: dict[str, Any], names: dict[str, str], progress: Progress
                        ) -> PieceCompiler:
        """The configured piece compiler, each build dumped under its piece's name and counted
        by `progress`."""
        def on_build(record: BuildRecord) -> None:
            progress.advance(_BUILD_TAGS.get(record.outcome))
            fingerprint, _, size = record.name.rpartition("-")
            piece = names.get(fingerprint, fingerprint[:12])
            dump.text("build", f"build-{piece}-{size}",
                      record.code or f"# {record.outcome}: no code kept\n",
                      seconds=record.seconds,
                      data={"piece": piece, "size": size, "outcome": record.outcome,
                            "why": record.why, "cache_name": record.name})

        config = self.config
        return make_piece_compiler(config.piece_compiler, cache, self.counters, patches,
                                   config.on_compile_error, on_build)

    @property
    def _builds_whole_graph(self) -> bool:
        """Modes whose only graphs are full ones, or nothing to split at: the whole graph is one
        piece, attention included."""
        return self.config.graph_mode.only_full_graphs or not self.config.splitting_ops

    def _compile(self, gm: fx.GraphModule, values: list[Any], cache: CompileCache | None,
                 dump: DumpSession) -> Callable:
        config = self.config
        if self._builds_whole_graph:
            from passes.inductor_pass import InplaceAttentionPass  # imports Dynamo: compile only

            patches = dict(config.inductor_options)
            patches["post_grad_custom_post_pass"] = InplaceAttentionPass(config.splitting_ops
                                                                         or ATTENTION_OPS)
            fingerprint = graph_fingerprint(gm)
            self.counters.add("pieces")
            with self._build_progress([gm]) as progress:
                compiler = self._piece_compiler(cache, dump, patches, {fingerprint: "full"},
                                                progress)
                return build_piece(gm, values, config.compile_sizes, compiler, fingerprint,
                                   self.counters)
        return self._compile_pieces(gm, cache, dump)

    def _build_progress(self, pieces: list[fx.GraphModule]) -> Progress:
        """Progress over the builds of distinct `pieces`: each one's general build and one per
        compile size it gets."""
        config = self.config
        total = sum(1 + len(static_sizes(_example_values(gm), config.compile_sizes,
                                         config.piece_compiler)) for gm in pieces)
        logger.info("kvgraph: Dynamo traced the model; building %d distinct piece%s with %s "
                    "(%d build%s)", len(pieces), "s" * (len(pieces) != 1), config.piece_compiler,
                    total, "s" * (total != 1))
        return Progress("piece builds", total)

    def _compile_pieces(self, gm: fx.GraphModule, cache: CompileCache | None,
                        dump: DumpSession) -> fx.GraphModule:
        config = self.config
        start = time.perf_counter()
        split = split_at_attention(gm, config.splitting_ops)
        fingerprints = {piece.name: graph_fingerprint(piece.graph_module)
                        for piece in split.pieces if not piece.is_splitting_op}
        dump.graph("split", "split", split.split_module, seconds=time.perf_counter() - start)
        dump.json("split", "split-pieces", lambda: split_report(split, fingerprints))
        names = {fingerprint: name for name, fingerprint in reversed(fingerprints.items())}
        distinct = [piece.graph_module for piece in split.pieces if piece.name in names.values()]
        with self._build_progress(distinct) as progress:
            compiler = self._piece_compiler(cache, dump, config.inductor_options, names, progress)
            self._build_pieces(split, fingerprints, compiler, dump)
        return split.split_module

    def _build_pieces(self, split: SplitGraph, fingerprints: dict[str, str],
                      compiler: PieceCompiler, dump: DumpSession) -> None:
        """Build each distinct compute piece of `split` once and put it (graph-wrapped in a
        piecewise mode) in its place in the split module."""
        config = self.config
        built: dict[str, PiecewiseBackend] = {}
        last = [piece for piece in split.pieces if not piece.is_splitting_op][-1].name
        for piece in split.pieces:
            dump.graph("piece", f"piece-{piece.name}", piece.graph_module)
            if piece.is_splitting_op:
                continue
            self.counters.add("pieces")
            fingerprint = fingerprints[piece.name]
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
            self.pieces.append(CompiledPiece(piece.name, piece.graph_module,
                                             split.split_module.__dict__, piece.name))

    def _compile_cache(self, gm: fx.GraphModule, dump: DumpSession) -> CompileCache | None:
        """The compile cache for this graph's key, with the key and its factors dumped."""
        config = self.config
        if not config.uses_compile_cache:
            dump.json("cache", "cache-key", {"used": False, "why": why_no_cache(config)})
            return None
        key, factors = cache_key(config, _device_of(_example_values(gm)).type,
                                 self.pass_manager.uuid())
        cache = CompileCache.open(config.cache_dir, key, self.counters)
        if cache is not None:
            cache.record_factors(factors)
        dump.json("cache", "cache-key", {
            "used": cache is not None, "key": key, "directory": cache and str(cache.directory),
            "why": None if cache else f"{config.cache_dir} could not be made or used (see the "
                                      "warning before this)",
            "key_change": cache and cache.key_change, "factors": factors})
        return cache


# How a build's outcome shows in the progress of the piece builds (built ones are untagged).
_BUILD_TAGS = {"loaded": "from the compile cache", "fallback": "fell back to eager"}

_shared_dumps: dict[str | None, DumpSession] = {}


def kvgraph_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: str | None = None,
                    options: Mapping[str, Any] | None = None) -> Callable:
    """The entry point torch.compile calls for `backend="kvgraph"`.

    `KVGRAPH_*` environment variables give the defaults; `options` and `mode` override them.
    Every such compile in a process shares one debug dump session per `debug_dump_path` (each
    Dynamo graph a compile of its own); `KVGraphBackend(config)` has one of its own.
    """
    overrides = {**(options or {}), **({"mode": mode} if mode else {})}
    config = CompilationConfig.from_env(**overrides)
    path = config.debug_dump_path
    if path not in _shared_dumps:
        _shared_dumps[path] = DumpSession.open(path)
    return KVGraphBackend(config, _shared_dumps[path])(gm, example_inputs)
