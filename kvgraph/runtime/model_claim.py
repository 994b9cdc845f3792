"""One live runner per model: which runner bound a model's attention layers, and letting go.

A runner binds its own KV caches to the model's attention layers. A second runner binding the
same layers would make the first one's steps read and write the second one's caches, silently;
so the layers remember their runner, and binding layers another live runner holds is refused.
A runner lets go when it is closed or garbage-collected: its caches are unbound then, so they
do not outlive it through the model.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Iterable

from torch import nn

from kvgraph.errors import RunnerError

_ATTRIBUTE = "_kvgraph_runner"  # on each attention layer: a weak reference to its runner


def _holders(layers: Iterable[nn.Module]) -> set[Any]:
    refs = (layer.__dict__.get(_ATTRIBUTE) for layer in layers)
    return {runner for runner in (ref() for ref in refs if ref is not None) if runner is not None}


def claim(layers: dict[str, nn.Module], runner: Any) -> weakref.ref:
    """Mark `layers` as `runner`'s, or a RunnerError if another live runner holds them.

    A dropped runner in a reference cycle still looks alive until the next collection, so one
    collection runs before refusing.
    """
    if _holders(layers.values()) - {runner}:
        gc.collect()
    others = _holders(layers.values()) - {runner}
    if others:
        raise RunnerError(
            "this model's attention layers are bound to another live ModelRunner; two runners "
            "on one model would read and write each other's KV caches. Call close() on the "
            "other runner (or drop it) first, or give each runner a model of its own")
    ref = weakref.ref(runner)
    for layer in layers.values():
        layer.__dict__[_ATTRIBUTE] = ref
    weakref.finalize(runner, release, list(layers.values()), ref)
    return ref


def release(layers: Iterable[nn.Module], ref: weakref.ref) -> None:
    """Let go of the layers `ref`'s runner holds, unbinding their caches (which go with it)."""
    for layer in layers:
        if layer.__dict__.get(_ATTRIBUTE) is ref:
            del layer.__dict__[_ATTRIBUTE]
            layer.kv_cache = ()
