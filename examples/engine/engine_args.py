"""The flags every entry point shares (model, device, limits, kvgraph's), and the engine they build.

`--model llama|mla --preset NAME` serves an example model with seeded random weights and a
byte-level tokenizer; `--model PATH` a local Hugging Face checkpoint directory. A draft model
(`--speculative-config` with the `draft_model` method) gets a runner of its own on rank 0's
device, built beside the target's (draft_startup.py); not under tensor parallelism.

`--tensor-parallel-size N` shards the model over N ranks (see tp_workers.py and tp_runner.py):
`build_engine` then spawns ranks 1..N-1, or, under torchrun, is rank 0 of torchrun's; every rank
builds its runner with `build_rank`, from the same flags. Under torchrun the other ranks call
`run_if_worker` instead, which follows rank 0 until it stops.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

import kvgraph
from kvgraph.attention.metadata import MAX_SEQ_LEN
from kvgraph.distributed import TensorParallelGroup, tensor_parallel_group
from kvgraph.inspect import units
from kvgraph.kv_transfer import KVConnectorBase, KVConnectorRole
from kvgraph.runtime.platforms import get_platform

from .draft_startup import (DraftBuild, draft_config, draft_runner, draft_source, load_draft,
                            DRAFT_QUERY_LEN, refuse_under_tensor_parallelism, start_draft,
                            without_speculation)
from .engine import LLMEngine
from .flag_types import compute_threads, int_in, seconds
from .kv_sizing import CacheModel, KVSizing, add_kv_sizing_args, agreed, choose_num_blocks
from .kv_transfer_args import add_kv_transfer_args, kv_connector
from .speculative_args import add_speculative_args, with_speculation
from .startup_gc import freeze_startup_objects
from .startup_stages import StartupStages, stage_times
from .tokenizer import ByteTokenizer
from .threads import SERVING_CORES, bind_compute_threads, set_compute_threads
from .tp_launch import ranks_on_node, tensor_parallel_size, torchrun_rendezvous
from .tp_workers import run_worker, start_rank_zero

logger = logging.getLogger(__name__)

# Context when neither --max-model-len nor a smaller max_position_embeddings says.
DEFAULT_MAX_MODEL_LEN = 1024
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
# Seconds a rank waits for its peers in a collective (start-up included) before failing.
DEFAULT_DISTRIBUTED_TIMEOUT_S = 300.0
# Requests in one step, at most: each holds rows in the step's buffers and the sampler's, and a
# decode step of them all must fit the token budget (vLLM's default is 256).
MAX_NUM_SEQS = 65536
MAX_TENSOR_PARALLEL = 64  # ranks on one node (rank 0 spawns them, or torchrun does)
# The seed of torch's generators is an unsigned 64-bit integer; kvgraph's are signed (int64).
MAX_SEED = 2**63 - 1
# Sequence lengths and offsets are int32.
LENGTHS = int_in(1, MAX_SEQ_LEN, "sequence lengths are int32")


def add_engine_args(parser: argparse.ArgumentParser, preset: str = "small"
                    ) -> argparse.ArgumentParser:
    """Add the engine's flags and kvgraph's (`kvgraph.add_cli_args`) to `parser`."""
    group = parser.add_argument_group("engine", "model, device and limits")
    group.add_argument("--model", default="llama",
                       help="llama or mla (random weights), or a local Hugging Face checkpoint dir")
    group.add_argument("--preset", default=preset, help="size of a random-weight example model")
    group.add_argument("--device", default="cpu",
                       help="where the model runs: cpu, cuda[:i] or npu[:i] (default cpu)")
    group.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                       help="the weights' and activations' dtype (default float32)")
    group.add_argument("--attention-backend", help="kvgraph attention backend (default: the "
                       "device's)")
    group.add_argument("--max-num-seqs", type=int_in(1, MAX_NUM_SEQS), default=16,
                       help=f"most requests in one step (at most {MAX_NUM_SEQS})")
    group.add_argument("--max-model-len", type=LENGTHS,
                       help=f"longest sequence, prompt and output (default: the model's, at most "
                       f"{DEFAULT_MAX_MODEL_LEN})")
    group.add_argument("--block-size", type=LENGTHS,
                       help="tokens per cache block (default: the device's, 16; 128 on an NPU)")
    group.add_argument("--pack-weights", action=argparse.BooleanOptionalAction, default=True,
                       help="on the CPU, pack linear weights once at load: bf16 in kvgraph's "
                       "tile layout where the processor has AVX512-BF16, else bf16/fp16 for "
                       "oneDNN, and fp32 in kvgraph's fp32 tiles on AMD processors with "
                       "AVX-512; other fp32 linears run a decode step's few rows (16 with "
                       "AVX-512, 48 with AVX2) in kvgraph's small-batch kernel "
                       "(kvgraph.cpu.packed_linear)")
    group.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                       help="on the CPU, move the weights into memory backed by transparent huge "
                       "pages once at load, where Linux gives them (kvgraph.cpu.huge_pages)")
    group.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction,
                       default=True, help="on the CPU, after loading, have glibc's malloc keep "
                       "the memory steps free, so their tensors reuse pages already faulted in "
                       "(kvgraph.cpu.malloc_policy)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=True, help="share the cached KV blocks of common prompt prefixes")
    add_kv_sizing_args(group)
    add_kv_transfer_args(group)
    add_speculative_args(group)
    group.add_argument("--seed", type=int_in(0, MAX_SEED, "torch's generators take int64"),
                       default=0, help="seeds random weights and sampling")
    group.add_argument("--threads", type=compute_threads, metavar="N",
                       help="torch compute threads of this process, of each rank under tensor "
                       f"parallelism (default: the usable cores less {SERVING_CORES}, shared by "
                       "the ranks on the node, at least 1; at most 4 per usable core)")
    group.add_argument("--bind-threads", action=argparse.BooleanOptionalAction, default=False,
                       help="bind the compute threads to the first usable cores, one each, as "
                       "vLLM's CPU worker does (one rank per node only; Linux)")
    group.add_argument("--tensor-parallel-size", "-tp", metavar="N",
                       type=int_in(1, MAX_TENSOR_PARALLEL, "ranks on one node"),
                       help="ranks to shard the model over (default 1, or torchrun's WORLD_SIZE); "
                       "rank 0 spawns the others unless torchrun started them")
    group.add_argument("--distributed-timeout", type=seconds(),
                       default=DEFAULT_DISTRIBUTED_TIMEOUT_S, metavar="SECONDS",
                       help="with tensor parallelism, how long a rank waits for the others (to "
                       "start, or in a collective) before failing")
    kvgraph.add_cli_args(parser)
    for action in parser._actions:  # argparse keeps no public handle on a flag's help
        if action.dest == "graph_mode":
            action.help = ("which parts of a forward run as captured graphs (default: full on "
                           "the CPU, piecewise elsewhere)")
        if action.dest == "capture_sizes":
            action.help = ("comma-separated token counts to capture graphs for (default: 1, 2, "
                           "4, then steps of 8 up to 512 or --max-num-tokens; on the CPU only "
                           "those up to --max-num-seqs; 'auto': the full list)")
    return parser


def load_model(args: argparse.Namespace, models: Mapping[str, Any],
               tp: TensorParallelGroup | None = None) -> tuple[nn.Module, Any]:
    """The model and tokenizer `--model` names; `models` maps names to example model classes.
    With `tp`, this rank's shard of the model."""
    dtype = DTYPES[args.dtype]
    if args.model in models:
        model = models[args.model].from_preset(args.preset, dtype=dtype, device=args.device,
                                               seed=args.seed, tp=tp)
        return model, ByteTokenizer()
    if Path(args.model).is_dir():
        from .checkpoint import load_checkpoint

        return load_checkpoint(args.model, models, dtype, args.device, tp)
    raise ValueError(f"--model {args.model!r} is neither one of {sorted(models)} nor a "
                     "checkpoint directory")


