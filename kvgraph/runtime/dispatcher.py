"""Planning each step: its host batch, its graph (capture sizes, padding, descriptor), its shape."""

from __future__ import annotations

import bisect
import collections
import logging
from dataclasses import dataclass, field
from typing import Sequence

from kvgraph.attention.backends.base import GraphSupport
from kvgraph.attention.batch import HostBatch, check_distinct_blocks, host_batch
from kvgraph.attention.metadata import RequestChunk
from kvgraph.config import GraphMode
from kvgraph.forward_context import BatchDescriptor
from kvgraph.runtime.step import StepLimits, StepPlan

logger = logging.getLogger(__name__)


def resolve_graph_mode(mode: GraphMode, support: GraphSupport, backend: str,
                       can_split: bool = True) -> GraphMode:
    """`mode`, or the closest mode `backend` can serve, with a warning saying what and why.

    `can_split` is False when the config has no splitting ops, so no piecewise graphs exist.
    """
    piecewise = GraphMode.PIECEWISE if can_split else GraphMode.NONE
    with_decode = GraphMode.FULL_AND_PIECEWISE if can_split else GraphMode.FULL_DECODE_ONLY
    downgrades = {
        GraphSupport.UNIFORM_DECODE: {GraphMode.FULL: with_decode},
        GraphSupport.NEVER: {
            GraphMode.FULL: piecewise,
            GraphMode.FULL_AND_PIECEWISE: piecewise,
            GraphMode.FULL_DECODE_ONLY: GraphMode.NONE,
        },
    }
    resolved = downgrades.get(support, {}).get(mode, mode)
    if resolved is not mode:
        logger.warning(
            "kvgraph: graph mode %r downgraded to %r: attention backend %r captures attention "
            "only for %s batches%s", mode.value, resolved.value, backend,
            "uniform-decode" if support is GraphSupport.UNIFORM_DECODE else "no",
            "" if resolved.has_full_graphs or resolved.has_piecewise_graphs
            else ", and with no splitting_ops there are no pieces: nothing will be captured",
        )
    return resolved


@dataclass
class DispatchStats:
    """Counts of what the dispatcher chose, readable from the runner."""

    hits: collections.Counter = field(default_factory=collections.Counter)
    padded_tokens: int = 0
    fallbacks: int = 0  # batches above the largest capture size, run without graphs
    uncaptured: int = 0  # batches whose descriptor has no captured graph, run without graphs


