"""The launch plan of one step: each attention launch's grid, the constants the step decides and
its split-KV buffers, worked out once per step and layer geometry, and the merge that ends it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kvgraph.attention.backends import get_attention_backend
from kvgraph.attention.backends.base import AttentionPlan
from kvgraph.attention.backends.triton.paged import merge_splits
from kvgraph.attention.metadata import AttentionMetadata

# Triton's tensor-core dots need every dimension of a tile to be at least 16.
MIN_DOT = 16
# Rows (query tokens x the query heads of a KV group) of a unified-attention program when queries
# are longer than one token: a tile large enough for tensor cores that still fits in registers.
TILE_ROWS = 64
# Rows (tokens x heads) per MLA program: the fp32 accumulator is rows x the latent size (512 in
# DeepSeek), so more rows would not fit in registers.
MLA_ROWS = 16
# Programs that fill a GPU: a grid with fewer splits each program's keys until it has about this
# many (long-context decode of a small batch would otherwise leave most SMs idle).
FULL_GRID = 256
# Most key splits: each adds a partial result per (token, head) that the merge must read.
MAX_SPLITS = 16
# Keys per tile at most, and the fp32 values a tile of keys (or of values) may hold, so that a
# tile of each stays in registers however wide the rows.
MAX_KEYS = 64
TILE_FLOATS = 8192


def dot_block(size: int) -> int:
    """A row of `size` values as a tensor-core dot dimension: a power of two, at least MIN_DOT."""
    return max(MIN_DOT, triton.next_power_of_2(size))


def dot_precision(cache_dtype: torch.dtype) -> str:
    """The dots' input precision for a cache of `cache_dtype`."""
    # fp32 dots: exact for an fp32 cache; TF32 holds a bf16 or fp16 cache's values exactly.
    return "ieee" if cache_dtype == torch.float32 else "tf32"


