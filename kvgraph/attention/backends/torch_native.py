"""Portable paged attention in plain torch: the reference backend, for any device.

It handles any mix of prefill, chunked prefill and decode in one batch, and makes no host
synchronisation: every shape comes from tensor shapes and the host ints of the metadata
(`max_query_len`, `max_seq_len`), so a uniform step (decode, or a speculative verify step of
1 + K tokens a request) can be captured in a graph.

Buffers: it keeps none. Its step plan (`TokenLayoutPlan`) maps tokens to the padded
`[num_reqs, max_query_len]` layout once per step; per call it gathers each request's cached
keys/values into a padded `[num_reqs, blocks_read * block_size, ...]` tensor; memory grows
with `num_reqs * max_seq_len`, which is the price of being portable. Device backends replace it
where speed matters. A device's full graph freezes both host ints (`frozen_lengths`: the
largest a replay meets, so a uniform-decode graph reads `max_model_len` keys per request).
"""

from __future__ import annotations

import torch

from kvgraph.attention.backends.base import AttentionBackend, AttentionPlan, GraphSupport
from kvgraph.attention.metadata import AttentionMetadata, cdiv


def write_to_cache(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values[i]` into slot `slot_mapping[i]` of `cache`; slot -1 writes nothing.

    Without a host sync the number of real slots is unknown, so padding tokens are redirected to
    a real token's slot carrying that token's own value (or, in an all-padding batch, to slot 0
    carrying its current contents): every duplicate write stores identical bytes.
    """
    flat = cache.view(-1, *cache.shape[2:])
    values = values.to(flat.dtype)
    valid = slot_mapping >= 0
    donor = valid.int().argmax().view(1)  # first real token, or 0 when there is none
    any_valid = valid.any()
    donor_slot = torch.where(any_valid, slot_mapping.index_select(0, donor), 0)
    donor_value = torch.where(any_valid, values.index_select(0, donor), flat[:1])
    target = torch.where(valid, slot_mapping, donor_slot)
    keep = valid.view(-1, *([1] * (values.dim() - 1)))
    flat.index_copy_(0, target, torch.where(keep, values, donor_value))


class TokenLayout:
    """Where each flat token sits in the padded `[num_reqs, max_query_len]` layout."""

    def __init__(self, num_tokens: int, metadata: AttentionMetadata, device: torch.device):
        starts = metadata.query_start_loc.long()
        num_reqs = starts.shape[0] - 1
        self.query_lens = starts[1:] - starts[:-1]
        tokens = torch.arange(num_tokens, device=device)
        # Tokens past the last request are padding: they read a clamped position and get zeros.
        self.token_valid = tokens < starts[-1]
        self.token_req = torch.searchsorted(starts[1:], tokens, right=True).clamp(max=num_reqs - 1)
        self.token_col = (tokens - starts[self.token_req]).clamp(0, metadata.max_query_len - 1)
        cols = torch.arange(metadata.max_query_len, device=device)
        self.padded_tokens = (starts[:-1, None] + cols).clamp(max=num_tokens - 1)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` -> `[num_reqs, max_query_len, ...]` (rows past a request's end are junk)."""
        return x[self.padded_tokens]

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """`[num_reqs, max_query_len, ...]` -> `[T, ...]`, zeros for padding tokens."""
        rows = x[self.token_req, self.token_col]
        return torch.where(self.token_valid.view(-1, *([1] * (rows.dim() - 1))), rows, 0)


class TokenLayoutPlan(AttentionPlan):
    """One step's token layout and key lengths, built by the step's first attention call and
    read by every other layer's.

    Built lazily on the device from the metadata's tensors, not on the host: inside a device
    graph the first layer's call is recorded with the graph, so a replay rebuilds the layout
    from the replayed step's metadata, and the layers after it read that one.
    """

    def __init__(self, backend, metadata, descriptor):
        super().__init__(backend, metadata, descriptor)
        self._layout: TokenLayout | None = None
        self._key_lens: torch.Tensor | None = None
        self._block_ids: torch.Tensor | None = None

    def layout(self, num_tokens: int, device: torch.device) -> TokenLayout:
        if self._layout is None:
            self._layout = TokenLayout(num_tokens, self.metadata, device)
        return self._layout

    @property
    def key_lens(self) -> torch.Tensor:
        if self._key_lens is None:
            self._key_lens = self.metadata.seq_lens.long()
        return self._key_lens

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """Each request's cached rows, `[num_reqs, blocks_read * block_size, ...]`."""
        if self._block_ids is None:
            metadata = self.metadata
            blocks_read = min(cdiv(metadata.max_seq_len, metadata.block_size),
                              metadata.block_table.shape[1])
            self._block_ids = metadata.block_table[:, :blocks_read].long()
        return cache[self._block_ids].flatten(1, 2)  # [num_reqs, blocks_read, block_size, ...]


def attend(
    query: torch.Tensor,  # [R, Q, H, Dk]
    keys: torch.Tensor,  # [R, K, Hkv, Dk]
    values: torch.Tensor,  # [R, K, Hkv, Dv]
    key_lens: torch.Tensor,  # [R]
    query_lens: torch.Tensor,  # [R]
    scale: float,
    causal: bool,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Masked softmax attention of padded queries over padded keys -> `[R, Q, H, Dv]`.

    Query j of request r sits at position `key_lens[r] - query_lens[r] + j` (its new tokens are
    the last of its keys). A query sees keys less than `sliding_window` positions away (before
    it when causal, on either side when not). Rows with no visible key come out as zeros.
    """
    num_reqs, max_q, num_heads, _ = query.shape
    num_kv_heads = keys.shape[2]
    acc = torch.promote_types(query.dtype, torch.float32)
    q = query.to(acc).view(num_reqs, max_q, num_kv_heads, num_heads // num_kv_heads, -1)
    scores = torch.einsum("rqhgd,rkhd->rhgqk", q, keys.to(acc)) * scale

    key_pos = torch.arange(keys.shape[1], device=keys.device)
    in_sequence = key_pos < key_lens[:, None]  # [R, K]
    # Rows past a sequence's end hold stale bytes (a freed block, padding block 0): a NaN there
    # would survive its zero weight (0 * NaN), so they are zeroed before the product.
    values = values.masked_fill(~in_sequence[:, :, None, None], 0)
    visible = in_sequence[:, None, :]  # [R, 1, K]
    query_pos = (key_lens - query_lens)[:, None] + torch.arange(max_q, device=keys.device)
    distance = query_pos[:, :, None] - key_pos  # [R, Q, K]
    if causal:
        visible = visible & (distance >= 0)
    if sliding_window is not None:
        visible = visible & (distance.abs() < sliding_window)
    visible = visible[:, None, None]  # [R, 1, 1, Q, K]

    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).clamp(min=torch.finfo(acc).min)
    weights = torch.exp(scores - row_max)
    weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(acc).tiny)
    output = torch.einsum("rhgqk,rkhd->rqhgd", weights, values.to(acc))
    return output.reshape(num_reqs, max_q, num_heads, -1)


class TorchNativeBackend(AttentionBackend):
    """The portable reference backend (see the module docstring)."""

    name = "torch_native"
    device_types = None  # plain torch: any device
    # Mixed batches would need metadata padded to max_num_seqs x max_num_tokens queries to keep
    # shapes fixed, which costs more than running attention outside the graph. A uniform batch
    # of q tokens a request fits the padded [num_reqs, q] layout exactly, with max_query_len
    # frozen at q (padded requests own q padding tokens and no key: they read nothing).
    graph_support = GraphSupport.UNIFORM_BATCH
    plan_class = TokenLayoutPlan

    def forward(self, query, key, value, kv_cache, out, metadata, scale, sliding_window,
                write_kv=True):
        key_cache, value_cache = kv_cache
        if write_kv:
            write_to_cache(key_cache, metadata.slot_mapping, key)
            write_to_cache(value_cache, metadata.slot_mapping, value)
        plan = self.step_plan(metadata)
        layout = plan.layout(query.shape[0], query.device)
        result = attend(layout.pad(query), plan.gather(key_cache), plan.gather(value_cache),
                        plan.key_lens, layout.query_lens, scale, causal=True,
                        sliding_window=sliding_window)
        out.copy_(layout.unpad(result))

    def forward_mla(self, q_latent, q_pe, kv_c, k_pe, kv_cache, out, metadata, scale,
                    write_kv=True):
        kv_c_cache, k_pe_cache = kv_cache
        if write_kv:
            write_to_cache(kv_c_cache, metadata.slot_mapping, kv_c)
            write_to_cache(k_pe_cache, metadata.slot_mapping, k_pe)
        plan = self.step_plan(metadata)
        layout = plan.layout(q_latent.shape[0], q_latent.device)
        latent = plan.gather(kv_c_cache)  # [R, K, L]
        keys = torch.cat([latent, plan.gather(k_pe_cache).to(latent.dtype)], -1)
        query = torch.cat([q_latent, q_pe.to(q_latent.dtype)], dim=-1)
        result = attend(layout.pad(query), keys[:, :, None], latent[:, :, None], plan.key_lens,
                        layout.query_lens, scale, causal=True)
        out.copy_(layout.unpad(result))

    def forward_encoder(self, query, key, value, out, metadata, scale, sliding_window=None):
        layout = self.step_plan(metadata).layout(query.shape[0], query.device)
        result = attend(layout.pad(query), layout.pad(key), layout.pad(value), layout.query_lens,
                        layout.query_lens, scale, causal=False, sliding_window=sliding_window)
        out.copy_(layout.unpad(result))