def compilation_config(args: argparse.Namespace, query_len: int | None = None
                       ) -> kvgraph.CompilationConfig:
    """kvgraph's flags and environment, with the device platform's default token budget, graph
    mode and capture sizes where neither says (where it captures decode steps only: those of
    up to --max-num-seqs requests of `query_len` tokens, default the config's 1 + K)."""
    config = with_speculation(kvgraph.CompilationConfig.from_cli_args(args), args)
    platform = get_platform(args.device)
    if args.max_num_tokens is None and "KVGRAPH_MAX_NUM_TOKENS" not in os.environ:
        config = config.replace(max_num_tokens=platform.default_max_num_tokens)
    if (args.graph_mode is None and "KVGRAPH_GRAPH_MODE" not in os.environ
            and platform.default_graph_mode is not None):
        config = config.replace(graph_mode=platform.default_graph_mode)
    if (args.capture_sizes is None and "KVGRAPH_CAPTURE_SIZES" not in os.environ
            and platform.captures_decode_only):
        config = config.replace(capture_sizes=decode_capture_sizes(
            config, args.max_num_seqs * (query_len or config.uniform_decode_query_len)))
    return config


def decode_capture_sizes(config: kvgraph.CompilationConfig, num_tokens: int
                         ) -> tuple[int, ...]:
    """The default capture sizes up to a decode (or verify) step of `num_tokens`, included."""
    largest = min(num_tokens, max(config.capture_size_list))
    return tuple(sorted({s for s in config.capture_size_list if s <= largest} | {largest}))


