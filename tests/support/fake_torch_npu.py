"""A stand-in for `torch_npu`'s attention ops, in plain torch on the CPU, for tests only.

It implements what torch_npu documents for the two calls kvgraph's `ascend` backend makes, and
refuses what they refuse, so a backend that calls them wrongly fails here before it reaches an
NPU (read from op-plugin's docs and vllm-ascend's calls, 2026-12-02):
- `npu_scatter_pa_kv_cache(..., cache_mode="Norm")`: ND caches `[num_blocks, block_size,
  num_kv_heads, head_size]`, contiguous inputs, slots in range or -1, which writes nothing
  (vllm-ascend's nightly test on hardware checks it);
- `npu_fused_infer_attention_score` in `input_layout="TND"` over a paged cache viewed as
  `[num_blocks, block_size, num_kv_heads * head_size]`: `actual_seq_lengths` the cumulative
  query ends (host ints, the last equal to the token count), `actual_seq_lengths_kv` each
  request's key count (>= 1), an int32 block table; `sparse_mode=3` causal from the bottom
  right with the 2048x2048 mask (1 or True above the diagonal); `sparse_mode=4` a band of
  `pre_tokens` keys ending at the query, as vllm-ascend's sliding windows rely on.
- its `.out` form (`workspace=`, `out=[attention_out, softmax_lse]`) and
  `_npu_fused_infer_attention_score_get_max_workspace`, which graph task groups use.
FIA's dtype, head-size and block-size limits are the backend's own check (`check_supported`),
which the tests relax to run the tiny example models. Host lengths go through the graph fake
(tests/support/fake_npu_graphs.py), which freezes them in captured graphs. Install it with
`install(monkeypatch)` (torch.npu too); it records every call in `calls`. The real module is
never imported in tests.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from tests.support import fake_npu_graphs

MASK_SIZE = 2048  # the compressed causal mask FIA takes for sparse modes 3 and 4
calls: list[tuple[str, dict[str, Any]]] = []


def compressed_causal_mask(device: torch.device | str = "cpu") -> torch.Tensor:
    """The mask FIA's sparse modes 3 and 4 read: True (masked) above the diagonal."""
    return torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device), 1)


def _host_ints(name: str, value: Any) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(type(v) is int for v in value):
        raise TypeError(f"{name} must be a host list of ints, got {type(value).__name__}")
    return list(value)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            cache_mode="Norm", **unused) -> None:
    """Write each token's key and value into its slot of the paged caches; slot -1 skips it."""
    calls.append(("npu_scatter_pa_kv_cache", {"slots": slot_mapping.tolist(),
                                              "cache_mode": cache_mode}))
    if cache_mode != "Norm" or key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError("npu_scatter_pa_kv_cache: Norm mode writes 4-D ND caches")
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("npu_scatter_pa_kv_cache: key and value must be contiguous")
    if key.shape[0] != slot_mapping.shape[0] or key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(f"npu_scatter_pa_kv_cache: key {tuple(key.shape)} does not fit cache "
                         f"{tuple(key_cache.shape)} and {slot_mapping.shape[0]} slots")
    slots = slot_mapping.long()
    capacity = key_cache.shape[0] * key_cache.shape[1]
    if slots.numel() and (int(slots.min()) < -1 or int(slots.max()) >= capacity):
        raise ValueError(f"npu_scatter_pa_kv_cache: slots must be -1 or lie in "
                         f"[0, {capacity - 1}]")
    rows = slots >= 0
    for source, cache in ((key, key_cache), (value, value_cache)):
        cache.view(-1, *cache.shape[2:])[slots[rows]] = source[rows].to(cache.dtype)


class HostLengthOp:
    """An op taking host lengths: called, its result; `.out(..., workspace, out)` writes `out`
    (and, between graph_task_update_begin/end, only updates its task group)."""

    def __init__(self, name: str, compute):
        self.__name__, self.compute = name, compute

    def __call__(self, query, key, value, **kwargs):
        return self.compute(query, key, value, **fake_npu_graphs.host_args(self.__name__, kwargs))

    def out(self, query, key, value, *, workspace, out, **kwargs):
        if not isinstance(workspace, torch.Tensor) or len(out) != 2:
            raise TypeError(f"{self.__name__}.out takes a workspace tensor and out=[output, lse]")
        kwargs = fake_npu_graphs.host_args(self.__name__, kwargs)
        if kwargs is not None:
            out[0].copy_(self.compute(query, key, value, **kwargs)[0])

    def max_workspace(self, query, key, value, **kwargs):
        for name, value in kwargs.items():
            if name.startswith("actual_seq"):
                _host_ints(name, value)
        return torch.empty(16, dtype=torch.uint8)


