"""A plain Llama over a dense static KV cache: the `torch.compile(mode="reduce-overhead")` baseline.

What a user gets without kvgraph (gpt-fast's recipe): each layer owns a cache buffer
`[batch, kv_heads, max_len, head_dim]`, written with `index_copy_` at the step's positions, and
SDPA reads every cache row under a causal mask. One buffer per layer, not slices of one
`[layers, ...]` tensor: inductor copied a whole 5-D cache every step to write one slice of it.
Module tree and parameter names are the example Llama's (HF's, with q/k/v and gate/up each one
matmul, as gpt-fast and vLLM run them), so `load_state_dict(llama.state_dict())` gives the same
weights.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from examples.models.layers import MLP, MergedLinear, RMSNorm, RotaryEmbedding
from examples.models.llama import LlamaConfig


class StaticAttention(nn.Module):
    """Grouped-query attention over a static cache of its own (no bias, no sliding window)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        heads, kv_heads, head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                     config.head_dim)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {
            "q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
            "v_proj": kv_heads * head_dim,
        }, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(head_dim, config.rope)
        # Buffers, not parameters: torch.compile treats them as static inputs mutated in place.
        self.register_buffer("key_cache", None, persistent=False)
        self.register_buffer("value_cache", None, persistent=False)

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Zeroed caches `[batch, kv_heads, max_len, head_dim]`: the same tensors, zeroed, when
        the shape is unchanged (CUDA graphs recorded their addresses), else new ones."""
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        if self.key_cache is not None and self.key_cache.shape == shape:
            self.key_cache.zero_()
            self.value_cache.zero_()
            return
        self.key_cache = self.value_cache = None  # the old ones go before the new ones come
        weight = self.o_proj.weight
        self.key_cache, self.value_cache = weight.new_zeros(shape), weight.new_zeros(shape)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """`hidden [B, T, hidden]` at `positions [T]`; `mask [T, max_len]` (True: attend)."""
        batch, tokens, _ = hidden.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        query, key, value = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], -1)
        query = query.view(batch * tokens, self.heads, self.head_dim)
        key = key.view(batch * tokens, self.kv_heads, self.head_dim)
        query, key = self.rotary_emb(positions.repeat(batch), query, key)
        value = value.view(batch, tokens, self.kv_heads, self.head_dim)
        key = key.view(batch, tokens, self.kv_heads, self.head_dim)
        self.key_cache.index_copy_(2, positions, key.transpose(1, 2))
        self.value_cache.index_copy_(2, positions, value.transpose(1, 2))
        out = F.scaled_dot_product_attention(
            query.view(batch, tokens, self.heads, self.head_dim).transpose(1, 2),
            self.key_cache, self.value_cache, attn_mask=mask, enable_gqa=True,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))


class StaticLayer(nn.Module):
    """One pre-norm decoder block (HF names), attention reading the static cache."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = StaticAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, hidden, positions, mask):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class StaticDecoder(nn.Module):
    """The `model.` part: embeddings, layers, final norm."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(StaticLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class StaticLlama(nn.Module):
    """A Llama for batched greedy decoding over a static cache; `setup_cache` before use.

    Every request of the batch sits at the same positions (equal-length prompts), so one
    `positions [T]` tensor serves the whole batch.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.model = StaticDecoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_len = 0

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Give every layer a zeroed cache for `batch` sequences of up to `max_len` tokens."""
        self.max_len = max_len
        for layer in self.model.layers:
            layer.self_attn.setup_cache(batch, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """`input_ids [B, T]` at `positions [T]` -> the last token's logits `[B, vocab]`."""
        key_pos = torch.arange(self.max_len, device=positions.device)
        mask = key_pos[None, :] <= positions[:, None]  # [T, max_len]: causal, cache rows
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(hidden, positions, mask)
        return self.lm_head(self.model.norm(hidden[:, -1]))

    @classmethod
    def like(cls, llama: nn.Module) -> StaticLlama:
        """A StaticLlama with `llama`'s config, weights, device and dtype."""
        weight = llama.lm_head.weight
        with torch.device("meta"):
            model = cls(llama.config)
        model = model.to(weight.dtype).to_empty(device=weight.device)
        model.load_state_dict(llama.state_dict())
        return model.eval().requires_grad_(False)
