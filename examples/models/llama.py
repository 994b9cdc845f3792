"""A Llama-style decoder (GQA, RoPE, RMSNorm, SwiGLU) whose attention reads kvgraph's paged cache.

Plain PyTorch: the model knows nothing of compilation. Its module tree is Hugging Face's
`LlamaForCausalLM`'s except that q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`) each run as one
matmul; a HF Llama state dict loads as it is (each HF tensor into its rows of the merged weight),
and so do Mistral's (a `sliding_window` gives every layer that window) and Qwen2's (biased q/k/v).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import kvgraph

from .causal_lm import CausalLM, DecoderConfig
from .layers import MergedLinear, RotaryEmbedding
from .rope import ROPE_TYPES

PRESETS: dict[str, dict[str, Any]] = {
    # Fast enough for unit tests.
    "tiny": {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    # Big enough that a step costs something, small enough for a CPU demo.
    "small": {
        "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
        "num_attention_heads": 8, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    },
    # A 1B-class Llama shape (random weights): what GPU benchmarks measure.
    "1b": {
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    # The same size with head size 128, which Ascend's fused attention runs (1b's is 64).
    "1b-hd128": {
        "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
}

# HF model types whose config.json this config reads, with what each implies beyond its keys.
MODEL_TYPES: dict[str, dict[str, Any]] = {
    "llama": {}, "mistral": {}, "qwen2": {"qkv_bias": True},
}


def _qwen2_window(config: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2's config without the `sliding_window` it keeps while `use_sliding_window` is off."""
    if config.get("use_sliding_window"):
        # Qwen2 windows only the layers from max_window_layers on; one window for all is not it.
        raise NotImplementedError(
            "LlamaConfig: Qwen2 use_sliding_window=True (a window on some layers only) is not "
            "implemented; only use_sliding_window=False")
    return {**config, "sliding_window": None}


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """A HF Llama, Mistral or Qwen2 `config.json`, validated.

    `num_key_value_heads` defaults to the head count, `head_dim` to `hidden_size //
    num_attention_heads`; `attention_bias` gives all four attention projections a bias,
    `qkv_bias` (Qwen2's) only the query, key and value projections.
    """

    num_key_value_heads: int | None = None
    head_dim: int | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None

    rope_types = ROPE_TYPES

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> LlamaConfig:
        """As `DecoderConfig.from_hf`, for HF's llama, mistral and qwen2 `model_type`s."""
        model_type = config.get("model_type") or "llama"
        if model_type not in MODEL_TYPES:
            raise NotImplementedError(
                f"LlamaConfig: model_type={model_type!r} is not implemented; supported: "
                f"{sorted(MODEL_TYPES)}")
        if model_type == "qwen2":
            config = _qwen2_window(config)
        return super().from_hf({**config, **MODEL_TYPES[model_type]})

    def __post_init__(self) -> None:
        super().__post_init__()
        # Frozen: the derived defaults are filled in the one place the config is built.
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not a multiple of num_attention_heads "
                    f"({self.num_attention_heads}); give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )


class LlamaAttention(nn.Module):
    """Grouped-query self-attention: projections and RoPE here, the paged part in kvgraph."""

    def __init__(self, config: LlamaConfig, prefix: str):
        super().__init__()
        heads, kv_heads, head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim
        )
        qkv_bias = config.attention_bias or config.qkv_bias
        self.head_dim = head_dim
        self.qkv_proj = MergedLinear(config.hidden_size, {
            "q_proj": heads * head_dim, "k_proj": kv_heads * head_dim,
            "v_proj": kv_heads * head_dim,
        }, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=config.attention_bias)
        self.rotary_emb = RotaryEmbedding(head_dim, config.rope)
        self.attn = kvgraph.Attention(
            heads, head_dim, head_dim**-0.5, kv_heads, f"{prefix}.attn",
            sliding_window=config.sliding_window,
        )

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        # Sizes from the attention layer's (local) head counts, not from qkv_proj: a module
        # swapped in for it (packed weights) need not know its parts.
        q_size = self.attn.num_heads * self.head_dim
        kv_size = self.attn.num_kv_heads * self.head_dim
        query, key, value = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], -1)
        query = query.view(num_tokens, -1, self.head_dim)
        key = key.view(num_tokens, -1, self.head_dim)
        query, key = self.rotary_emb(positions, query, key)
        out = self.attn(query.flatten(1), key.flatten(1), value)
        return self.o_proj(out)


class Llama(CausalLM):
    """The Llama-style causal LM.

    Build it with `Llama.from_hf(config, state_dict)` or `Llama.from_preset("tiny")`.
    """

    config_class = LlamaConfig
    attention_class = LlamaAttention
    presets = PRESETS
