"""Ascend MLA and encoder-only attention: the `ascend` backend's `forward_mla` and
`forward_encoder`, over torch_npu's fused attention ops.

MLA stays in the latent space: `npu_fused_infer_attention_score_v2` with `query_rope` and
`key_rope` is MQA with one 512-wide latent head as both key and value (the cache viewed as
`[num_blocks, 1, block_size, rank]`, no copy) plus a 64-wide rope part, in TND over the paged
cache, `sparse_mode=3` with FIA's compressed causal mask: what vllm-ascend runs for MLA decode
and speculative decode (mla_v1.py `_forward_decode`). One op serves prefill too: that kernel
takes 1-16 queries per request, so outside full graphs a longer request is cut into pieces of
at most 16 queries, each reading its keys up to its last query (bottom-right causality keeps
every piece exact) with the request's block-table row. A full graph's calls keep the request
count they were captured with and `launch` rewrites their lengths per replay, so they cannot
be cut: a full graph is captured only where no request can exceed 16 queries (uniform decode,
or at most 16 tokens), any other capture is refused and its batches run without graphs.
Documented limits (`check_supported_mla`): fp16/bf16, kv_lora_rank 512, rope 64, a power of
two of heads up to 128, block size 16 or 128 (the backend's `check_block_size` allows multiples
of 128 up to 512, so an MLA model runs 128); cache writes are `npu_scatter_pa_kv_cache` on
`[num_blocks, block_size, 1, dim]` views (its doc: key and value head sizes may differ).

Encoder-only attention is `npu_fusion_attention` in TND: bidirectional within each request,
query and key ends both cumulative, a window |i - j| < w a band (`sparse_mode=4`,
`pre_tockens = next_tockens = w - 1`, as its doc's mask example defines them) with the
compressed mask viewed as uint8 (it takes no int8). FIA cannot serve it: FIA TND takes only
sparse modes 0 and 3 (no band), bf16 and equal query and KV heads without a cache, and
`launch` gives FIA per-request key counts where non-paged TND wants cumulative ends. The op
has no `.out` form or workspace query and its doc says it runs in no graph mode, so a
full-graph capture of it is refused (piecewise graphs run it outside them). Its limits
(`check_supported_encoder`): fp16/bf16/fp32, head size up to 768, up to 256 heads, up to 1024
requests. Padding tokens (slot -1) get zero rows in both.

Read 2026-12-02: op-plugin docs/context/torch_npu-npu_fused_infer_attention_score_v2.md,
torch_npu-npu_fused_infer_attention_score.md, torch_npu-npu_fusion_attention.md,
torch_npu-npu_scatter_pa_kv_cache.md; CANN ops-transformer attention/fused_infer_attention_score/
docs/aclnnFusedInferAttentionScoreV3.md (MLA heads 1-128, powers of two; op-plugin's copy says
32/64/128); vllm-ascend vllm_ascend/attention/mla_v1.py (`_forward_decode`,
`update_graph_params`, the 16-query limit) and attention_v1.py (`_forward_encoder_attention`).
Not run on Ascend hardware: tested against tests/support/fake_npu_mla_ops.py.
"""

from __future__ import annotations

import functools

import torch

from kvgraph.attention.backends import ascend_ops
from kvgraph.errors import GraphError

FIA_V2 = "npu_fused_infer_attention_score_v2"
FIA_V2_LENGTHS = ("actual_seq_qlen", "actual_seq_kvlen")
MAX_QUERY_PER_REQUEST = 16  # FIA's MLA kernel: 1-16 queries per request
MLA_RANK, MLA_ROPE = 512, 64
MLA_MAX_HEADS = 128
MLA_BLOCK_SIZES = (16, 128)
ENCODER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
ENCODER_MAX_HEAD_SIZE, ENCODER_MAX_HEADS = 768, 256
ENCODER_MAX_REQUESTS = 1024  # npu_fusion_attention's varlen request count
BAND = 4  # npu_fusion_attention sparse_mode: keys pre_tockens before to next_tockens after


