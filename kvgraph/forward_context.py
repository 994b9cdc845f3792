"""Per-step state that attention ops read: the batch's metadata and its descriptor."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from kvgraph.errors import ForwardContextError

if TYPE_CHECKING:
    import torch

    from kvgraph.attention.metadata import AttentionMetadata
    from kvgraph.graph_mode import GraphMode

# What an attention op tells a probe after it ran: its op name, the layer's cache (which names
# the layer), its inputs and its output. See ForwardContext.probe.
AttentionProbe = Callable[[str, "list[torch.Tensor]", "tuple[torch.Tensor, ...]", "torch.Tensor"],
                          None]


class KVLayerHooks(Protocol):
    """A KV connector's per-layer calls, as an attention op reaches them through the context.

    kvgraph.kv_transfer's LayerHooks is the one implementation (it names the layer from its
    cache and calls the connector); typed here so the context, which every layer reads, does
    not name the transfer code above it.
    """

    def before_attention(self, kv_cache: list[torch.Tensor]) -> None:
        """Before a layer's op reads its cache: wait for that layer's load."""

    def after_attention(self, kv_cache: list[torch.Tensor], attn_metadata: Any) -> None:
        """After a layer's op wrote its cache: hand the layer to the connector to save."""


class StepGraphs(Protocol):
    """The graphs a step runs on, as a graph wrapper reaches them through the forward context.

    The runtime's GraphSet is the one implementation; typing the context's `graphs` with this
    keeps the context, which every layer reads, from naming the runtime that sits on top.
    """

    def run(self, wrapper: Any, args: tuple) -> Any:
        """`wrapper`'s graph for the step under way (a kvgraph.compilation GraphWrapper)."""


@dataclass(frozen=True)
class BatchDescriptor:
    """The key of a captured graph: the padded batch shape a graph was recorded for.

    `num_reqs` is None for piecewise keys, whose pieces do not depend on how tokens are
    grouped into requests. `uniform_decode` marks uniform batches, where every request adds
    `query_len` tokens: one for a decode step, 1 + K for a speculative verify step (so a
    uniform key with `num_reqs` has `num_tokens == num_reqs * query_len`). Its repr leaves
    `query_len` out when it is 1, so decode keys read as they did before verify keys existed
    (stats, dumps and logs key graphs by it).
    """

    num_tokens: int
    num_reqs: int | None = None
    uniform_decode: bool = False
    query_len: int = 1

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"BatchDescriptor.num_tokens must be >= 1, got {self.num_tokens}")
        if self.num_reqs is not None and not 1 <= self.num_reqs <= self.num_tokens:
            raise ValueError(
                f"BatchDescriptor.num_reqs must be in [1, num_tokens={self.num_tokens}], "
                f"got {self.num_reqs}"
            )
        if self.query_len < 1 or (self.query_len > 1 and not self.uniform_decode):
            raise ValueError(f"BatchDescriptor.query_len must be >= 1, and above 1 only for a "
                             f"uniform batch (uniform_decode=True), got {self.query_len}")
        if (self.uniform_decode and self.num_reqs is not None
                and self.num_tokens != self.num_reqs * self.query_len):
            raise ValueError(
                f"a uniform BatchDescriptor has num_tokens == num_reqs * query_len, got "
                f"num_tokens={self.num_tokens}, num_reqs={self.num_reqs}, "
                f"query_len={self.query_len}")

    def __repr__(self) -> str:
        extra = f", query_len={self.query_len}" if self.query_len != 1 else ""
        return (f"BatchDescriptor(num_tokens={self.num_tokens}, num_reqs={self.num_reqs}, "
                f"uniform_decode={self.uniform_decode}{extra})")


@dataclass(frozen=True)
class ForwardContext:
    """What one forward call needs besides its inputs.

    `attn_backend` names the attention backend (see `kvgraph.attention.backends`); None picks
    the default for the device the attention inputs live on. `runtime_mode` is what the
    dispatcher chose for this step (`NONE`, `PIECEWISE` or `FULL`): graph wrappers of that mode
    replay the `batch_descriptor`'s graph from `graphs` (the runner's graph set), all others
    just run; without `graphs` every wrapper just runs. `probe`, when set, is called by every
    attention op after it ran (see AttentionProbe): how verify mode finds the first layer
    where two runs of one batch part. It costs one attribute check per op when unset.
    `kv_hooks`, when set, are a layer-by-layer KV connector's (see KVLayerHooks): each op that
    writes a cache calls them before and after it runs; unset, they cost one check per op.
    """

    attn_metadata: AttentionMetadata | None
    batch_descriptor: BatchDescriptor | None = None
    attn_backend: str | None = None
    runtime_mode: GraphMode | None = None
    graphs: StepGraphs | None = None
    probe: AttentionProbe | None = None
    kv_hooks: KVLayerHooks | None = None


_current: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "kvgraph_forward_context", default=None
)


@contextlib.contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None,
    batch_descriptor: BatchDescriptor | None = None,
    attn_backend: str | None = None,
    runtime_mode: GraphMode | None = None,
    graphs: StepGraphs | None = None,
    probe: AttentionProbe | None = None,
    kv_hooks: KVLayerHooks | None = None,
) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention op called inside the block.

    Contexts nest: leaving an inner one restores the outer one, also on an exception.
    """
    context = ForwardContext(attn_metadata, batch_descriptor, attn_backend, runtime_mode, graphs,
                             probe, kv_hooks)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


@contextlib.contextmanager
def kv_hooks_suspended() -> Iterator[None]:
    """Inside the block, attention ops call no KV connector hooks: what a replayed device graph
    does, as no Python runs in it. The CPU graph replays under this to keep that contract."""
    context = _current.get()
    if context is None or context.kv_hooks is None:
        yield
        return
    token = _current.set(dataclasses.replace(context, kv_hooks=None))
    try:
        yield
    finally:
        _current.reset(token)


def get_forward_context() -> ForwardContext:
    """The innermost active forward context; an error if attention runs outside one."""
    context = _current.get()
    if context is None:
        raise ForwardContextError(
            "kvgraph attention was called outside a forward context. Wrap the model call in "
            "`with kvgraph.set_forward_context(kvgraph.build_attention_metadata(chunks, "
            "block_size, device)): model(input_ids, positions)`, or run it through "
            "kvgraph.ModelRunner, which does this for you."
        )
    return context


def current_forward_context() -> ForwardContext | None:
    """The active forward context, or None (for code that also runs outside one)."""
    return _current.get()