class Dispatcher:
    """Plans each step for one resolved graph mode: `(runtime_mode, BatchDescriptor)` and shape.

    Full-graph keys for uniform decode carry `num_reqs` (attention metadata shapes depend on
    it) and exist only up to `max_num_seqs`; piecewise keys carry only `num_tokens`. A key is
    dispatched to its graphs only once it is in `captured`; before, its batches run without.

    `freezes_shapes`: whether a full graph freezes the host ints attention's shapes depend on.
    A device graph does, so its steps are planned with the largest values (`max_model_len`
    keys per request for the portable backend); a CPU graph reruns Python on replay, so its
    steps keep their own lengths. `vocab_size`, when known, bounds the token ids.
    """

    def __init__(self, graph_mode: GraphMode, capture_sizes: tuple[int, ...], limits: StepLimits,
                 freezes_shapes: bool = True, vocab_size: int | None = None):
        self.graph_mode = graph_mode
        self.limits = limits
        self.freezes_shapes = freezes_shapes
        self.vocab_size = vocab_size
        self.capture_sizes = tuple(sorted(capture_sizes))
        self.decode_sizes = tuple(s for s in self.capture_sizes if s <= limits.max_num_seqs)
        self.stats = DispatchStats()
        self.captured: set[tuple[GraphMode, BatchDescriptor]] = set()
        self._warned_fallback = self._warned_uncaptured = False

    @staticmethod
    def _padded(sizes: tuple[int, ...], n: int) -> int | None:
        i = bisect.bisect_left(sizes, n)
        return sizes[i] if i < len(sizes) else None

    def plan(self, chunks: Sequence[RequestChunk]) -> StepPlan:
        """Validate, lay out and dispatch one step; a BatchError names any limit it exceeds."""
        batch = host_batch(chunks, self.limits.block_size, self.vocab_size)
        check_distinct_blocks(batch)
        self.limits.check(batch)
        mode, descriptor = self.dispatch(batch.num_tokens, batch.num_reqs, batch.uniform_decode)
        return self.plan_for(batch, mode, descriptor)

    def plan_for(self, batch: HostBatch, mode: GraphMode, descriptor: BatchDescriptor,
                 writes_cache: bool = True) -> StepPlan:
        """The plan of `batch` run as `descriptor` in `mode` (capture chooses its own)."""
        if mode is GraphMode.FULL and descriptor.uniform_decode and not self.freezes_shapes:
            shape = (descriptor.num_reqs, 1, batch.max_seq_len)
        elif mode is not GraphMode.FULL or not self.freezes_shapes:
            shape = (batch.num_reqs, batch.max_query_len, batch.max_seq_len)
        elif descriptor.uniform_decode:  # a device graph freezes attention's shapes: the largest
            shape = (descriptor.num_reqs, 1, self.limits.max_model_len)
        else:
            shape = (self.limits.max_num_seqs, descriptor.num_tokens, self.limits.max_model_len)
        return StepPlan(batch, mode, descriptor, *shape, writes_cache=writes_cache)

    def dispatch(self, num_tokens: int, num_reqs: int, uniform_decode: bool
                 ) -> tuple[GraphMode, BatchDescriptor]:
        mode, descriptor = self._choose(num_tokens, num_reqs, uniform_decode)
        if mode is GraphMode.FULL and (mode, descriptor) not in self.captured:
            # A full graph that failed to capture: the same size's piecewise graphs may exist.
            piecewise = (GraphMode.PIECEWISE, BatchDescriptor(descriptor.num_tokens))
            if piecewise in self.captured:
                mode, descriptor = piecewise
        if mode is not GraphMode.NONE and (mode, descriptor) not in self.captured:
            self.stats.uncaptured += 1
            if not self._warned_uncaptured:
                self._warned_uncaptured = True
                logger.info("kvgraph: a batch for %s %s ran without graphs: none was captured "
                            "(call ModelRunner.capture(); counted in stats, logged once)",
                            mode.value, descriptor)
            mode, descriptor = GraphMode.NONE, BatchDescriptor(num_tokens)
        self.stats.hits[(mode.value, descriptor)] += 1
        self.stats.padded_tokens += descriptor.num_tokens - num_tokens
        return mode, descriptor

    def _choose(self, num_tokens: int, num_reqs: int, uniform_decode: bool
                ) -> tuple[GraphMode, BatchDescriptor]:
        if self.graph_mode in (GraphMode.EAGER, GraphMode.NONE):
            return GraphMode.NONE, BatchDescriptor(num_tokens)
        if self.graph_mode.has_full_graphs and uniform_decode:
            padded = self._padded(self.decode_sizes, num_tokens)
            if padded is not None:
                return GraphMode.FULL, BatchDescriptor(padded, padded, uniform_decode=True)
        padded = self._padded(self.capture_sizes, num_tokens)
        if padded is not None and self.graph_mode is GraphMode.FULL:
            return GraphMode.FULL, BatchDescriptor(padded)
        if padded is not None and self.graph_mode.has_piecewise_graphs:
            return GraphMode.PIECEWISE, BatchDescriptor(padded)
        if padded is None:
            self.stats.fallbacks += 1
            if not self._warned_fallback:
                self._warned_fallback = True
                logger.info("kvgraph: a batch of %d tokens is above the largest capture size "
                            "%d and runs without graphs (counted in stats, logged once)",
                            num_tokens, self.capture_sizes[-1])
        return GraphMode.NONE, BatchDescriptor(num_tokens)

    def descriptors_to_capture(self) -> list[tuple[GraphMode, BatchDescriptor]]:
        """Every key the mode asks for, largest first (later, smaller graphs reuse its pool)."""
        keys = []
        if self.graph_mode.has_full_graphs:
            keys += [(GraphMode.FULL, BatchDescriptor(s, s, True)) for s in self.decode_sizes]
        if self.graph_mode is GraphMode.FULL:
            keys += [(GraphMode.FULL, BatchDescriptor(s)) for s in self.capture_sizes]
        if self.graph_mode.has_piecewise_graphs:
            keys += [(GraphMode.PIECEWISE, BatchDescriptor(s)) for s in self.capture_sizes]
        return sorted(keys, key=lambda key: key[1].num_tokens, reverse=True)
