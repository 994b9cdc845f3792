"""NPU piece compilers: pieces built by torch_npu's dynamo compilers, npugraph_ex or torchair.

Both ship inside the torch_npu wheel (torch_npu/dynamo/npugraph_ex, torch_npu/dynamo/torchair);
importing torch_npu puts lazy stand-ins for them in `sys.modules`, so `import npugraph_ex` and
`import torchair` work after it, which is how vllm-ascend imports them. They are imported only
when such a compiler is made: torch_npu without the Ascend toolkit fails on import, and the real
npugraph_ex installs atexit and SIGTERM/SIGINT handlers when it loads.

Each is a dynamo-style backend, `backend(gm, example_inputs)`, that runs aot_autograd on the
piece and builds the ATen graph:
- npugraph_ex, with the options vllm-ascend uses: `force_eager=True` (its FX passes, no
  capture of its own: kvgraph captures the piece), `inplace_pass=False`, `clone_input=False`
  and `clone_output=False`. The KV caches are graph inputs the attention op writes in place, so
  an input clone would take the writes; a whole-graph build also gets kvgraph's in-place
  attention pass as npugraph_ex's `post_grad_custom_pre_pass`, so the op writes the caches
  themselves rather than a functionalised copy.
- torchair, with its default config: mode "max-autotune", one GE (Ascend IR) graph per piece.
  Its "reduce-overhead" mode is deprecated in favour of npugraph_ex. Unknown until run on an
  NPU: whether kvgraph's ACL graphs can capture a GE graph's run, and what GE makes of a whole
  graph, whose attention op has no GE converter (a build that fails falls back, below).
Neither keeps artifacts kvgraph's compile cache can hold, so none is used (said once per
compile). A build that fails runs as the FX code with a warning, as inductor's do, unless
`on_error` is "raise". Not run on Ascend hardware by kvgraph's tests, which fake both
(tests/kvgraph/compilation/test_npu_piece_compilers.py).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable

import torch

from kvgraph.compilation.counters import CompileCounters
from kvgraph.compilation.build_record import BuildObserver, BuildRecord
from kvgraph.errors import PlatformError

logger = logging.getLogger(__name__)

# vllm-ascend's npugraph_ex options (vllm_ascend/compilation/compiler_interface.py).
NPUGRAPH_EX_OPTIONS = {"force_eager": True, "inplace_pass": False, "clone_input": False,
                       "clone_output": False}
# Without the toolkit, an installed torch_npu breaks `import torch` (torch loads it by default).
ELSEWHERE = ("elsewhere choose piece_compiler 'inductor' or 'eager' (with torch_npu installed, "
             "TORCH_DEVICE_BACKEND_AUTOLOAD=0 keeps `import torch` working there)")


def why_not_cached(name: str) -> str:
    """Why the compile cache holds none of piece compiler `name`'s builds."""
    return f"piece_compiler {name!r} keeps no artifacts kvgraph can cache"


