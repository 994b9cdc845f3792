"""Ascend attention: torch_npu's fused paged attention (FIA, TND layout) and cache scatter.

One `npu_fused_infer_attention_score` call per layer serves prefill, chunked prefill and decode
alike: queries in TND (`[T, num_heads, head_size]`), the paged caches viewed as
`[num_blocks, block_size, num_kv_heads * head_size]` (no copy), `actual_seq_lengths` the
cumulative query ends and `actual_seq_lengths_kv` each request's key count, both host ints.
TND needs the last query end to be the padded token count, so padding tokens form one dummy
request reading one key of block 0, as vllm-ascend pads it (its rows are zeroed). Causality is
`sparse_mode=3` with FIA's 2048x2048 compressed mask (int8, 1 above the diagonal); a sliding
window is `sparse_mode=4` with `pre_tokens=window, next_tokens=0`, as vllm-ascend calls it.
Cache writes are `npu_scatter_pa_kv_cache(cache_mode="Norm")` on the tokens that have a slot
only: what it does with slot -1 is documented for no A2/A3 kernel, so padding is sliced off
(and the compile and capture steps' tokens, which write nothing, are left out).

FIA's documented limits are checked once per shape (`check_supported`): fp16/bf16 queries,
head size 128 (or 192), a block size that is a multiple of 16 up to 1024 (128 is what
vllm-ascend runs), at most 64 query heads per KV head. The facts were read from op-plugin's
FIA and scatter docs and vllm-ascend's attention_v1.py (2026-12-02).

The host lengths come from the step's metadata once per step (the plan), a device-to-host copy
on an NPU. FIA freezes them in a captured graph, so until the replay hook updates them
(issue 20: graph task updates) this backend runs attention outside graphs (`NEVER`):
piecewise graphs around it are fine. Standard decoder attention only so far; MLA and
encoder-only raise. Nothing here has run on Ascend hardware: it is tested against a stand-in
of torch_npu's documented behaviour (tests/fake_torch_npu.py).
"""

from __future__ import annotations

import torch

from kvgraph.attention.backends.base import AttentionBackend, AttentionPlan, GraphSupport
from kvgraph.attention.metadata import AttentionMetadata

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
SUPPORTED_HEAD_SIZES = (128, 192)
MAX_BLOCK_SIZE = 1024
MAX_GROUP = 64  # query heads per KV head
CAUSAL = 3  # FIA sparse_mode: causal, each request's queries aligned to its last keys
BAND = 4  # FIA sparse_mode: causal within `pre_tokens` keys back (a sliding window)
MASK_SIZE = 2048  # FIA's compressed mask for sparse modes 3 and 4


def torch_npu():
    """torch_npu, imported only when this backend runs (see kvgraph/runtime/platforms/npu.py)."""
    import torch_npu as module

    return module


