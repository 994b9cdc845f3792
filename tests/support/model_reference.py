"""The example models' reference attention: dense causal attention over one whole sequence, no
cache, in float64; and the logits of a fixed prompt to compare models under it.

`dense_attention` and `dense_mla_attention` stand in for kvgraph's attention layers' `forward`
(the `no_cache` fixture of tests/examples/models/conftest.py puts them in); `prompt_logits`
runs a model on a fixed prompt; TOLERANCE is how close two models' logits must be.
"""

from __future__ import annotations

import torch

TOLERANCE = dict(atol=1e-4, rtol=1e-4)


def causal_softmax(scores: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """Softmax over keys of `[..., q, k]` scores, each query seeing itself and earlier keys."""
    pos = torch.arange(scores.shape[-1])
    visible = pos[None, :] <= pos[:, None]
    if sliding_window is not None:
        visible &= pos[None, :] > pos[:, None] - sliding_window
    return scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)


def dense_attention(self, query, key, value):
    """Stands in for `kvgraph.Attention.forward`: GQA by repeating each kv head per group."""
    num_tokens, group = query.shape[0], self.num_heads // self.num_kv_heads
    q = query.view(num_tokens, self.num_heads, self.head_size).double()
    k = key.view(num_tokens, self.num_kv_heads, self.head_size).double()
    v = value.view(num_tokens, self.num_kv_heads, self.head_size).double()
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * self.scale
    out = torch.einsum("hqk,khd->qhd", causal_softmax(scores, self.sliding_window), v)
    return out.to(query.dtype).reshape(num_tokens, -1)


def dense_mla_attention(self, q_latent, q_pe, kv_c, k_pe):
    """Stands in for `kvgraph.MLAAttention.forward`: latent scores plus rope scores."""
    q_latent, q_pe, kv_c, k_pe = (x.double() for x in (q_latent, q_pe, kv_c, k_pe))
    scores = torch.einsum("qhl,kl->hqk", q_latent, kv_c) + torch.einsum("qhr,kr->hqk", q_pe, k_pe)
    out = torch.einsum("hqk,kl->qhl", causal_softmax(scores * self.scale), kv_c)
    return out.float()


def prompt_logits(model) -> torch.Tensor:
    """All logits of a fixed prompt (call under the `no_cache` reference attention)."""
    hidden = model(torch.arange(11) * 7 % model.config.vocab_size, torch.arange(11))
    return model.compute_logits(hidden)
