"""How many KV cache blocks the engine gets: given, from a memory budget, or from what a device
has left after a profiling step.

- `--num-blocks N`: N, whatever else is given.
- `--kv-cache-memory BYTES` (CPU and devices): as many blocks as BYTES hold.
- `--gpu-memory-utilization F` (devices): a probe runner with one sequence's blocks runs a
  step of `max_num_tokens` tokens and captures its graphs; the blocks are what is left of
  F x the device's memory after that peak (weights, activations, graphs) and after what other
  processes use.
- otherwise: every sequence at full length (`max_num_seqs` x `max_model_len`).

Every model whose caches get the engine's blocks counts: a draft model's runner (speculative
decoding) has as many blocks as the target's, so a block's bytes are the target's plus the
draft's, and the profiling step probes both runners, live together as they serve. Under tensor
parallelism every rank takes the fewest blocks any rank chose (`agreed`).
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

import kvgraph
from kvgraph.attention.metadata import MAX_BLOCK_ID
from kvgraph.distributed import TensorParallelGroup
from kvgraph.runtime.platforms import get_platform

from .block_allocator import blocks_for
from .flag_types import float_in, int_in

logger = logging.getLogger(__name__)

# The largest --kv-cache-memory: a bound on the flag, far above any machine's memory.
MAX_CACHE_BYTES = 2**50
# Builds a ModelRunner with the given number of blocks (everything else already decided).
RunnerFactory = Callable[[int], kvgraph.ModelRunner]


class CacheModel(NamedTuple):
    """A model whose KV caches get the engine's blocks (the target, a draft model), and how
    to build its runner."""

    model: nn.Module
    build_runner: RunnerFactory


@dataclass(frozen=True)
class KVSizing:
    """The engine's cache size and the reason it was chosen, for the start-up log."""

    num_blocks: int
    why: str


def add_kv_sizing_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--num-blocks", type=int_in(1, MAX_BLOCK_ID, "block ids are int32"),
                       help="cache blocks (overrides the two below; default: every sequence at "
                       "full length)")
    group.add_argument("--kv-cache-memory", type=int_in(1, MAX_CACHE_BYTES, "1 PiB"),
                       metavar="BYTES",
                       help="size the KV cache to this many bytes (CPU and devices)")
    group.add_argument("--gpu-memory-utilization", type=float_in(0, 1, low_open=True),
                       metavar="FRACTION",
                       help="size the KV cache to what this fraction of the device's memory "
                       "leaves after a profiling step and the graphs (CUDA, NPU)")


def block_bytes(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across every layer's cache."""
    specs = kvgraph.kv_cache_specs(model, block_size, dtype)
    return sum(spec.bytes_per_block for spec in specs.values())


def choose_num_blocks(args: argparse.Namespace, models: Sequence[CacheModel], dtype: torch.dtype,
                      max_num_tokens: int, max_model_len: int) -> KVSizing:
    """The blocks the flags ask for, each holding every one of `models`' caches (the target's
    first); a ValueError naming the flag if they cannot hold one sequence of `max_model_len`
    tokens."""
    one_sequence = blocks_for(max_model_len, args.block_size)
    parts = [block_bytes(each.model, args.block_size, dtype) for each in models]
    per_block = sum(parts)
    if args.num_blocks is not None:
        sizing = KVSizing(args.num_blocks, "--num-blocks")
    elif args.kv_cache_memory is not None:
        sizing = KVSizing(args.kv_cache_memory // per_block,
                          f"--kv-cache-memory {args.kv_cache_memory} bytes / "
                          f"{_per_block(parts)} bytes per block")
    elif args.gpu_memory_utilization is not None:
        sizing = _profiled(args, per_block, one_sequence, max_num_tokens, max_model_len,
                           [each.build_runner for each in models])
    else:
        sizing = _every_sequence(args, per_block, one_sequence, max_model_len)
    if sizing.num_blocks < one_sequence:
        raise ValueError(f"{sizing.why} gives {sizing.num_blocks} KV cache blocks, fewer than the "
                         f"{one_sequence} one sequence of --max-model-len {max_model_len} needs")
    logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), from %s", sizing.num_blocks,
                args.block_size, sizing.num_blocks * per_block / 2**20, sizing.why)
    return sizing


def _per_block(parts: list[int]) -> str:
    """A block's bytes: "512", or with a draft model's caches "768 (512 the target's + 256 the
    draft model's)"."""
    if len(parts) == 1:
        return str(parts[0])
    return f"{sum(parts)} ({parts[0]} the target's + {' + '.join(map(str, parts[1:]))} the " \
           "draft model's)"


