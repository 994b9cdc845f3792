"""What turns one FX graph piece into a callable: inductor (cached on disk), nothing (eager), or
torch_npu's compilers (kvgraph/compilation/npu_piece_compilers.py)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol, Sequence, TypeVar

from torch import fx

from kvgraph.compilation.build_record import BuildObserver, BuildRecord, ignore_build
from kvgraph.compilation.cache import CompileCache
from kvgraph.compilation.counters import CompileCounters
from kvgraph.compilation.npu_piece_compilers import NpuPieceCompiler
from kvgraph.compilation.piecewise import token_symbols

logger = logging.getLogger(__name__)
T = TypeVar("T")


def output_code(artifact: Any) -> str | None:
    """The Python inductor generated for `artifact` (kept on builds, not on loads)."""
    return getattr(getattr(artifact, "_compiled_fn", None), "source_code", None) or None


class PieceCompiler(Protocol):
    """Builds a callable for `gm` from example inputs (symbolic for the general build)."""

    name: str

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], build_name: str) -> Callable:
        ...


class EagerPieceCompiler:
    """Runs pieces as the traced FX code: no compile time, the reference for everything else."""

    name = "eager"

    def __init__(self, on_build: BuildObserver = ignore_build):
        self.on_build = on_build

    def compile(self, gm, example_inputs, build_name):
        self.on_build(BuildRecord(build_name, "uncompiled", 0.0, gm.code))
        return gm


class InductorPieceCompiler:
    """Builds pieces with `torch._inductor.standalone_compile`, through the compile cache.

    Loads and builds go through the cache's inductor dir, which retries them where that dir is
    full or damaged (kvgraph/compilation/inductor_cache.py). A build inductor still fails at runs
    as the traced FX code instead, with a warning, unless `on_error` is "raise" (the config's
    `on_compile_error`). Builds, hits and fallbacks are counted in `counters` (the model's).
    """

    name = "inductor"

    def __init__(self, cache: CompileCache | None, counters: CompileCounters,
                 config_patches: dict[str, Any] | None = None, on_error: str = "eager",
                 on_build: BuildObserver = ignore_build):
        self.cache = cache
        self.counters = counters
        self.config_patches = config_patches or {}
        self.on_error = on_error
        self.on_build = on_build

    @staticmethod
    def dynamic_shapes(example_inputs: Sequence[Any]) -> str:
        """General builds keep Dynamo's (unbacked) token symbols; static builds have none."""
        return "from_tracing_context" if token_symbols(example_inputs) else "from_example_inputs"

    def compile(self, gm, example_inputs, build_name):
        start = time.perf_counter()
        why = "the compile cache is off"
        if self.cache is not None:
            loaded = self.cache.load(build_name, self._load)
            if loaded is not None:
                self.counters.add("cache_hits")
                self.on_build(BuildRecord(build_name, "loaded", time.perf_counter() - start,
                                          output_code(loaded)))
                return loaded
            why = self.cache.last_miss
        try:
            artifact = self._in_inductor_dir(lambda: self._build(gm, example_inputs, build_name))
        except Exception as error:
            if self.on_error == "raise":
                raise
            message = f"{type(error).__name__}: {str(error).strip().split(chr(10))[0]}"
            logger.warning("kvgraph: inductor could not build %s, so it runs uncompiled (eager): "
                           "%s (on_compile_error='raise' makes this an error)", build_name,
                           message)
            self.counters.add("build_fallbacks")
            self.on_build(BuildRecord(build_name, "fallback", time.perf_counter() - start,
                                      gm.code, message))
            return gm
        self.on_build(BuildRecord(build_name, "built", time.perf_counter() - start,
                                  output_code(artifact), why))
        if self.cache is not None:
            try:
                self.cache.save(build_name, lambda path: artifact.save(path=path, format="binary"))
            # Not serialisable (inductor says so with a RuntimeError or an AssertionError, e.g.
            # after reading a damaged cache entry): still usable in this process.
            except (RuntimeError, AssertionError) as error:
                logger.warning("kvgraph: could not cache %s: %s", build_name, error)
        return artifact

    def _in_inductor_dir(self, attempt: Callable[[], T]) -> T:
        """`attempt()` in the cache's inductor dir, which deals with its being full or damaged."""
        return attempt() if self.cache is None else self.cache.inductor.run(attempt)

    def _load(self, path: str):
        """The artifact at `path`, its kernels loaded (or rebuilt) in the inductor dir."""
        from torch._inductor import CompiledArtifact

        return self._in_inductor_dir(lambda: CompiledArtifact.load(path=path))

    def _build(self, gm, example_inputs, build_name):
        from torch._inductor import standalone_compile

        start = time.perf_counter()
        artifact = standalone_compile(
            gm, list(example_inputs), dynamic_shapes=self.dynamic_shapes(example_inputs),
            options={"config_patches": self.config_patches},
        )
        self.counters.add("builds")
        logger.debug("kvgraph: built %s in %.2f s", build_name, time.perf_counter() - start)
        return artifact


def make_piece_compiler(name: str, cache: CompileCache | None, counters: CompileCounters,
                        config_patches: dict[str, Any] | None = None, on_error: str = "eager",
                        on_build: BuildObserver = ignore_build) -> PieceCompiler:
    """The piece compiler the config's `piece_compiler` names (an NPU one imports torch_npu)."""
    if name == "eager":
        return EagerPieceCompiler(on_build)
    if name == "inductor":
        return InductorPieceCompiler(cache, counters, config_patches, on_error, on_build)
    return NpuPieceCompiler(name, counters, config_patches, on_error, on_build)
