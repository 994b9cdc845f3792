"""Compile a model with kvgraph so one trace serves every batch size, 1 included."""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable

import torch
from torch import nn

from kvgraph.compilation.backend import KVGraphBackend
from kvgraph.compilation.debug import DumpSession
from kvgraph.config import CompilationConfig
from kvgraph.errors import CompileError


def mark_token_dims(*tensors: torch.Tensor) -> None:
    """Make dim 0 of each tensor dynamic for Dynamo's next trace, sizes 0 and 1 included.

    Unbacked (rather than backed) symbols are used because Dynamo specialises backed sizes of
    1, which would trace a second graph for one-token batches.
    """
    for tensor in tensors:
        torch._dynamo.decorators.mark_unbacked(tensor, 0)


def own_forward(model: nn.Module) -> Callable:
    """`model.forward`, bound to `model`, on a code object and globals of its own.

    Dynamo keeps compiled code, and counts recompiles against its limit of 8, per code object.
    Every model of one class would share both: a process's ninth runner would silently run
    uncompiled, and a dropped runner's compiled code would stay reachable. A private copy of
    the code gives each compiled model entries of its own, freed with it. Dynamo also installs
    each compiled graph (`__compiled_fn_*`) in the traced function's globals; in the module's
    they would outlive the model, so the copy gets a copy of them (the forward then sees the
    module's globals as they were when it was compiled), which `CompiledModel` empties when
    it goes.
    """
    function = type(model).forward
    own = types.FunctionType(function.__code__.replace(), dict(function.__globals__),
                             function.__name__, function.__defaults__, function.__closure__)
    own.__kwdefaults__ = function.__kwdefaults__
    own.__qualname__ = function.__qualname__
    return types.MethodType(own, model)


class CompiledModel:
    """A model compiled by kvgraph: call it as the model, with `(input_ids, positions)`.

    After the first trace Dynamo's guards are dropped (`config.check_guards` keeps them): the
    compiled code is only valid for the caches bound when it was traced, which ModelRunner
    guarantees by binding before the first call and never rebinding to other shapes.

    Traces specialise float attributes (`eps`, `scale`). Dynamo otherwise turns a float whose
    value changed since an earlier compile of the same function (its file, line and name, so
    every model of one class, in this process or, through its profile cache, an earlier one)
    into a graph input wrapped in a new tensor on every call, which a captured graph would
    read from a stale address.

    `release()` (or dropping it) frees the compiled code. Dropping alone would not: Dynamo's
    guards keep a finalizer on long-lived objects (builtins among them) that holds the guarded
    function's globals, and through them every graph compiled for it, for the process's life.
    """

    def __init__(self, model: nn.Module, config: CompilationConfig | None = None,
                 dump: DumpSession | None = None):
        self.model = model
        self.config = config or CompilationConfig()
        self.backend = KVGraphBackend(self.config, dump)
        options: dict[str, Any] = {}
        if not self.config.check_guards:
            options["guard_filter_fn"] = torch.compiler.skip_all_guards_unsafe
        forward = own_forward(model)
        self._code = forward.__func__.__code__
        self._globals = forward.__func__.__globals__
        self._own_names = set(self._globals)
        weakref.finalize(self, _release, self._globals, self._own_names, self.backend)
        self._compiled = torch.compile(forward, backend=self.backend, options=options)
        self._traced = False

    def release(self) -> None:
        """Free the compiled code (what Dynamo installed in the forward's globals); the model
        cannot be called through this object afterwards."""
        _release(self._globals, self._own_names, self.backend)
        self._compiled = None

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs: Any) -> Any:
        mark_token_dims(input_ids, positions)
        if self._traced and not self.config.check_guards:  # no guards: it never traces again
            return self._compiled(input_ids, positions, **kwargs)
        with torch._dynamo.config.patch(specialize_float=True):
            hidden_states = self._compiled(input_ids, positions, **kwargs)
        if not self._traced:
            self._traced = True
            self.backend.dump.text("bytecode", "bytecode", lambda: transformed_code(self._code))
        return hidden_states

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)


def _release(scope: dict[str, Any], original: set[str], backend: KVGraphBackend) -> None:
    """Free what outlives a compiled model unless let go: what Dynamo installed in its forward's
    globals, and what its backend holds (torch keeps the backend object for the process)."""
    _drop_installed(scope, original)
    backend.release()


def _drop_installed(scope: dict[str, Any], original: set[str]) -> None:
    """Let go of what Dynamo installed in `scope` (every name not in `original`). The names stay,
    set to None: Dynamo deletes each when its code goes, and would fail on a missing one."""
    for name in scope.keys() - original:
        scope[name] = None


def transformed_code(code: types.CodeType) -> str:
    """The bytecode Dynamo made of `code`, decompiled to Python by depyf (when installed)."""
    try:
        import depyf
    except ImportError:
        return "# install depyf (pip install depyf) to see the bytecode Dynamo made, as Python\n"
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(code)
    parts = []
    for number, entry in enumerate(entries):
        try:
            source = depyf.decompile(entry.code)
        except Exception as error:  # noqa: BLE001 - depyf cannot read every torch's bytecode
            source = f"# depyf could not decompile it: {type(error).__name__}: {error}\n"
        parts.append(f"# --- transformed code {number} of {code.co_name} ---\n{source}")
    return "\n".join(parts) or f"# Dynamo holds no compiled code for {code.co_name}\n"


def compile_model(model: nn.Module, config: CompilationConfig | None = None,
                  dump: DumpSession | None = None) -> CompiledModel:
    """Compile `model` with kvgraph (see `CompiledModel`); `dump` is the runner's debug dump."""
    return CompiledModel(model, config, dump)


def compile_failure(error: BaseException) -> CompileError:
    """The CompileError for a first call that failed with `error`: it names the innermost error
    Dynamo wrapped (a backend's own), as `Type: message`."""
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None or inner is error:
            break
        error = inner
    first_line = str(error).strip().splitlines()[0] if str(error) else ""
    return CompileError(f"compiling the model failed: {type(error).__name__}: {first_line}")