def agreed(sizing: KVSizing, tp: TensorParallelGroup) -> KVSizing:
    """The fewest blocks any rank chose (every rank's cache must hold the same block ids)."""
    if tp.world_size == 1:
        return sizing
    blocks = torch.tensor([sizing.num_blocks], dtype=torch.int64)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=tp.cpu_group)
    if int(blocks) == sizing.num_blocks:
        return sizing
    return KVSizing(int(blocks), f"{sizing.why}, the fewest of the {tp.world_size} ranks'")


def _every_sequence(args: argparse.Namespace, per_block: int, one_sequence: int,
                    max_model_len: int) -> KVSizing:
    """Blocks for `--max-num-seqs` sequences of `--max-model-len` tokens; a ValueError naming
    both flags when no cache can be that large (block ids are int32) or the device's memory
    cannot hold it."""
    blocks = one_sequence * args.max_num_seqs
    why = (f"every sequence at full length: --max-num-seqs {args.max_num_seqs} x "
           f"{one_sequence} blocks of --max-model-len {max_model_len}")
    capacity = get_platform(args.device).total_memory(args.device)
    if blocks > MAX_BLOCK_ID or (capacity is not None and blocks * per_block > capacity):
        limit = (f"more than the {MAX_BLOCK_ID} block ids a cache may have" if
                 blocks > MAX_BLOCK_ID else f"{blocks * per_block / 2**30:.3g} GiB, more than "
                 f"all of {args.device}'s memory ({capacity / 2**30:.3g} GiB)")
        raise ValueError(f"{why} = {blocks} blocks: {limit}; lower --max-num-seqs or "
                         "--max-model-len, or size the cache with --num-blocks or "
                         "--kv-cache-memory")
    return KVSizing(blocks, why)


def _profiled(args: argparse.Namespace, per_block: int, one_sequence: int, max_num_tokens: int,
              max_model_len: int, build_runners: list[RunnerFactory]) -> KVSizing:
    """Blocks for what `--gpu-memory-utilization` leaves after a profiling step and capture of
    every runner (all live, as they serve: their graphs add up, their steps' activations not)."""
    fraction = args.gpu_memory_utilization
    if not 0 < fraction <= 1:
        raise ValueError(f"--gpu-memory-utilization must lie in (0, 1], got {fraction}")
    memory = get_platform(args.device).device_memory
    if memory is None:
        raise ValueError(f"--gpu-memory-utilization needs a CUDA or NPU device, got "
                         f"--device {args.device}; give --kv-cache-memory BYTES instead")
    device = torch.device(args.device)
    batch = profiling_batch(max_num_tokens, max_model_len, args.max_num_seqs, args.block_size)
    probe_blocks = max(one_sequence, sum(len(chunk.block_ids) for chunk in batch))
    probes: list[kvgraph.ModelRunner] = []
    try:
        for build_runner in build_runners:
            probes.append(build_runner(probe_blocks))
        memory.synchronize(device)
        memory.reset_peak_memory_stats(device)
        for probe in probes:
            probe.execute(batch)
            probe.capture()
        memory.synchronize(device)
        peak = memory.max_memory_allocated(device) - probe_blocks * per_block
    finally:
        for probe in probes:
            probe.close()
    free, total = memory.mem_get_info(device)
    others = total - free - memory.memory_reserved(device)  # what other processes hold
    budget = int(total * fraction) - peak - others
    return KVSizing(max(budget, 0) // per_block,
                    f"--gpu-memory-utilization {fraction}: {total / 2**30:.1f} GiB x {fraction} "
                    f"- {peak / 2**30:.2f} GiB peak of a {max_num_tokens}-token step and its "
                    f"graphs - {others / 2**30:.2f} GiB used by other processes")


def profiling_batch(max_num_tokens: int, max_model_len: int, max_num_seqs: int,
                    block_size: int) -> list[kvgraph.RequestChunk]:
    """The largest step: `max_num_tokens` tokens (as many as `max_num_seqs` requests of at most
    `max_model_len` hold), in as few requests as the context allows, on distinct blocks."""
    per_request = min(max_num_tokens, max_model_len)
    sizes = [per_request] * (max_num_tokens // per_request)
    if max_num_tokens % per_request:
        sizes.append(max_num_tokens % per_request)
    chunks, first = [], 0
    for n in sizes[:max_num_seqs]:
        count = blocks_for(n, block_size)
        chunks.append(kvgraph.RequestChunk([0] * n, 0, list(range(first, first + count))))
        first += count
    return chunks
