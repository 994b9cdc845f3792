"""A stand-in for the two torch_npu attention ops behind the `ascend` backend's MLA and
encoder-only attention, in plain torch on the CPU, for tests only.

It implements what the docs say and refuses what they refuse (read 2026-12-02 from op-plugin
docs/context/torch_npu-npu_fused_infer_attention_score_v2.md and
torch_npu-npu_fusion_attention.md, and CANN ops-transformer
attention/fused_infer_attention_score/docs/aclnnFusedInferAttentionScoreV3.md):
- `npu_fused_infer_attention_score_v2` in its MLA form only (`query_rope`/`key_rope` given):
  TND queries `[T, N, D]` over a paged latent cache `[num_blocks, 1, block_size, D]` that is
  both key and value, rope parts alike; every input contiguous, rope dtypes those of query and
  key; `actual_seq_qlen` the cumulative query ends (host ints, non-decreasing, the last the
  token count), `actual_seq_kvlen` each request's key count; at most 16 queries per request;
  an int32 block table with one row per request; `sparse_mode=3` causal from the bottom right
  with the 2048x2048 compressed mask, or 0 without a mask; v2's own argument names
  (`num_query_heads`, `softmax_scale`): a v1 name is a TypeError, as on torch_npu. Its `.out`
  form writes contiguous outputs only; `_npu_fused_infer_attention_score_v2_get_max_workspace`
  sizes its workspace.
- `npu_fusion_attention` in TND: `actual_seq_qlen`/`actual_seq_kvlen` both cumulative (at
  most 1024 requests), `sparse_mode=0` without a mask (every key of the request) or 4, a band
  `pre_tockens` keys before to `next_tockens` after the query, both counted from the bottom
  right, with the compressed mask as bool or uint8 (not int8); no dropout. It has no `.out`
  form and no workspace query: a captured graph cannot update it.
Host lengths go through tests/support/fake_npu_graphs.py, so a captured call keeps its lengths. Calls
are recorded in `fake_torch_npu.calls`. Add them with `install(module)` to the module that
`fake_torch_npu.install(monkeypatch)` returned.
"""

from __future__ import annotations

import types

import torch

from tests.support import fake_npu_graphs
from tests.support.fake_torch_npu import HostLengthOp, _host_ints, calls, compressed_causal_mask

NO_LIMIT = 2147483647
MAX_QUERY_PER_REQUEST = 16  # FIA's MLA kernel (d 512 with rope): 1-16 queries per request
MAX_VARLEN_REQUESTS = 1024  # npu_fusion_attention in TND


def _check_lengths(ends, kv_lens, num_tokens: int) -> None:
    if (not ends or ends[-1] != num_tokens or ends != sorted(ends) or ends[0] < 0
            or len(kv_lens) != len(ends)):
        raise ValueError(f"TND needs non-decreasing cumulative query ends ending at "
                         f"{num_tokens} and one kv length per request, got {ends} and {kv_lens}")


def _attend(query, keys, values, scale, visible):
    """Softmax attention of one request `[q, N, *]` over its keys `[k, *]` (one KV head)."""
    scores = torch.einsum("qhd,kd->hqk", query, keys) * scale
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)  # a row seeing none: NaN
    return torch.einsum("hqk,kd->qhd", weights, values)


def _check_mla_inputs(query, key, value, query_rope, key_rope, block_table, block_size,
                      num_query_heads, num_key_value_heads, input_layout) -> None:
    if input_layout != "TND" or query_rope is None or key_rope is None or block_table is None:
        raise ValueError("this fake implements only MLA (query_rope and key_rope) over a paged "
                         "cache in TND")
    if not all(t.is_contiguous() for t in (query, key, value, query_rope, key_rope)):
        raise ValueError("query, key, value, query_rope and key_rope must be contiguous")
    if (query.dim() != 3 or key.dim() != 4 or key.shape[1] != 1 or value.shape != key.shape
            or key.shape[2] != block_size):
        raise ValueError(f"MLA needs query [T, N, D] and key = value [num_blocks, 1, "
                         f"block_size={block_size}, D], got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, {tuple(value.shape)}")
    if (query_rope.shape[:2] != query.shape[:2] or key_rope.shape[:3] != key.shape[:3]
            or query_rope.shape[2] != key_rope.shape[3]):
        raise ValueError("query_rope and key_rope must match query and key but for d")
    if query_rope.dtype != query.dtype or key_rope.dtype != key.dtype:
        raise TypeError("query_rope and key_rope take the dtypes of query and key")
    if num_query_heads != query.shape[1] or num_key_value_heads != 1:
        raise ValueError(f"num_query_heads must be query's N ({query.shape[1]}) and "
                         f"num_key_value_heads 1 (the latent cache's N)")


