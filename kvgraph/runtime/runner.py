"""ModelRunner: caches, persistent inputs, dispatch and capture around one model.

    runner = kvgraph.ModelRunner(model, config, num_blocks=..., block_size=..., ...)
    runner.capture()                   # every graph the config asks for, largest first
    logits = runner.execute(chunks)    # [num_reqs, vocab]: each chunk's last-token logits

The runner owns its graphs and their memory pool (a GraphSet): dropping it, or `close()`,
frees them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import torch
from torch import nn

from kvgraph.attention.backends import get_attention_backend
from kvgraph.attention.batch import host_batch
from kvgraph.attention.metadata import RequestChunk
from kvgraph.compilation.counters import compile_counters
from kvgraph.compilation.trace import compile_model
from kvgraph.config import CompilationConfig, GraphMode
from kvgraph.devices import canonical_device
from kvgraph.forward_context import BatchDescriptor, set_forward_context
from kvgraph.kv_cache.binding import bind_kv_cache
from kvgraph.kv_cache.spec import allocate_kv_caches, attention_layers, kv_cache_specs
from kvgraph.runtime.dispatcher import Dispatcher, resolve_graph_mode
from kvgraph.runtime.graphs import GraphSet, graph_key
from kvgraph.runtime.platforms import get_platform
from kvgraph.runtime.step import InputBuffers, StepLimits, StepPlan

logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs one model step by step in the configured graph mode (eager included).

    It allocates and binds the model's KV caches (`num_blocks` blocks of `block_size` tokens,
    in `dtype`, default the model's), keeps persistent inputs for up to `max_num_tokens` tokens
    and `max_num_seqs` requests, compiles the model unless the mode is `eager`, and captures
    graphs keyed by `BatchDescriptor`. `max_model_len` (default: every block, `num_blocks *
    block_size`) bounds one sequence; a full decode device graph of the portable attention
    backend reads that many key rows per request, so set it to the longest sequence served.
    Token ids are checked against `vocab_size` (default: the model's `config.vocab_size`, or
    its first embedding's size).
    """

    def __init__(self, model: nn.Module, config: CompilationConfig | None = None, *,
                 num_blocks: int, block_size: int, max_num_tokens: int, max_num_seqs: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                 max_model_len: int | None = None, attn_backend: str | None = None,
                 vocab_size: int | None = None):
        self.platform = get_platform(device)  # first: an NPU device needs torch_npu loaded
        self.device = canonical_device(device)
        self.attn_backend = attn_backend or self.platform.attention_backend
        backend = get_attention_backend(self.attn_backend, self.device)
        config = (config or CompilationConfig()).replace(max_num_tokens=max_num_tokens)
        self.config = config.replace(graph_mode=resolve_graph_mode(
            config.graph_mode, backend.graph_support, backend.name, bool(config.splitting_ops)))
        self.model = model
        dtype = dtype or next(model.parameters()).dtype
        specs = kv_cache_specs(model, block_size, dtype)
        self.kv_caches = allocate_kv_caches(specs, num_blocks, self.device)
        bind_kv_cache(attention_layers(model), self.kv_caches, device=self.device, dtype=dtype)
        self.max_model_len = max_model_len or num_blocks * block_size
        limits = StepLimits(max_num_tokens, max_num_seqs, self.max_model_len, num_blocks,
                            block_size)
        self.buffers = InputBuffers(limits, self.device)
        self.dispatcher = Dispatcher(self.config.graph_mode, self.config.capture_size_list, limits,
                                     self.platform.freezes_shapes, vocab_size or _vocab_size(model))
        eager = self.config.graph_mode is GraphMode.EAGER
        self.forward = model if eager else compile_model(model, self.config)
        self.graphs = GraphSet(self.platform, self.config.check_graph_inputs)
        self.hidden_states: torch.Tensor | None = None  # last step's padded output (debugging)

    def execute(self, chunks: Sequence[RequestChunk]) -> torch.Tensor:
        """Run one step; the logits of each chunk's last token, `[len(chunks), vocab]`.

        The logits are a fresh tensor: the next step's replay does not overwrite them.
        """
        plan = self.dispatcher.plan(chunks)
        hidden = self._run(plan)
        return self.model.compute_logits(hidden[self.buffers.logits_indices[:plan.batch.num_reqs]])

    def _run(self, plan: StepPlan) -> torch.Tensor:
        input_ids, positions, metadata = self.buffers.fill(plan)
        with torch.no_grad(), set_forward_context(metadata, plan.descriptor, self.attn_backend,
                                                  plan.runtime_mode, self.graphs):
            self.hidden_states = self.forward(input_ids, positions)
        return self.hidden_states

    def capture(self) -> dict[str, Any]:
        """Capture every graph the mode asks for, largest first; returns a summary.

        The summary counts the graphs this call captured and its seconds; `bytes` and
        `bytes_by_descriptor` are what all of this runner's graphs hold. A descriptor whose
        capture fails is listed in `failed` and logged; its batches run on the same size's
        piecewise graphs if there are any, else without graphs, and the other descriptors are
        captured as usual.
        """
        from tqdm import tqdm

        keys = [key for key in self.dispatcher.descriptors_to_capture()
                if key not in self.dispatcher.captured]
        before = len(self.graphs.entries)
        start = time.perf_counter()
        failed = []
        with self.graphs.capture_phase():
            for mode, descriptor in tqdm(keys, desc="kvgraph capture", disable=not keys,
                                         leave=False):
                if self._capture_or_warn(mode, descriptor):
                    self.dispatcher.captured.add((mode, descriptor))
                else:
                    failed.append(graph_key(mode, descriptor))
        held = self.graphs.snapshot()
        summary = {
            "graphs": held["captures"] - before,
            "seconds": time.perf_counter() - start,
            "bytes": held["graph_bytes"],
            "bytes_by_descriptor": held["bytes_by_descriptor"],
            "failed": failed,
        }
        logger.info("kvgraph: captured %d graphs in %.2f s; this runner's graphs hold %.1f MiB",
                    summary["graphs"], summary["seconds"], summary["bytes"] / 2**20)
        return summary

    def _capture_or_warn(self, mode: GraphMode, descriptor: BatchDescriptor) -> bool:
        try:
            self._capture_one(mode, descriptor)
            return True
        except Exception as error:  # noqa: BLE001 - one descriptor's failure costs only its graph
            self.graphs.discard(mode, descriptor)
            logger.warning("kvgraph: capturing %s failed (%s: %s); its batches will run without "
                           "graphs", graph_key(mode, descriptor), type(error).__name__, error)
            return False

    def _capture_one(self, mode: GraphMode, descriptor: BatchDescriptor) -> None:
        # A dummy batch of one-token requests shaped like the descriptor's real batches; it
        # writes nothing to the cache.
        batch = host_batch([RequestChunk([0], 0, [0])] * (descriptor.num_reqs or 1),
                           self.buffers.block_size)
        if self.platform.needs_warmup:  # first runs initialise kernels that capture cannot
            self._run(self.dispatcher.plan_for(batch, GraphMode.NONE, descriptor, False))
        self._run(self.dispatcher.plan_for(batch, mode, descriptor, False))

    def stats(self) -> dict[str, Any]:
        """This runner's dispatch counts and graphs (memory included); process-wide compile
        counters."""
        dispatch = self.dispatcher.stats
        return {
            "graph_mode": self.config.graph_mode.value,
            "hits": {f"{mode}:{d}": n for (mode, d), n in dispatch.hits.items()},
            "padded_tokens": dispatch.padded_tokens,
            "fallbacks": dispatch.fallbacks,
            "uncaptured": dispatch.uncaptured,
            "graphs": self.graphs.snapshot(),
            "compile": compile_counters.snapshot(),
        }

    def close(self) -> None:
        """Free this runner's graphs and their pool now; later steps run without graphs."""
        self.graphs.release()
        self.dispatcher.captured.clear()


def _vocab_size(model: nn.Module) -> int | None:
    """The model's vocabulary size: `config.vocab_size`, else its first embedding's rows."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    return embedding.num_embeddings if embedding is not None else None
