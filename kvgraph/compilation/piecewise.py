"""A compiled piece with its builds: one general (any num_tokens) and one static per size."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kvgraph.compilation.counters import CompileCounters


def token_symbols(example_values: Sequence[Any]) -> set[sympy.Symbol]:
    """Every symbol in the inputs' shapes: kvgraph marks only token dimensions dynamic."""
    symbols: set[sympy.Symbol] = set()
    for value in example_values:
        if isinstance(value, torch.SymInt):
            symbols |= value.node.expr.free_symbols
        elif isinstance(value, torch.Tensor):
            for dim in (*value.shape, *value.stride()):
                if isinstance(dim, torch.SymInt):
                    symbols |= dim.node.expr.free_symbols
    return symbols


def _concrete(value: Any, symbols: set[sympy.Symbol], num_tokens: int) -> int:
    if isinstance(value, torch.SymInt):
        return int(value.node.expr.xreplace({s: num_tokens for s in symbols}))
    return int(value)


def static_inputs(example_values: Sequence[Any], num_tokens: int) -> list[Any]:
    """The inputs of a static build for `num_tokens`: fakes with every token symbol replaced."""
    symbols = token_symbols(example_values)
    fake_mode = FakeTensorMode()
    inputs = []
    with fake_mode:
        for value in example_values:
            if isinstance(value, torch.Tensor):
                shape = [_concrete(d, symbols, num_tokens) for d in value.shape]
                stride = [_concrete(s, symbols, num_tokens) for s in value.stride()]
                inputs.append(torch.empty_strided(shape, stride, dtype=value.dtype,
                                                  device=value.device))
            else:
                inputs.append(_concrete(value, symbols, num_tokens))
    return inputs


def token_count_reader(example_values: Sequence[Any]) -> Callable[[Sequence[Any]], int] | None:
    """How to read num_tokens from a piece's runtime arguments; None for a static piece."""
    for index, value in enumerate(example_values):
        if isinstance(value, torch.SymInt):
            return lambda args, i=index: args[i]
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(value.shape[0], torch.SymInt):
            return lambda args, i=index: args[i].shape[0]
    return None


@dataclass
class PiecewiseBackend:
    """Calls the static build for the runtime num_tokens when there is one, else the general."""

    general: Callable
    static: dict[int, Callable] = field(default_factory=dict)
    read_num_tokens: Callable[[Sequence[Any]], int] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.static and self.read_num_tokens is not None:
            build = self.static.get(self.read_num_tokens(args))
            if build is not None:
                return build(*args)
        return self.general(*args)


def static_sizes(example_values: Sequence[Any], compile_sizes: Sequence[int],
                 compiler_name: str) -> tuple[int, ...]:
    """The sizes a piece gets a static build for: every compile size, when its token count is
    dynamic and its compiler compiles (an eager "build" is the FX code, the same at any size)."""
    if compiler_name == "eager" or token_count_reader(example_values) is None:
        return ()
    return tuple(compile_sizes)


def build_piece(gm, example_values, compile_sizes, compiler, name: str,
                counters: CompileCounters) -> PiecewiseBackend:
    """Compile `gm` once generally and once per size in `compile_sizes` (when it is dynamic)."""
    general = compiler.compile(gm, example_values, f"{name}-general")
    static = {}
    # A piece whose general build fell back to its FX code (`gm`) runs that at every size.
    if general is not gm:
        for size in static_sizes(example_values, compile_sizes, compiler.name):
            static[size] = compiler.compile(gm, static_inputs(example_values, size), f"{name}-{size}")
    counters.add("unique_pieces")
    return PiecewiseBackend(general, static, token_count_reader(example_values))