def _fused_infer_attention_score(query, key, value, *, atten_mask=None, block_table=None,
                                 actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                 num_heads=1, num_key_value_heads=0, scale=1.0,
                                 input_layout="BSH", sparse_mode=0, pre_tokens=2147483647,
                                 next_tokens=2147483647, block_size=0, **unused):
    """Paged attention of TND queries: `(attention_out [T, N, D], softmax_lse)`."""
    if input_layout != "TND" or block_table is None:
        raise ValueError("this fake implements only paged TND attention")
    ends = _host_ints("actual_seq_lengths", actual_seq_lengths)
    kv_lens = _host_ints("actual_seq_lengths_kv", actual_seq_lengths_kv)
    num_tokens, heads, head_size = query.shape
    if (ends[-1] != num_tokens or len(kv_lens) != len(ends) or ends != sorted(ends)
            or min(kv_lens) < 1):
        raise ValueError(f"TND needs cumulative query ends ending at {num_tokens} and one kv "
                         f"length >= 1 per request, got {ends} and {kv_lens}")
    if heads != num_heads or key.dim() != 3 or key.shape[1] != block_size:
        raise ValueError("query must be [T, num_heads, D], key and value [blocks, block_size, "
                         "num_kv_heads * D]")
    if sparse_mode in (3, 4) and (atten_mask is None
                                  or tuple(atten_mask.shape) != (MASK_SIZE, MASK_SIZE)
                                  or atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8)
                                  or not torch.equal(atten_mask.bool(),
                                                     compressed_causal_mask().bool())):
        raise ValueError("sparse modes 3 and 4 take the 2048x2048 compressed causal mask")
    if block_table.dtype != torch.int32 or block_table.shape[0] != len(ends):
        raise TypeError(f"block_table must be int32 with one row per request ({len(ends)}), "
                        f"got {block_table.dtype} {tuple(block_table.shape)}")
    calls.append(("npu_fused_infer_attention_score", {
        "ends": ends, "kv_lens": kv_lens, "sparse_mode": sparse_mode, "pre_tokens": pre_tokens,
        "num_tokens": num_tokens}))
    kv_heads = num_key_value_heads or num_heads
    out = torch.zeros_like(query)
    lse = torch.zeros(num_tokens, num_heads, 1, dtype=torch.float32)
    start = 0
    for row, (end, kv_len) in enumerate(zip(ends, kv_lens)):
        if end == start:
            continue
        blocks = block_table[row, :(kv_len + block_size - 1) // block_size].long()
        keys = key[blocks].flatten(0, 1)[:kv_len].view(kv_len, kv_heads, head_size)
        values = value[blocks].flatten(0, 1)[:kv_len].view(kv_len, kv_heads, head_size)
        keys = keys.repeat_interleave(num_heads // kv_heads, 1).float()
        values = values.repeat_interleave(num_heads // kv_heads, 1).float()
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        q_pos = torch.arange(end - start)[:, None] + kv_len - (end - start)
        k_pos = torch.arange(kv_len)[None, :]
        visible = torch.ones_like(scores[0], dtype=torch.bool)
        if sparse_mode in (3, 4):
            visible &= k_pos <= q_pos
        if sparse_mode == 4:
            visible &= k_pos > q_pos - pre_tokens
        scores = scores.masked_fill(~visible, float("-inf"))
        lse[start:end, :, 0] = torch.logsumexp(scores, -1).transpose(0, 1)
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(out.dtype)
        start = end
    return out, lse


npu_fused_infer_attention_score = HostLengthOp("npu_fused_infer_attention_score",
                                               _fused_infer_attention_score)


def install(monkeypatch) -> types.ModuleType:
    """Put this stand-in in `sys.modules["torch_npu"]` for one test."""
    module = types.ModuleType("torch_npu")
    module.npu_scatter_pa_kv_cache = npu_scatter_pa_kv_cache
    module.npu_fused_infer_attention_score = npu_fused_infer_attention_score
    module._npu_fused_infer_attention_score_get_max_workspace = (
        npu_fused_infer_attention_score.max_workspace)
    module.npu = fake_npu_graphs.install(monkeypatch)
    module.calls = calls
    calls.clear()
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", module)
    return module