def _refuse(what: str, problems: list[tuple[bool, str]]) -> None:
    bad = [text for wrong, text in problems if wrong]
    if bad:
        raise ValueError(f"attention backend 'ascend' ({what}) cannot run {', '.join(bad)}; "
                         "use attn_backend='torch_native'")


def check_supported_mla(q_latent: torch.Tensor, q_pe: torch.Tensor,
                        kv_c_cache: torch.Tensor) -> None:
    """Refuse, naming the limit, what FIA's MLA kernel does not run (see the module docstring)."""
    _check_mla(q_latent.dtype, q_pe.dtype, kv_c_cache.dtype, *q_latent.shape[1:],
               q_pe.shape[2], kv_c_cache.shape[1])


@functools.lru_cache(maxsize=64)  # a pure function of shapes; only passing ones are cached
def _check_mla(dtype, rope_dtype, cache_dtype, heads, rank, rope_dim, block_size) -> None:
    _refuse("torch_npu's fused MLA attention", [
        (dtype not in ascend_ops.SUPPORTED_DTYPES or not dtype == rope_dtype == cache_dtype,
         f"dtype {dtype} (fp16 or bf16, queries and caches alike)"),
        (rank != MLA_RANK, f"kv_lora_rank {rank} ({MLA_RANK})"),
        (rope_dim != MLA_ROPE, f"rope_dim {rope_dim} ({MLA_ROPE})"),
        (heads > MLA_MAX_HEADS or heads & (heads - 1),
         f"{heads} query heads (a power of two up to {MLA_MAX_HEADS})"),
        (block_size not in MLA_BLOCK_SIZES,
         f"block size {block_size} ({' or '.join(map(str, MLA_BLOCK_SIZES))})"),
    ])


def check_supported_encoder(query: torch.Tensor) -> None:
    """Refuse, naming the limit, what npu_fusion_attention does not run."""
    _check_encoder(query.dtype, *query.shape[1:])


@functools.lru_cache(maxsize=64)
def _check_encoder(dtype, heads, head_size) -> None:
    _refuse("torch_npu's npu_fusion_attention", [
        (dtype not in ENCODER_DTYPES, f"dtype {dtype} (fp16, bf16 or fp32)"),
        (head_size > ENCODER_MAX_HEAD_SIZE,
         f"head size {head_size} (at most {ENCODER_MAX_HEAD_SIZE})"),
        (heads > ENCODER_MAX_HEADS, f"{heads} query heads (at most {ENCODER_MAX_HEADS})"),
    ])


def split_requests(ends: list[int], kv_lens: list[int]
                   ) -> tuple[list[int], list[int], list[int]]:
    """Each request cut into pieces of at most 16 queries: their query ends, key counts (keys
    up to the piece's last query; at least one, as for FIA's dummy request) and block rows."""
    piece_ends, piece_kv_lens, rows = [], [], []
    start = 0
    for row, (end, kv_len) in enumerate(zip(ends, kv_lens)):
        cuts = [*range(start + MAX_QUERY_PER_REQUEST, end, MAX_QUERY_PER_REQUEST), end]
        piece_ends += cuts
        piece_kv_lens += [max(kv_len - (end - cut), 1) for cut in cuts]
        rows += [row] * len(cuts)
        start = end
    return piece_ends, piece_kv_lens, rows


def _refuse_capture_beyond_limit(plan) -> None:
    """A captured call cannot be cut per replay: refuse graphs whose requests may be long."""
    # A uniform batch's requests hold query_len tokens each: within FIA's limit, no cut needed.
    uniform = (plan.descriptor is not None and plan.descriptor.uniform_decode
               and plan.descriptor.query_len <= MAX_QUERY_PER_REQUEST)
    if plan.capture is not None and not uniform and plan.num_tokens > MAX_QUERY_PER_REQUEST:
        raise GraphError(
            f"a full graph of {plan.num_tokens} mixed tokens cannot hold ascend MLA: FIA's MLA "
            f"kernel takes at most {MAX_QUERY_PER_REQUEST} query tokens per request, and a "
            "captured call's requests cannot be cut per replay; its batches run without graphs "
            f"(full graphs of uniform decode or at most {MAX_QUERY_PER_REQUEST} tokens work)")