@dataclass(frozen=True)
class RankBuild:
    """One rank's runner, captured, with the tokenizer, the cache sizing, the capture summary,
    its compute threads, the seconds of each start-up stage and the draft model's runner, if
    any (what rank 0's engine and start-up log need)."""

    runner: kvgraph.ModelRunner
    tokenizer: Any
    sizing: KVSizing
    capture: dict[str, Any]
    threads: int
    stages: dict[str, float]
    draft: DraftBuild | None = None


def build_rank(args: argparse.Namespace, models: Mapping[str, Any], device: str) -> RankBuild:
    """Load, compile and capture this rank's runner on `device` (every rank, the same way), and
    the draft model's, if the flags ask for one.

    Under tensor parallelism the model is this rank's shard, and the ranks take the smallest
    of their cache sizes (devices may have different memory free).
    """
    args = argparse.Namespace(**{**vars(args), "device": device})  # this rank's, not the flag's
    platform = get_platform(device)
    if args.block_size is None:
        args.block_size = platform.default_block_size
    tp = tensor_parallel_group()
    refuse_under_tensor_parallelism(args, tp.world_size)  # torchrun's ranks > 0 start here
    # Before the model compiles: inductor's CPU kernels keep the thread count they are built with.
    who = f"rank {tp.rank} of {tp.world_size}" if tp.world_size > 1 else "engine"
    threads = set_compute_threads(args.threads, ranks_on_node(tp.world_size), who,
                                  platform.serving_cores).threads
    stages = StartupStages(who)
    with stages.stage("load weights", f"loading {_model_source(args, models)}"):
        model, tokenizer = load_model(args, models, tp=tp if tp.world_size > 1 else None)
    source = draft_source(args, models)
    draft = None if source is None else load_draft(source, args, models, DTYPES[args.dtype],
                                                   stages)
    with stages.stage("prepare weights", f"preparing the weights for {device}"):
        for each in [model] if draft is None else [model, draft]:
            platform.prepare_model(each, pack_weights=args.pack_weights,
                                   huge_pages=args.huge_pages)
        platform.prepare_process(keep_freed_memory=args.keep_freed_memory)  # after load's copies
    config = compilation_config(args)
    max_model_len = args.max_model_len or min(model.config.max_position_embeddings,
                                              DEFAULT_MAX_MODEL_LEN)
    caches = [CacheModel(model, _runner_factory(model, config, args, max_model_len))]
    if draft is not None:
        plain = compilation_config(without_speculation(args), DRAFT_QUERY_LEN)
        caches.append(CacheModel(draft, _runner_factory(draft, draft_config(plain), args,
                                                        max_model_len)))
    with stages.stage("size KV cache", "sizing the KV cache"):
        sizing = agreed(choose_num_blocks(args, caches, DTYPES[args.dtype],
                                           config.max_num_tokens, max_model_len), tp)
        runner = caches[0].build_runner(sizing.num_blocks, kv_connector(
            args, models, KVConnectorRole.WORKER, args.block_size, tp.rank, tp.world_size))
        drafter = None if draft is None else draft_runner(caches[1].build_runner, runner)
    # A compile error raises here, before serving.
    with stages.stage("compile", f"compiling ({config.graph_mode.value} graph mode, "
                      f"{config.piece_compiler} pieces): Dynamo traces the model, then each "
                      "piece is built or loaded from the compile cache"):
        runner.compile()
    with stages.stage("capture", "capturing graphs"):
        capture = runner.capture()
    drafted = None if drafter is None else start_draft(drafter, source, stages)
    if args.bind_threads:  # after compiling: what this thread starts later shares its core
        bind_compute_threads(threads, ranks_on_node(tp.world_size),
                             f"rank {tp.rank}" if tp.world_size > 1 else "engine")
    freeze_startup_objects()  # after the last start-up allocation, before the first step
    return RankBuild(runner, tokenizer, sizing, capture, threads, stages.seconds, drafted)


