"""Ascend attention: torch_npu's fused paged attention (FIA, TND layout) and cache scatter.

One `npu_fused_infer_attention_score` call per layer serves prefill, chunked prefill and decode
alike: queries in TND (`[T, num_heads, head_size]`), the paged caches viewed as
`[num_blocks, block_size, num_kv_heads * head_size]` (no copy), `actual_seq_lengths` the
cumulative query ends and `actual_seq_lengths_kv` each request's key count, both host ints.
TND needs the last query end to be the padded token count, so padding tokens form one dummy
request reading one key of block 0, as vllm-ascend pads it (its rows are zeroed). Causality is
`sparse_mode=3` with FIA's 2048x2048 compressed mask (int8, 1 above the diagonal); a sliding
window is `sparse_mode=4` with `pre_tokens=window, next_tokens=0`, as vllm-ascend calls it.
Cache writes are `npu_scatter_pa_kv_cache(cache_mode="Norm")` on every token: it skips slot -1
(vllm-ascend's nightly op test checks it on hardware), which is kvgraph's padding rule, so
nothing is sliced by a host count a captured graph would freeze.

FIA's documented limits are checked once per shape (`check_supported`): fp16/bf16 queries,
head size 128 (or 192), a block size that is a multiple of 128 up to 512 (what the doc gives
paged attention; 128 is what vllm-ascend runs and the NPU platform's default), at most 64 query
heads per KV head. The facts were read from op-plugin's FIA, scatter and graph task docs and
vllm-ascend's attention_v1.py and acl_graph.py (2026-12-02).

The host lengths come from the host copies of the step's lengths (no device read), once per
step (the plan). Every graph mode runs: piecewise graphs leave attention outside them, and in a
full graph each FIA call is a task group whose lengths are rewritten before each replay
(kvgraph.attention.backends.ascend_task_groups). Nothing here has run on Ascend hardware: it is
tested against a stand-in of torch_npu's documented behaviour (tests/support/fake_torch_npu.py,
tests/support/fake_npu_graphs.py).
"""

from __future__ import annotations

import torch

from kvgraph.attention.backends import ascend_mla
from kvgraph.attention.backends import ascend_task_groups as task_groups
from kvgraph.attention.backends.ascend_ops import (
    BAND,
    CAUSAL,
    MASK_SIZE,
    NO_LIMIT,
    SUPPORTED_DTYPES,
    torch_npu,
)
from kvgraph.attention.backends.ascend_task_groups import CapturedCalls
from kvgraph.attention.backends.base import AttentionBackend, AttentionPlan, GraphSupport
from kvgraph.attention.metadata import AttentionMetadata
from kvgraph.config import GraphMode
from kvgraph.errors import ConfigError

SUPPORTED_HEAD_SIZES = (128, 192)
BLOCK_SIZE_STEP = 128  # paged FIA: block sizes 128 to 512 in steps of 128 (op-plugin's FIA doc)
MAX_BLOCK_SIZE = 512
MAX_GROUP = 64  # query heads per KV head
FIA_LENGTHS = ("actual_seq_lengths", "actual_seq_lengths_kv")  # FIA v1's host length arguments