def _write_latent(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    """Scatter the step's latents into `(kv_c_cache, k_pe_cache)`; slot -1 writes nothing."""
    kv_c_cache, k_pe_cache = kv_cache
    ascend_ops.torch_npu().npu_scatter_pa_kv_cache(
        kv_c[:, None].contiguous(), k_pe[:, None].contiguous(), kv_c_cache.unsqueeze(2),
        k_pe_cache.unsqueeze(2), slot_mapping, cache_mode="Norm")


def forward_mla(backend, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                write_kv=True) -> None:
    """`AscendBackend.forward_mla` (limits are checked by the caller, `check_supported_mla`)."""
    plan = backend.step_plan(metadata)
    if write_kv:
        _write_latent(kv_c, k_pe, kv_cache, metadata.slot_mapping)
    kv_c_cache, k_pe_cache = kv_cache
    latent = kv_c_cache.unsqueeze(1)  # [num_blocks, 1 (KV head), block_size, rank]
    kwargs = dict(
        query=q_latent.contiguous(), key=latent, value=latent,
        query_rope=q_pe.contiguous(), key_rope=k_pe_cache.unsqueeze(1),
        atten_mask=backend.causal_mask(q_latent.device), block_table=plan.block_table(),
        input_layout="TND", block_size=kv_c_cache.shape[1], num_query_heads=q_latent.shape[1],
        num_key_value_heads=1, softmax_scale=scale, sparse_mode=ascend_ops.CAUSAL)
    # FIA writes contiguous outputs; `out` follows q_latent's strides (an einsum's, often not).
    result = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype,
                                                          device=out.device)
    if plan.full_graph:
        _refuse_capture_beyond_limit(plan)
        backend.launch(plan, FIA_V2, kwargs, FIA_V2_LENGTHS, result)
    else:
        _attend_in_pieces(plan, kwargs, result)
    if result is not out:
        out.copy_(result)
    out.masked_fill_(plan.padding(), 0)  # the dummy request's rows: padding attends to none


def _attend_in_pieces(plan, kwargs, result) -> None:
    """FIA on this step's requests cut into pieces (outside full graphs, so no capture)."""
    ends, kv_lens, rows = split_requests(*plan.host_lengths())
    if len(rows) > len(plan.host_lengths()[0]):  # some request was cut
        table = kwargs["block_table"]
        kwargs["block_table"] = table.index_select(0, torch.tensor(rows, device=table.device))
    attention = getattr(ascend_ops.torch_npu(), FIA_V2)
    result.copy_(attention(**kwargs, actual_seq_qlen=ends, actual_seq_kvlen=kv_lens)[0])


def forward_encoder(backend, query, key, value, out, metadata, scale,
                    sliding_window=None) -> None:
    """`AscendBackend.forward_encoder` (limits checked by the caller, `check_supported_encoder`)."""
    plan = backend.step_plan(metadata)
    if plan.capture is not None:
        raise GraphError("torch_npu.npu_fusion_attention (ascend encoder-only attention) has no "
                         ".out form and workspace query and runs in no graph mode, so it "
                         "cannot be captured in a full graph; its batches run without graphs")
    ends = plan.host_lengths()[0]  # the dummy request, if any, holds the padding tokens
    if len(ends) > ENCODER_MAX_REQUESTS:
        raise ValueError(f"npu_fusion_attention runs at most {ENCODER_MAX_REQUESTS} requests "
                         f"per call, got {len(ends)}")
    reach = sliding_window - 1 if sliding_window else ascend_ops.NO_LIMIT
    # npu_fusion_attention takes the mask as bool or uint8: FIA's int8 one, reinterpreted.
    mask = backend.causal_mask(query.device).view(torch.uint8) if sliding_window else None
    result = ascend_ops.torch_npu().npu_fusion_attention(
        query=query.contiguous(), key=key.contiguous(), value=value.contiguous(),
        head_num=query.shape[1], input_layout="TND", atten_mask=mask, scale=scale,
        pre_tockens=reach, next_tockens=reach, actual_seq_qlen=ends, actual_seq_kvlen=ends,
        sparse_mode=BAND if sliding_window else 0)
    out.copy_(result[0])
    out.masked_fill_(plan.padding(), 0)