def keys_per_tile(row_block: int) -> int:
    """Cached rows per tile: MAX_KEYS, fewer for wide rows (see TILE_FLOATS). Keys are found one
    by one in the block table, so the tile does not depend on the block size."""
    return max(MIN_DOT, min(MAX_KEYS, TILE_FLOATS // row_block))


def block_q(max_query_len: int, heads: int, rows: int = TILE_ROWS) -> int:
    """Query tokens per program: one for decode; for longer queries, enough that a program's
    rows (tokens x the query heads it serves) fill a `rows`-row tile."""
    return 1 if max_query_len == 1 else max(1, rows // triton.next_power_of_2(heads))


def num_kv_splits(programs: int, device: torch.device) -> int:
    """How many key ranges each program's keys are split into: on a GPU enough that a small
    batch still fills it (FULL_GRID), else one; on the interpreter one (splits buy parallelism it
    does not have). Shapes only, so a captured graph keeps its choice."""
    if device.type != "cuda" or programs >= FULL_GRID:
        return 1
    return min(MAX_SPLITS, triton.next_power_of_2(FULL_GRID // programs))


def split_buffers(num_tokens: int, num_heads: int, splits: int, row_block: int,
                  workspace: torch.Tensor | None, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Each (token, head, split)'s partial output and (row max, row sum) for `merge_splits`;
    with one split none (the kernels then write `out` directly).

    They are views of `workspace` (the runner's fp32 scratch, which never moves, so graphs may
    hold it) when it is large enough; otherwise they are allocated.
    """
    if splits == 1:
        return None, None
    parts = num_tokens * num_heads * splits
    shape = (num_tokens, num_heads, splits)
    if workspace is not None and workspace.numel() >= parts * (row_block + 2):
        partial = workspace[:parts * row_block].view(*shape, row_block)
        return partial, workspace[parts * row_block:parts * (row_block + 2)].view(*shape, 2)
    return (torch.empty(*shape, row_block, dtype=torch.float32, device=device),
            torch.empty(*shape, 2, dtype=torch.float32, device=device))


@dataclass(frozen=True, eq=False)
class Launch:
    """One attention launch of a step for one layer geometry: what the kernel takes from the step
    rather than from the layer's tensors, and how the launch ends."""

    grid: tuple[int, int, int]  # (query blocks and padding programs, head groups, key splits)
    heads: int  # query heads per program: a KV head's group, or an MLA head block
    block_q: int  # query tokens per program
    rows: int  # tokens x heads per program, a dot dimension
    reqs: int  # requests, as a power of two (the kernels search them in one vector)
    row_block: int  # the output row as a dot dimension
    keys: int  # cached rows per tile (`keys_per_tile`)
    partial: torch.Tensor | None  # the splits' partial outputs; None with one split
    partial_stats: torch.Tensor | None  # their (row max, row sum)

    @property
    def splits(self) -> int:
        return self.grid[2]

    def constexprs(self) -> dict[str, int]:
        """The kernel constants this launch decides (the layer's own are passed by the caller)."""
        return dict(REQS=self.reqs, NUM_SPLITS=self.splits, BLOCK_Q=self.block_q, ROWS=self.rows,
                    KEYS=self.keys)

    def partials(self, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's partial-result arguments; with one split `out` stands in (never read)."""
        return (out, out) if self.partial is None else (self.partial, self.partial_stats)

    def finish(self, out: torch.Tensor) -> None:
        """End the launch into `out`: with split keys, merge the splits' partial softmaxes."""
        if self.partial is not None:
            merge_splits(out, self.partial, self.partial_stats)


class LaunchPlan(AttentionPlan):
    """The launch plan of one step: a `Launch` per (kind, tokens, head geometry, forced splits),
    made by the first layer call that needs it and reused by every later one.

    Everything else a launch depends on is the step's (`max_query_len`, the request count, the
    workspace), so the grid depends only on shapes and the planned `max_query_len`.
    """

    def __init__(self, backend, metadata: AttentionMetadata, descriptor):
        super().__init__(backend, metadata, descriptor)
        self._launches: dict[tuple, Launch] = {}

    @property
    def launches(self) -> tuple[Launch, ...]:
        """The launches planned so far, in the order first needed."""
        return tuple(self._launches.values())

    def unified(self, query: torch.Tensor, num_kv_heads: int,
                num_splits: int | None = None) -> Launch:
        """The launch of unified attention for `query` `[T, H, D]` over `num_kv_heads` heads."""
        num_tokens, num_heads, head_size = query.shape
        key = ("unified", num_tokens, num_heads, num_kv_heads, head_size, num_splits)
        if key not in self._launches:
            group = num_heads // num_kv_heads
            self._launches[key] = self._launch(
                num_tokens, num_heads, num_kv_heads, group,
                block_q(self.metadata.max_query_len, group), dot_block(head_size), num_splits)
        return self._launches[key]

    def mla(self, q_latent: torch.Tensor, num_splits: int | None = None) -> Launch:
        """The launch of MLA for `q_latent` `[T, H, L]`: heads in blocks of up to MLA_ROWS."""
        num_tokens, num_heads, latent = q_latent.shape
        key = ("mla", num_tokens, num_heads, latent, num_splits)
        if key not in self._launches:
            heads = min(MLA_ROWS, triton.next_power_of_2(num_heads))
            self._launches[key] = self._launch(
                num_tokens, num_heads, triton.cdiv(num_heads, heads), heads,
                block_q(self.metadata.max_query_len, heads, MLA_ROWS), dot_block(latent),
                num_splits)
        return self._launches[key]

    def _launch(self, num_tokens: int, num_heads: int, head_groups: int, heads: int,
                tokens_per_program: int, row_block: int, num_splits: int | None) -> Launch:
        metadata = self.metadata
        num_reqs, device = metadata.seq_lens.shape[0], metadata.seq_lens.device
        query_blocks = triton.cdiv(num_tokens, tokens_per_program)
        splits = num_splits or num_kv_splits(query_blocks * head_groups, device)
        partial, stats = split_buffers(num_tokens, num_heads, splits, row_block,
                                       metadata.workspace, device)
        # Enough programs for every request's blocks and the padding after them, from shapes only.
        return Launch((query_blocks + num_reqs + 1, head_groups, splits), heads,
                      tokens_per_program, dot_block(tokens_per_program * heads),
                      triton.next_power_of_2(num_reqs), row_block, keys_per_tile(row_block),
                      partial, stats)


def step_launch_plan(metadata: AttentionMetadata) -> LaunchPlan:
    """The step's launch plan for a kernel called without one (tests, tools): the registered
    Triton backend's `step_plan`, so that later calls with the same metadata share it."""
    return get_attention_backend("triton", metadata.seq_lens.device).step_plan(metadata)