def _check_mask(sparse_mode, atten_mask, dtypes) -> None:
    if sparse_mode == 0 and atten_mask is None:
        return
    if (atten_mask is None or atten_mask.dtype not in dtypes
            or tuple(atten_mask.shape) != tuple(compressed_causal_mask().shape)
            or not torch.equal(atten_mask.bool(), compressed_causal_mask().bool())):
        raise ValueError(f"sparse_mode {sparse_mode} takes the 2048x2048 compressed causal "
                         f"mask as {' or '.join(map(str, dtypes))}, got "
                         f"{None if atten_mask is None else atten_mask.dtype}")


def _fused_infer_attention_score_v2(
        query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, num_query_heads=1,
        num_key_value_heads=0, softmax_scale=1.0, pre_tokens=NO_LIMIT, next_tokens=NO_LIMIT,
        input_layout="BSH", sparse_mode=0, block_size=0, inner_precise=0,
        return_softmax_lse=False):
    """MLA over the paged latent cache: `(attention_out [T, N, D], softmax_lse [1])`."""
    _check_mla_inputs(query, key, value, query_rope, key_rope, block_table, block_size,
                      num_query_heads, num_key_value_heads, input_layout)
    if pse_shift is not None or return_softmax_lse:
        raise ValueError("MLA supports neither pse_shift nor the softmax lse")
    if sparse_mode not in (0, 3):
        raise ValueError(f"TND supports sparse_mode 0 (no mask) or 3, got {sparse_mode}")
    _check_mask(sparse_mode, atten_mask, (torch.bool, torch.int8, torch.uint8))
    ends = _host_ints("actual_seq_qlen", actual_seq_qlen)
    kv_lens = _host_ints("actual_seq_kvlen", actual_seq_kvlen)
    num_tokens = query.shape[0]
    _check_lengths(ends, kv_lens, num_tokens)
    starts = [0, *ends[:-1]]
    if max(end - start for start, end in zip(starts, ends)) > MAX_QUERY_PER_REQUEST:
        raise ValueError(f"MLA runs 1-{MAX_QUERY_PER_REQUEST} queries per request, got ends "
                         f"{ends}")
    if (block_table.dtype != torch.int32 or block_table.dim() != 2
            or block_table.shape[0] != len(ends) or min(kv_lens) < 1
            or max(kv_lens) > block_table.shape[1] * block_size):
        raise TypeError(f"block_table must be int32 [{len(ends)} requests, blocks] covering "
                        f"kv lengths {kv_lens} (each >= 1), got {block_table.dtype} "
                        f"{tuple(block_table.shape)}")
    calls.append(("npu_fused_infer_attention_score_v2", {
        "ends": ends, "kv_lens": kv_lens, "sparse_mode": sparse_mode, "num_tokens": num_tokens,
        "input_layout": input_layout, "key_shape": tuple(key.shape),
        "table_rows": block_table.shape[0]}))
    out = torch.zeros_like(query)
    for row, (start, end, kv_len) in enumerate(zip(starts, ends, kv_lens)):
        blocks = block_table[row, :(kv_len + block_size - 1) // block_size].long()
        latent = key[blocks].flatten(0, 2)[:kv_len].double()  # [kv_len, D]: N is 1
        rope = key_rope[blocks].flatten(0, 2)[:kv_len].double()
        q = torch.cat([query[start:end], query_rope[start:end]], -1).double()
        q_pos = torch.arange(end - start)[:, None] + kv_len - (end - start)
        visible = (torch.arange(kv_len)[None, :] <= q_pos) if sparse_mode == 3 else True
        visible = torch.as_tensor(visible).expand(end - start, kv_len)
        out[start:end] = _attend(q, torch.cat([latent, rope], -1), latent, softmax_scale,
                                 visible).to(out.dtype)
    return out, torch.zeros(1, dtype=torch.float32)


class ContiguousOutOp(HostLengthOp):
    """A host-length op whose `.out` form, like an NPU kernel's, writes contiguous tensors."""

    def out(self, query, key, value, *, workspace, out, **kwargs):
        if not all(t.is_contiguous() for t in out):
            raise ValueError(f"{self.__name__}.out writes contiguous outputs only")
        super().out(query, key, value, workspace=workspace, out=out, **kwargs)


npu_fused_infer_attention_score_v2 = ContiguousOutOp("npu_fused_infer_attention_score_v2",
                                                     _fused_infer_attention_score_v2)


def _check_fusion_inputs(query, key, value, head_num, input_layout, keep_prob) -> None:
    if input_layout != "TND" or keep_prob != 1.0:
        raise ValueError("this fake implements only TND without dropout")
    if (query.dim() != 3 or key.shape != value.shape or key.shape[0] != query.shape[0]
            or key.shape[2] != query.shape[2] or head_num != query.shape[1]
            or query.shape[1] % key.shape[1]):
        raise ValueError(f"TND needs query [T, head_num, D] and key = value [T, N_kv, D] with "
                         f"N_kv dividing head_num, got {tuple(query.shape)}, "
                         f"{tuple(key.shape)}, head_num={head_num}")
    if not (query.dtype == key.dtype == value.dtype
            and query.dtype in (torch.float16, torch.bfloat16, torch.float32)):
        raise TypeError(f"query, key and value must share fp16, bf16 or fp32, got "
                        f"{query.dtype}, {key.dtype}, {value.dtype}")


def npu_fusion_attention(query, key, value, head_num, input_layout, *, pse=None,
                         padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                         pre_tockens=NO_LIMIT, next_tockens=NO_LIMIT, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                         sparse_mode=0, gen_mask_parallel=True, sync=False, softmax_layout=""):
    """Varlen attention of TND q/k/v: `(attention_out, softmax_max, softmax_sum, reserved,
    seed, offset, mask_length)`."""
    lengths = fake_npu_graphs.host_args("npu_fusion_attention", {
        "actual_seq_qlen": actual_seq_qlen, "actual_seq_kvlen": actual_seq_kvlen})
    if lengths is None:
        raise RuntimeError("npu_fusion_attention has no .out form: no task group can update it")
    _check_fusion_inputs(query, key, value, head_num, input_layout, keep_prob)
    if sparse_mode not in (0, 4) or pse is not None or prefix is not None:
        raise ValueError(f"this fake implements sparse_mode 0 and 4 only, got {sparse_mode}")
    _check_mask(sparse_mode, atten_mask, (torch.bool, torch.uint8))
    ends = _host_ints("actual_seq_qlen", lengths["actual_seq_qlen"])
    kv_ends = _host_ints("actual_seq_kvlen", lengths["actual_seq_kvlen"])
    _check_lengths(ends, kv_ends, query.shape[0])
    if kv_ends != ends or len(ends) > MAX_VARLEN_REQUESTS:
        raise ValueError(f"this fake runs self-attention of at most {MAX_VARLEN_REQUESTS} "
                         f"requests (kv ends equal to query ends), got {ends} and {kv_ends}")
    calls.append(("npu_fusion_attention", {
        "ends": ends, "kv_ends": kv_ends, "sparse_mode": sparse_mode, "pre": pre_tockens,
        "next": next_tockens, "input_layout": input_layout,
        "mask_dtype": None if atten_mask is None else atten_mask.dtype}))
    group = query.shape[1] // key.shape[1]
    out = torch.zeros_like(query)
    for start, end in zip([0, *ends[:-1]], ends):
        pos = torch.arange(end - start)
        distance = pos[None, :] - pos[:, None]  # key - query; equal lengths: no offset
        visible = torch.ones(end - start, end - start, dtype=torch.bool)
        if sparse_mode == 4:
            visible = (distance >= -pre_tockens) & (distance <= next_tockens)
        for h in range(key.shape[1]):
            heads = slice(h * group, (h + 1) * group)
            out[start:end, heads] = _attend(query[start:end, heads].double(),
                                            key[start:end, h].double(),
                                            value[start:end, h].double(), scale,
                                            visible).to(out.dtype)
    empty = torch.zeros(0, dtype=torch.float32)
    return out, empty, empty, empty, 0, 0, 0


def install(module: types.ModuleType) -> types.ModuleType:
    """Add the MLA and encoder ops to the fake torch_npu `module`."""
    module.npu_fused_infer_attention_score_v2 = npu_fused_infer_attention_score_v2
    module._npu_fused_infer_attention_score_v2_get_max_workspace = (
        npu_fused_infer_attention_score_v2.max_workspace)
    module.npu_fusion_attention = npu_fusion_attention
    return module