class FusedAttentionPlan(AttentionPlan):
    """One step's host lengths for FIA, read once from the host copies and shared by every
    layer; the device tensors derived from them are made inside the forward, so that a
    captured graph records them."""

    def __init__(self, backend, metadata, descriptor):
        super().__init__(backend, metadata, descriptor)
        self.num_tokens = metadata.slot_mapping.shape[0]  # padded
        rows = metadata.block_table.shape[0]
        starts = _host(metadata.host_query_start_loc, metadata.query_start_loc)[:rows + 1]
        kv_lens = _host(metadata.host_seq_lens, metadata.seq_lens)[:rows]
        # Padded request rows have no key; FIA wants one, which row 0 of block 0 provides.
        self._request_lengths = ([int(end) for end in starts[1:]],
                                 [max(int(n), 1) for n in kv_lens])
        self.full_graph = False  # set by the graph hooks (see `host_lengths`)
        self.capture: CapturedCalls | None = None  # a full graph's calls, while captured
        self._lengths: tuple[list[int], list[int]] | None = None
        self._table: torch.Tensor | None = None
        self._padding: torch.Tensor | None = None

    def host_lengths(self) -> tuple[list[int], list[int]]:
        """FIA's `actual_seq_lengths` (cumulative query ends) and `actual_seq_lengths_kv`.

        TND wants the last end to be the padded token count: padding tokens after the
        requests form one dummy request reading one key. A full graph's calls have a fixed
        request count (they are updated in place), so there the dummy is there whenever the
        descriptor's rows cannot own every token, possibly with no token of its own.
        """
        if self._lengths is None:
            ends, kv_lens = (list(values) for values in self._request_lengths)
            rows = len(ends)
            if (rows < self.num_tokens) if self.full_graph else ends[-1] < self.num_tokens:
                ends.append(self.num_tokens)
                kv_lens.append(1)
            self._lengths = ends, kv_lens
        return self._lengths

    def block_table(self) -> torch.Tensor:
        """The int32 block table of `host_lengths`' requests (the dummy's row reads block 0)."""
        if self._table is None:
            table = self.metadata.block_table
            if len(self.host_lengths()[0]) > table.shape[0]:
                table = torch.cat([table, torch.zeros_like(table[:1])])
            self._table = table
        return self._table

    def padding(self) -> torch.Tensor:
        """`[T, 1, 1]`, True on padding tokens (slot -1): their rows of `out` become zeros.

        A mask on the device, not a host count: a captured graph replays it for every batch.
        """
        if self._padding is None:
            self._padding = (self.metadata.slot_mapping < 0)[:, None, None]
        return self._padding


def _runs_block_size(block_size: int) -> bool:
    return block_size % BLOCK_SIZE_STEP == 0 and block_size <= MAX_BLOCK_SIZE


def _host(array, tensor: torch.Tensor):
    """A length array's host copy, or (metadata without one) the device tensor read back."""
    return array if array is not None else tensor.tolist()