def _runner_factory(model: nn.Module, config: kvgraph.CompilationConfig,
                    args: argparse.Namespace, max_model_len: int
                    ) -> Callable[..., kvgraph.ModelRunner]:
    """Builds `model`'s runner with a number of blocks (and a KV connector's worker side)."""
    def build_runner(num_blocks: int, connector: KVConnectorBase | None = None
                     ) -> kvgraph.ModelRunner:
        return kvgraph.ModelRunner(
            model, config, num_blocks=num_blocks, block_size=args.block_size,
            max_num_seqs=args.max_num_seqs, device=args.device, max_model_len=max_model_len,
            attn_backend=args.attention_backend, kv_connector=connector)
    return build_runner


def _model_source(args: argparse.Namespace, models: Mapping[str, Any]) -> str:
    if args.model in models:
        return f"the example {args.model!r} ({args.preset} preset, random weights)"
    return f"the checkpoint {args.model}"


def build_engine(args: argparse.Namespace, models: Mapping[str, Any]
                 ) -> tuple[LLMEngine, dict[str, Any]]:
    """Load, compile and capture: the engine, and a summary of its start-up.

    With tensor parallelism this process is rank 0: its engine's runner is a
    TensorParallelRunner, which `runner.close()` stops the other ranks through. A KV
    connector's scheduler side is rank 0's; every rank has its own worker side.
    """
    start = time.perf_counter()
    world_size = tensor_parallel_size(args.tensor_parallel_size)
    refuse_under_tensor_parallelism(args, world_size)  # before any rank is spawned
    if world_size == 1:
        built = build_rank(args, models, args.device)
        runner = built.runner
    else:
        built, runner = start_rank_zero(world_size, args.device, args.distributed_timeout,
                                        functools.partial(build_rank, args, models))
    engine = LLMEngine(runner, built.tokenizer, args.seed, args.enable_prefix_caching,
                       kv_connector(args, models, KVConnectorRole.SCHEDULER,
                                    runner.limits.block_size, 0, world_size),
                       getattr(args, "speculative_config", None),
                       draft_runner=built.draft and built.draft.runner)
    capture = built.capture
    summary = {"graph_mode": runner.config.graph_mode.value,
               "descriptors": capture["descriptors"], "graphs": capture["graphs"],
               "graph_bytes": capture["bytes"], "seconds": time.perf_counter() - start,
               "compile": runner.stats()["compile"], "num_blocks": built.sizing.num_blocks,
               "num_blocks_why": built.sizing.why, "tensor_parallel_size": world_size,
               "threads": built.threads, "stages": built.stages,
               "draft": built.draft and built.draft.summary()}
    compile_counts = summary["compile"]
    logger.info("engine ready in %.1f s (%s): graph mode %s, %d descriptors captured (%d graphs, "
                "%s), %d piece builds compiled and %d loaded from the compile cache%s%s",
                summary["seconds"], stage_times(built.stages),
                summary["graph_mode"], summary["descriptors"], summary["graphs"],
                units.size(summary["graph_bytes"]), compile_counts["builds"],
                compile_counts["cache_hits"],
                f", on each of {world_size} tensor-parallel ranks" if world_size > 1 else "",
                built.draft.said() if built.draft else "")
    return engine, summary


def run_if_worker(args: argparse.Namespace, models: Mapping[str, Any]) -> int | None:
    """Under torchrun, a rank other than 0 follows rank 0's steps here, then returns its exit
    code; None on rank 0 and without torchrun (the caller then builds the engine)."""
    rendezvous = torchrun_rendezvous()
    if rendezvous is None or rendezvous.rank == 0 or \
            tensor_parallel_size(args.tensor_parallel_size) == 1:
        return None
    return run_worker(rendezvous, args.device, args.distributed_timeout,
                      functools.partial(build_rank, args, models))
