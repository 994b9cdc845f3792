"""ModelRunner: caches, persistent inputs, compile, capture and dispatch around one model.

    runner = kvgraph.ModelRunner(model, config, num_blocks=..., block_size=..., ...)
    runner.capture()                   # compiles first, then every graph, largest first
    logits = runner.execute(chunks)    # [sum(num_logits), vocab]: chunks' last tokens' logits

A step's path (validate, dispatch, plan, fill the persistent buffers, run or replay) is drawn
in docs/architecture.md. The runner owns its graphs, their pool, its caches and compiled code:
`close()`, or dropping it, frees them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from kvgraph.attention.backends import get_attention_backend
from kvgraph.attention.batch import HostBatch, check_distinct_blocks, host_batch
from kvgraph.attention.layer_base import attention_layers
from kvgraph.attention.metadata import RequestChunk
from kvgraph.compilation.counters import CompileCounters
from kvgraph.compilation.debug import DumpSession
from kvgraph.compilation.trace import CompiledModel, compile_failure, compile_model
from kvgraph.config import CompilationConfig, GraphMode
from kvgraph.devices import canonical_device
from kvgraph.distributed import TensorParallelGroup, tensor_parallel_group
from kvgraph.errors import RunnerError
from kvgraph.forward_context import (AttentionProbe, BatchDescriptor, KVLayerHooks,
                                     set_forward_context)
from kvgraph.runtime import model_claim
from kvgraph.runtime.capture import capture_graphs
from kvgraph.runtime.capture_dummies import capture_dummy, dummy_batch
from kvgraph.kv_transfer.base import KVConnectorBase, KVConnectorMetadata
from kvgraph.kv_transfer.worker import WorkerConnector, disabled_stats as no_connector_stats
from kvgraph.runtime.dispatcher import (Dispatcher, resolve_graph_mode, resolve_runner_mode,
                                        verify_query_len)
from kvgraph.runtime.graphs import GraphSet, graph_key
from kvgraph.runtime.input_buffers import InputBuffers
from kvgraph.runtime.platforms import get_platform
from kvgraph.runtime.rank_agreement import RankAgreement
from kvgraph.runtime.runner_args import (check_device, check_dtype, check_sizes,
                                         model_vocab_size, rank_settings, with_max_num_tokens)
from kvgraph.runtime.runner_caches import bind_new_caches
from kvgraph.runtime.step import Step, StepLimits, plan_step
from kvgraph.runtime.verify import Verifier, disabled_stats


class ModelRunner:
    """Runs one model step by step in the configured graph mode (eager included).

    It allocates and binds the model's KV caches (`num_blocks` blocks of `block_size` tokens,
    default the device's: see `default_block_size`; in `dtype`, default the model's), keeps
    persistent inputs for up to `max_num_tokens` tokens (default: the config's) and
    `max_num_seqs` requests, compiles the model unless the mode is `eager`, and captures
    graphs keyed by `BatchDescriptor`. `max_model_len` (default: every block) bounds one
    sequence; a full decode device graph of the portable attention backend reads that many key
    rows per request, so set it to the longest sequence served. Token ids are checked against
    `vocab_size` (default: the model's `config.vocab_size`, or its first embedding's size).

    One model, one runner: building a runner on a model another live runner holds is a
    RunnerError; `close()` that runner first (or build a new model).
    Public: `config`, `device`, `model`, `kv_caches`, `attn_backend` (its name), `limits`,
    `vocab_size`, `tp` (its tensor-parallel group), `kv_connector` (None, or the
    WorkerConnector driving its KV connector: its `output` is the last step's report) and
    `hidden_states` (the last step's padded output, for debugging: valid until the next step).

    Tensor parallelism: `tp_group` (default: the process's, see kvgraph.distributed) is the
    group the model is sharded over. Every rank builds its runner, compiles, captures and runs
    the same steps; the runner checks that they agree (settings when built, descriptors at
    capture, each step's descriptor with `check_rank_agreement`) and raises a RunnerError on
    every rank, naming the rank that failed or differed, instead of hanging.

    `kv_connector`: a KV connector's worker side (kvgraph.kv_transfer), called around every
    step; one that works layer by layer resolves full graph modes to piecewise (a warning).
    """

    def __init__(self, model: nn.Module, config: CompilationConfig | None = None, *,
                 num_blocks: int, max_num_seqs: int, block_size: int | None = None,
                 max_num_tokens: int | None = None, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, max_model_len: int | None = None,
                 attn_backend: str | None = None, vocab_size: int | None = None,
                 tp_group: TensorParallelGroup | None = None,
                 kv_connector: KVConnectorBase | None = None):
        self._platform = get_platform(device)  # first: an NPU device needs torch_npu loaded
        if block_size is None:
            block_size = self._platform.default_block_size
        check_sizes(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                    max_model_len=max_model_len, vocab_size=vocab_size)
        check_dtype(dtype)
        check_device(device)
        self.device = canonical_device(device)
        self.attn_backend = attn_backend or self._platform.attention_backend
        self._backend = get_attention_backend(self.attn_backend, self.device)
        self._backend.check_block_size(block_size)
        config = with_max_num_tokens(config or CompilationConfig(), max_num_tokens)
        self._dump = DumpSession.open(config.debug_dump_path)  # records the warnings below too
        mode, connector_change = resolve_runner_mode(config, self._backend, kv_connector)
        self.config = config.replace(graph_mode=mode)
        self.limits = StepLimits(self.config.max_num_tokens, max_num_seqs,
                                 max_model_len or num_blocks * block_size, num_blocks, block_size)
        self.vocab_size = vocab_size or model_vocab_size(model)
        self._dump.event("runner", "runner", {
            "requested_graph_mode": config.graph_mode.value,
            "graph_mode": self.config.graph_mode.value, "attn_backend": self.attn_backend,
            "device": str(self.device), "limits": vars(self.limits),
            "kv_connector": kv_connector and kv_connector.name})
        self.model = model
        self.kv_caches, self._claim = bind_new_caches(
            model, self.limits, self.device, dtype or next(model.parameters()).dtype, self)
        self.kv_connector = kv_connector and WorkerConnector(kv_connector, self.kv_caches,
                                                           connector_change)
        self._buffers = InputBuffers(self.limits, self.device)
        self._graphs = GraphSet(self._platform, self._backend, self.config.check_graph_inputs)
        # A device graph freezes the host ints attention's shapes depend on; a CPU graph does not.
        self._freezes_shapes = self._platform.freezes_shapes
        self._dispatcher = self._new_dispatcher()
        compiles = self.config.graph_mode.compiles
        self._forward = compile_model(model, self.config, self._dump) if compiles else model
        self._compiled = not compiles
        self.hidden_states: torch.Tensor | None = None
        # Verify mode checks graph steps against eager; off, it is None and costs one check.
        self._verifier = Verifier(self) if self.config.verify else None
        self.tp = tp_group or tensor_parallel_group()
        self._ranks = RankAgreement(self.tp)
        self._ranks.same("the runner's settings", rank_settings(self))

    @staticmethod
    def default_block_size(device: torch.device | str = "cpu") -> int:
        """Tokens per cache block on `device` when the runner is not told: 16, and 128 on an
        NPU (what Ascend's fused attention kernels run)."""
        return get_platform(device).default_block_size

    # --- the phases: compile, capture, execute ----------------------------------------------

    def compile(self) -> dict[str, Any]:
        """Trace the model and build every piece for every compile size; the compile counts.

        Runs outside any capture (garbage collection on, the allocator untouched); `capture()`
        and the first `execute()` run it when it has not run. A compile that fails raises a
        CompileError here (`on_compile_error="raise"`, a compile cache kvgraph may not trust),
        before any graph is captured or step run.
        """
        self._ensure_compiled()
        return self._compile_counters().snapshot()

    def _ensure_compiled(self) -> None:
        self._check_open()
        if self._compiled:
            return
        step = self._prepare(dummy_batch(1, self.limits.block_size), GraphMode.NONE,
                             BatchDescriptor(1), writes_cache=False)
        start = time.perf_counter()
        with self._ranks.together("compile"):
            try:
                self._run(step)  # the first call traces; the backend builds every piece, size
            except Exception as error:  # noqa: BLE001 - re-raised with the cause attached
                raise compile_failure(error) from error
        self._compiled = True
        self._follow_compiled_mode()
        total = time.perf_counter() - start
        backend = self._compile_counters().compile_seconds
        self._dump.event("trace", "trace", {"total_seconds": total, "backend_seconds": backend},
                         seconds=total - backend)

    def _follow_compiled_mode(self) -> None:
        """Take the graph mode the backend fell back to when no splitting op was in the traced
        graph, resolved for this attention backend, before any graph is captured."""
        compiled = self._forward.backend.config
        if compiled.splitting_ops or not self.config.splitting_ops:
            return
        mode = resolve_graph_mode(compiled.graph_mode, self._backend.graph_support,
                                  self._backend.name, False, self.config.uniform_decode_query_len)
        self.config = self.config.replace(splitting_ops=(), graph_mode=mode)
        self._dispatcher = self._new_dispatcher()

    def _new_dispatcher(self) -> Dispatcher:
        return Dispatcher(self.config.graph_mode, self.config.capture_size_list,
                          self.limits.max_num_seqs, self._graphs.has,
                          verify_query_len(self.config, self._backend.graph_support))

    def capture(self) -> dict[str, Any]:
        """Compile if not yet done, then capture every graph the mode asks for, largest first.

        Returns a summary: the descriptors and graphs (one per piece of each descriptor) this
        call captured and its seconds; `bytes` and `bytes_by_descriptor`, what all this runner's
        graphs added to its pool. A descriptor whose capture fails is listed in `failed` and
        logged; its batches run on the same size's piecewise graphs if any, else without.
        """
        self._ensure_compiled()
        return capture_graphs(self._graphs, self._dispatcher.descriptors_to_capture(),
                              self._capture_one, self._ranks, self._dump)

    def execute(self, chunks: Sequence[RequestChunk],
                kv_connector_metadata: KVConnectorMetadata | None = None) -> torch.Tensor:
        """Run one step; the logits of each chunk's last `num_logits` tokens (one by default),
        chunk after chunk, `[sum of num_logits, vocab]`.

        The logits are a fresh tensor: the next step's replay does not overwrite them. With a
        KV connector, `kv_connector_metadata` is its scheduler side's for this step.
        """
        self._ensure_compiled()
        step = self.prepare_step(chunks)
        if self.config.check_rank_agreement:
            self._ranks.same("this step's batch descriptor",
                             graph_key(step.plan.runtime_mode, step.plan.descriptor))
        connector = self.kv_connector
        with (connector.step(kv_connector_metadata, step.metadata) if connector
              else contextlib.nullcontext()) as kv_hooks:
            if self._verifier is not None and self._verifier.wants(step):
                return self._verifier.run(step, kv_hooks)
            hidden = self._run(step, kv_hooks=kv_hooks)
        return self.model.compute_logits(hidden[step.logits_indices])

    def prepare_step(self, chunks: Sequence[RequestChunk]) -> Step:
        """Validate, dispatch (counted in `stats()`), plan and fill one step without running it.

        A BatchError names any field or limit the batch breaks, before anything is written or
        counted. The step's inputs are views of the persistent buffers: valid until the next
        step is prepared.
        """
        self._check_open()
        batch = host_batch(chunks, self.limits.block_size, self.vocab_size)
        check_distinct_blocks(batch)
        self.limits.check(batch)
        return self._prepare(batch, *self._dispatcher.dispatch(batch))

    def _prepare(self, batch: HostBatch, mode: GraphMode, descriptor: BatchDescriptor,
                 writes_cache: bool = True) -> Step:
        plan = plan_step(batch, mode, descriptor, self._backend, self.limits,
                         self._freezes_shapes, writes_cache)
        input_ids, positions, metadata = self._buffers.fill(plan)
        metadata.plan = self._backend.plan(metadata, descriptor)
        return Step(plan, input_ids, positions, metadata,
                    self._buffers.logits_indices[:len(batch.logits_indices)])

    def _run(self, step: Step, model: Callable | None = None,
             probe: AttentionProbe | None = None, kv_hooks: KVLayerHooks | None = None
             ) -> torch.Tensor:
        """The forward of `step`, replayed from its graphs when its runtime mode has them.

        `model` (default: the compiled model) and `probe` (see ForwardContext) are verify
        mode's: the model as written, and a recorder of each attention call. `kv_hooks`: a
        layer-by-layer KV connector's, on live steps only.
        """
        mode, descriptor = step.plan.runtime_mode, step.plan.descriptor
        with self._step_context(step, model, probe, kv_hooks) as forward:
            hidden = (self._graphs.replay(mode, descriptor, step.metadata, forward)
                      if mode.has_graphs else forward())
        self.hidden_states = hidden
        return hidden

    @contextlib.contextmanager
    def _step_context(self, step: Step, model: Callable | None = None,
                      probe: AttentionProbe | None = None, kv_hooks: KVLayerHooks | None = None
                      ) -> Iterator[Callable[[], torch.Tensor]]:
        """The forward context of `step`, and its forward (run, replayed or captured in it)."""
        model = model or self._forward
        with torch.no_grad(), set_forward_context(step.metadata, step.plan.descriptor,
                                                  self.attn_backend, step.plan.runtime_mode,
                                                  self._graphs, probe, kv_hooks):
            yield lambda: model(step.input_ids, step.positions)

    def _capture_one(self, mode: GraphMode, descriptor: BatchDescriptor) -> None:
        batch = capture_dummy(descriptor, self.limits.block_size)  # writes nothing
        if self._platform.needs_warmup:  # first runs initialise kernels that capture cannot
            self._run(self._prepare(batch, GraphMode.NONE, descriptor, writes_cache=False))
        step = self._prepare(batch, mode, descriptor, writes_cache=False)
        with self._step_context(step) as forward:
            self._graphs.capture(mode, descriptor, step.metadata, forward)

    # --- state ------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """This runner's counts: dispatch, graphs (memory included) and its model's compile."""
        return {
            "graph_mode": self.config.graph_mode.value,
            **self._dispatcher.report(),
            "graphs": self._graphs.snapshot(),
            "compile": self._compile_counters().snapshot(),
            "verify": self._verifier.stats() if self._verifier else disabled_stats(),
            "kv_connector": (self.kv_connector.stats() if self.kv_connector
                             else no_connector_stats()),
        }

    def dump_stats(self) -> dict[str, Any]:
        """Write `stats()` into the debug dump (stats.json) now (`close()` does too); return it."""
        stats = self.stats()
        self._dump.runtime_json("stats", stats)
        return stats

    def _compile_counters(self) -> CompileCounters:  # eager, or closed: empty ones
        return (self._forward.backend.counters if isinstance(self._forward, CompiledModel)
                else CompileCounters())

    def close(self) -> None:
        """Free this runner's graphs, pool, compiled code and caches, and let go of the model
        (another runner may then be built on it); the runner cannot run afterwards."""
        if self._forward is None:
            return
        self.dump_stats()
        self._dump.close()
        if self.kv_connector:
            self.kv_connector.close()
        self._graphs.release()
        if isinstance(self._forward, CompiledModel):
            self._forward.release()
        self._forward = self.hidden_states = None
        model_claim.release(attention_layers(self.model).values(), self._claim)
        self.kv_caches = {}

    def _check_open(self) -> None:
        if self._forward is None:
            raise RunnerError("this ModelRunner was closed; build a new one to run the model")