class AscendBackend(AttentionBackend):
    """torch_npu's fused attention over the paged cache (see the module docstring)."""

    name = "ascend"
    graph_support = GraphSupport.ALWAYS  # full graphs' host lengths are updated per replay
    device_types = ("npu",)
    plan_class = FusedAttentionPlan

    def __init__(self):
        self._checked: set[tuple] = set()
        self._masks: dict[torch.device, torch.Tensor] = {}
        self._update_streams: dict[torch.device, object] = {}

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
            (not _runs_block_size(block_size),
             f"block size {block_size} (a multiple of {BLOCK_SIZE_STEP} up to {MAX_BLOCK_SIZE})"),
            (group > MAX_GROUP, f"{group} query heads per KV head (at most {MAX_GROUP})"),
        ]
        bad = [what for wrong, what in problems if wrong]
        if bad:
            raise ValueError(f"attention backend {self.name!r} (torch_npu's fused attention) "
                             f"cannot run {', '.join(bad)}; use attn_backend='torch_native'")
        self._checked.add(signature)

    def check_block_size(self, block_size: int) -> None:
        if not _runs_block_size(block_size):
            raise ConfigError("block_size", f"attention backend {self.name!r} (torch_npu's fused "
                              f"attention) runs block sizes that are multiples of "
                              f"{BLOCK_SIZE_STEP} up to {MAX_BLOCK_SIZE} (128, the NPU default, "
                              f"is what vllm-ascend runs), got {block_size}")

    # --- graph hooks: FIA's host lengths in full graphs --------------------------------------

    def before_capture(self, mode, descriptor, metadata):
        plan = self.step_plan(metadata)
        plan.full_graph = mode is GraphMode.FULL
        plan.capture = CapturedCalls() if plan.full_graph else None

    def after_capture(self, mode, descriptor, metadata) -> CapturedCalls | None:
        plan = self.step_plan(metadata)
        captured, plan.capture = plan.capture, None
        return captured

    def before_replay(self, mode, descriptor, metadata, captured=None):
        plan = self.step_plan(metadata)
        plan.full_graph = mode is GraphMode.FULL
        if captured:
            device = captured.calls[0].out[0].device
            task_groups.update(torch.npu, torch_npu(), captured, self._update_stream(device),
                               plan.host_lengths)

    def _update_stream(self, device: torch.device):
        """The side stream updates are issued on (one per device: updates never overlap)."""
        if device not in self._update_streams:
            self._update_streams[device] = torch.npu.Stream(device=device)
        return self._update_streams[device]

    def launch(self, plan: FusedAttentionPlan, op_name: str, kwargs: dict,
               length_names: tuple[str, str], out: torch.Tensor) -> None:
        """`torch_npu.<op_name>(**kwargs)` with this step's host lengths (under the op's
        `length_names` for query ends and key counts), its attention output written into `out`.

        In a full-graph capture the call becomes a task group whose lengths `before_replay`
        rewrites (kvgraph.attention.backends.ascend_task_groups).
        """
        lengths = dict(zip(length_names, plan.host_lengths()))
        if plan.capture is not None:
            lse = torch.empty(1, dtype=out.dtype, device=out.device)  # softmax_lse_flag off
            task_groups.capture_call(torch.npu, torch_npu(), plan.capture, op_name, kwargs,
                                     lengths, [out, lse])
            return
        out.copy_(getattr(torch_npu(), op_name)(**kwargs, **lengths)[0])

    # --- kernels ----------------------------------------------------------------------------

    def forward(self, query, key, value, kv_cache, out, metadata: AttentionMetadata, scale,
                sliding_window, write_kv=True):
        key_cache, value_cache = kv_cache
        self.check_supported(query, key_cache.shape[2], key_cache.shape[1])
        plan = self.step_plan(metadata)
        if write_kv:  # slot -1 (padding, and the compile and capture steps) writes nothing
            torch_npu().npu_scatter_pa_kv_cache(key.contiguous(), value.contiguous(), key_cache,
                                                value_cache, metadata.slot_mapping,
                                                cache_mode="Norm")
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        kwargs = dict(
            query=query, key=key_cache.view(num_blocks, block_size, -1),
            value=value_cache.view(num_blocks, block_size, -1),
            atten_mask=self.causal_mask(query.device), block_table=plan.block_table(),
            input_layout="TND", block_size=block_size, num_heads=query.shape[1],
            num_key_value_heads=num_kv_heads, scale=scale,
            sparse_mode=BAND if sliding_window else CAUSAL,
            pre_tokens=sliding_window or NO_LIMIT, next_tokens=0 if sliding_window else NO_LIMIT)
        self.launch(plan, "npu_fused_infer_attention_score", kwargs, FIA_LENGTHS, out)
        out.masked_fill_(plan.padding(), 0)  # the dummy request's rows: padding attends to none

    def check_supported_mla(self, q_latent, q_pe, kv_c_cache) -> None:
        """Refuse, naming the limit, what FIA's MLA kernel does not run (ascend_mla)."""
        ascend_mla.check_supported_mla(q_latent, q_pe, kv_c_cache)

    def check_supported_encoder(self, query) -> None:
        """Refuse, naming the limit, what npu_fusion_attention does not run (ascend_mla)."""
        ascend_mla.check_supported_encoder(query)

    def forward_mla(self, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                    write_kv=True):
        self.check_supported_mla(q_latent, q_pe, kv_cache[0])
        ascend_mla.forward_mla(self, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                               write_kv)

    def forward_encoder(self, query, key, value, out, metadata, scale, sliding_window=None):
        self.check_supported_encoder(query)
        ascend_mla.forward_encoder(self, query, key, value, out, metadata, scale, sliding_window)