def _summary(error: BaseException) -> str:
    """`Type: first line` of `error`, so that messages quoting it stay one line."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def _import_torch_npu(name: str) -> None:
    """Import torch_npu for piece compiler `name`, or a PlatformError saying why it cannot."""
    try:
        import torch_npu  # noqa: F401 - registers the NPU and the lazy npugraph_ex and torchair
    except (ImportError, OSError, RuntimeError) as error:
        if isinstance(error, ModuleNotFoundError) and error.name == "torch_npu":
            cause = ("torch_npu is not installed: install it with the Ascend toolkit (pip "
                     "install 'kvgraph[npu]' on an Ascend machine)")
        else:
            cause = (f"importing torch_npu failed ({_summary(error)}): the Ascend toolkit is "
                     "missing or not set up (source its set_env.sh)")
        # One line, no chained cause: the runner reports an error's innermost cause, first line.
        raise PlatformError(f"piece_compiler {name!r} builds pieces through torch_npu, but "
                            f"{cause}; {ELSEWHERE}") from None


def _not_provided(name: str, error: Exception) -> PlatformError:
    other = "torchair" if name == "npugraph_ex" else "npugraph_ex"
    return PlatformError(f"piece_compiler {name!r}: this torch_npu does not provide {name} "
                         f"({_summary(error)}); use a torch_npu that ships it, or "
                         f"piece_compiler {other!r}")


def _npugraph_ex_backend(config_patches: dict[str, Any]) -> Callable:
    _import_torch_npu("npugraph_ex")
    try:
        import npugraph_ex  # loads torch_npu's npugraph_ex (and its exit handlers) here
    # torch_npu's lazy stand-in re-raises whatever the real import raised, as its own type.
    except Exception as error:  # noqa: BLE001
        raise _not_provided("npugraph_ex", error) from None
    options = dict(NPUGRAPH_EX_OPTIONS)
    graph_pass = config_patches.get("post_grad_custom_post_pass")
    if graph_pass is not None:  # a whole-graph build: kvgraph's in-place attention pass
        options["post_grad_custom_pre_pass"] = functools.partial(_run_graph_pass, graph_pass)
    backend = npugraph_ex.get_npu_backend(compiler_config=npugraph_ex.CompilerConfig())
    # Options as torch.compile(backend="npugraph_ex", options=...) hands them to this backend.
    return functools.partial(backend, options=options)


def _torchair_backend(config_patches: dict[str, Any]) -> Callable:
    _import_torch_npu("torchair")
    try:
        import torchair  # loads torch_npu's torchair here
    except Exception as error:  # noqa: BLE001 - as for npugraph_ex
        raise _not_provided("torchair", error) from None
    return torchair.get_npu_backend(compiler_config=torchair.CompilerConfig())


def _run_graph_pass(graph_pass: Callable[[torch.fx.Graph], None], gm: torch.fx.GraphModule,
                    example_inputs: Any, config: Any) -> None:
    """An inductor post-grad graph pass in npugraph_ex's FX pass signature."""
    graph_pass(gm.graph)
    gm.recompile()  # the graph changed: its code must follow (a lazy module's would anyway)


_BACKENDS = {"npugraph_ex": _npugraph_ex_backend, "torchair": _torchair_backend}
NPU_PIECE_COMPILERS = tuple(_BACKENDS)


class NpuPieceCompiler:
    """Builds pieces with one of torch_npu's dynamo backends (`name`: npugraph_ex or torchair).

    Made only when chosen: making it imports torch_npu and the backend, and fails there, with
    a PlatformError, where they cannot be had. Builds and fallbacks are counted in `counters`.
    """

    def __init__(self, name: str, counters: CompileCounters, config_patches: dict[str, Any] | None,
                 on_error: str, on_build: BuildObserver):
        self.name = name
        self.counters = counters
        self.on_error = on_error
        self.on_build = on_build
        self._backend = _BACKENDS[name](config_patches or {})
        self._said_no_cache = False

    def compile(self, gm, example_inputs, build_name):
        self._say_no_cache()
        start = time.perf_counter()
        try:
            built = self._backend(gm, list(example_inputs))
        except Exception as error:
            if self.on_error == "raise":
                raise
            return self._fall_back(gm, build_name, error, start)
        self.counters.add("builds")
        self.on_build(BuildRecord(build_name, "built", time.perf_counter() - start, None,
                                  why_not_cached(self.name)))
        return built

    def _fall_back(self, gm, build_name: str, error: Exception, start: float):
        message = _summary(error)
        logger.warning("kvgraph: %s could not build %s, so it runs uncompiled (eager): %s "
                       "(on_compile_error='raise' makes this an error)", self.name, build_name,
                       message)
        self.counters.add("build_fallbacks")
        self.on_build(BuildRecord(build_name, "fallback", time.perf_counter() - start, gm.code,
                                  message))
        return gm

    def _say_no_cache(self) -> None:
        """Once per compile, not per piece: no build of this compiler is cached."""
        if not self._said_no_cache:
            self._said_no_cache = True
            logger.info("kvgraph: %s, so the compile cache is skipped and each process builds "
                        "its pieces anew", why_not_cached(self.name))