class FusedAttentionPlan(AttentionPlan):
    """One step's host lengths for FIA, read once from the metadata and shared by every layer."""

    def __init__(self, backend, metadata, descriptor):
        super().__init__(backend, metadata, descriptor)
        self._lengths: tuple[list[int], list[int], torch.Tensor] | None = None
        self.real_tokens = 0  # the tokens before the dummy request
        self._writes: tuple[torch.Tensor, torch.Tensor] | None = None

    def lengths(self, num_tokens: int) -> tuple[list[int], list[int], torch.Tensor]:
        """Cumulative query ends, key counts and the block table, padded with the dummy request
        when padding tokens follow the real ones."""
        if self._lengths is None:
            metadata = self.metadata
            reqs = metadata.num_reqs
            ends = metadata.query_start_loc[1:reqs + 1].tolist()
            kv_lens = metadata.seq_lens[:reqs].tolist()
            table = metadata.block_table[:reqs]
            self.real_tokens = ends[-1]
            if ends[-1] < num_tokens:  # padding tokens: one request reading one key of block 0
                ends.append(num_tokens)
                kv_lens.append(1)
                table = torch.cat([table, torch.zeros_like(table[:1])])
            self._lengths = (ends, kv_lens, table.to(torch.int32))
        return self._lengths

    def writes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens that write the cache (those with a slot) and their slots."""
        if self._writes is None:
            slots = self.metadata.slot_mapping[:self.metadata.num_actual_tokens]
            rows = torch.nonzero(slots >= 0).flatten()
            self._writes = (rows, slots.index_select(0, rows))
        return self._writes



class AscendBackend(AttentionBackend):
    """torch_npu's fused attention over the paged cache (see the module docstring)."""

    name = "ascend"
    graph_support = GraphSupport.NEVER
    device_types = ("npu",)
    plan_class = FusedAttentionPlan

    def __init__(self):
        self._checked: set[tuple] = set()
        self._masks: dict[torch.device, torch.Tensor] = {}

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """FIA's compressed causal mask (1 above the diagonal), made once per device: it is the
        same 4 MiB for every step and layer."""
        if device not in self._masks:
            self._masks[device] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8,
                                                        device=device), 1)
        return self._masks[device]

    def check_supported(self, query: torch.Tensor, num_kv_heads: int, block_size: int) -> None:
        """Refuse, naming the limit, what FIA does not run (see the module docstring)."""
        signature = (query.dtype, query.shape[1:], num_kv_heads, block_size)
        if signature in self._checked:
            return
        head_size, group = query.shape[2], query.shape[1] // num_kv_heads
        problems = [
            (query.dtype not in SUPPORTED_DTYPES, f"dtype {query.dtype} (fp16 or bf16)"),
            (head_size not in SUPPORTED_HEAD_SIZES, f"head size {head_size} "
                                                    f"({' or '.join(map(str, SUPPORTED_HEAD_SIZES))})"),
            (block_size % 16 or block_size > MAX_BLOCK_SIZE,
             f"block size {block_size} (a multiple of 16 up to {MAX_BLOCK_SIZE}; 128 advised)"),
            (group > MAX_GROUP, f"{group} query heads per KV head (at most {MAX_GROUP})"),
        ]
        bad = [what for wrong, what in problems if wrong]
        if bad:
            raise ValueError(f"attention backend {self.name!r} (torch_npu's fused attention) "
                             f"cannot run {', '.join(bad)}; use attn_backend='torch_native'")
        self._checked.add(signature)

    def forward(self, query, key, value, kv_cache, out, metadata: AttentionMetadata, scale,
                sliding_window, write_kv=True):
        npu = torch_npu()
        key_cache, value_cache = kv_cache
        self.check_supported(query, key_cache.shape[2], key_cache.shape[1])
        plan = self.step_plan(metadata)
        rows, slots = plan.writes()
        if write_kv and rows.numel():
            npu.npu_scatter_pa_kv_cache(key.index_select(0, rows), value.index_select(0, rows),
                                        key_cache, value_cache, slots, cache_mode="Norm")
        num_tokens, num_heads, head_size = query.shape
        ends, kv_lens, table = plan.lengths(num_tokens)
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        window = {} if sliding_window is None else {"pre_tokens": sliding_window,
                                                    "next_tokens": 0}
        result, _ = npu.npu_fused_infer_attention_score(
            query, key_cache.view(num_blocks, block_size, -1),
            value_cache.view(num_blocks, block_size, -1),
            atten_mask=self.causal_mask(query.device),
            block_table=table, actual_seq_lengths=ends, actual_seq_lengths_kv=kv_lens,
            num_heads=num_heads, num_key_value_heads=num_kv_heads, scale=scale,
            input_layout="TND", sparse_mode=BAND if window else CAUSAL, block_size=block_size,
            **window)
        out.copy_(result)
        out[plan.real_tokens:].zero_()  # the dummy request's rows: padding attends to nothing
