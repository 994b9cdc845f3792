"""A DeepSeek-V2-style decoder with multi-head latent attention (MLA) over kvgraph's paged cache.

Dense only: every layer has a SwiGLU MLP (no mixture of experts). Parameter names are those of
Hugging Face's DeepSeek-V2 where they apply; as in vLLM, the MLP's gate/up and, with a low-rank
query, `q_a_proj` and `kv_a_proj_with_mqa` (`fused_qkv_a_proj`) each run as one matmul, and a HF
state dict loads each of them into its rows of the merged weight. Attention uses the
weight-absorbed form: the cache holds only the normalized latent `kv_c` and the rotated `k_pe`,
the key up-projection is folded into the query and the value up-projection is applied to the
latent output.

RoPE here is the plain "rotate half" (GPT-NeoX) form. DeepSeek's YaRN scaling is not
implemented (a `rope_scaling` is refused), nor is its interleaved rotary layout (pairs `2j, 2j+1`
rather than `j, j + rope_dim/2`): a HF DeepSeek-V2 state dict loads by name, and reproduces HF's
outputs only once the rope rows of `q_proj`/`q_b_proj` and `kv_a_proj_with_mqa` are permuted
from the interleaved to the rotate-half order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

import kvgraph
from kvgraph.cpu.linear_packing import LinearPacking

from .causal_lm import CausalLM, DecoderConfig
from .layers import MergedLinear, RMSNorm, RotaryEmbedding

PRESETS: dict[str, dict[str, Any]] = {
    # Fast enough for unit tests; a low-rank query path like DeepSeek-V2's.
    "tiny": {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False,
    },
    # Shaped like DeepSeek-V2-Lite (full-rank query), scaled down for a CPU demo.
    "small": {
        "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1408, "num_hidden_layers": 8,
        "num_attention_heads": 8, "q_lora_rank": None, "kv_lora_rank": 128,
        "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True, kw_only=True)
class DeepseekMLAConfig(DecoderConfig):
    """A HF DeepSeek-V2 `config.json`, dense layers only; `q_lora_rank` None: full-rank query."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    supported_only = {**DecoderConfig.supported_only, "attention_bias": False}

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DeepseekMLAConfig:
        """As `DecoderConfig.from_hf`; a config with mixture-of-experts layers is refused."""
        # HF makes layer i MoE when experts exist and i >= first_k_dense_replace.
        first_moe_layer = config.get("first_k_dense_replace") or 0
        if config.get("n_routed_experts") and first_moe_layer < config.get("num_hidden_layers", 0):
            raise NotImplementedError(
                f"{cls.__name__}: mixture-of-experts layers (n_routed_experts="
                f"{config['n_routed_experts']}, first_k_dense_replace={first_moe_layer}) are not "
                f"implemented; only dense layers are"
            )
        return super().from_hf(config)


class DeepseekMLAAttention(nn.Module):
    """MLA self-attention: low-rank projections and RoPE here, the paged latent part in kvgraph."""

    def __init__(self, config: DeepseekMLAConfig, prefix: str):
        super().__init__()
        hidden, heads, rank = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
        self.rank = rank
        self.nope_dim, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_dim, self.q_lora_rank = config.v_head_dim, config.q_lora_rank
        q_dim = heads * (self.nope_dim + self.rope_dim)
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, q_dim, bias=False)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, rank + self.rope_dim, bias=False)
        else:
            # Both read the hidden state and neither is cut by tensor parallelism: one matmul.
            self.fused_qkv_a_proj = MergedLinear(hidden, {
                "q_a_proj": config.q_lora_rank, "kv_a_proj_with_mqa": rank + self.rope_dim,
            }, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, q_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(rank, heads * (self.nope_dim + self.v_dim), bias=False)
        # Read as W_UK/W_UV matrices, not as a linear: never packed or swapped.
        self.kv_b_proj.linear_packing = LinearPacking.PLAIN
        self.o_proj = nn.Linear(heads * self.v_dim, hidden, bias=False)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, config.rope_theta)
        scale = (self.nope_dim + self.rope_dim) ** -0.5
        self.attn = kvgraph.MLAAttention(heads, rank, self.rope_dim, scale, f"{prefix}.attn")

    @property
    def heads(self) -> int:
        """The query heads this module computes: its kvgraph layer's (local when sharded)."""
        return self.attn.num_heads

    def _query_and_latent(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query `[T, heads * (nope + rope)]` and `kv_a_proj_with_mqa`'s output, unnormalized
        latent and `k_pe` `[T, rank + rope]`."""
        if self.q_lora_rank is None:
            return self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        q_a, kv_a = self.fused_qkv_a_proj(hidden).split(
            [self.q_lora_rank, self.rank + self.rope_dim], -1)
        return self.q_b_proj(self.q_a_layernorm(q_a)), kv_a

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`kv_b_proj` split into W_UK `[H, nope, rank]` and W_UV `[H, v, rank]`."""
        weight = self.kv_b_proj.weight.view(self.heads, self.nope_dim + self.v_dim, self.rank)
        return weight.split([self.nope_dim, self.v_dim], dim=1)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        query, kv_a = self._query_and_latent(hidden)
        q_nope, q_pe = query.view(num_tokens, self.heads, -1).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        kv_c, k_pe = kv_a.split([self.rank, self.rope_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        # k_pe is one head shared by all query heads (MQA-style), so it rotates as [T, 1, R].
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe[:, None, :])
        w_uk, w_uv = self._up_projections()
        # q_nope·(W_UK c) == (W_UKᵀ q_nope)·c: attention never materializes per-head keys.
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        latent_out = self.attn(q_latent, q_pe, kv_c, k_pe[:, 0])
        out = torch.einsum("thl,hvl->thv", latent_out, w_uv)
        return self.o_proj(out.flatten(1))


class DeepseekMLA(CausalLM):
    """The DeepSeek-V2-style dense causal LM with MLA attention.

    Build it with `DeepseekMLA.from_hf(config, state_dict)` or `DeepseekMLA.from_preset("tiny")`.
    """

    config_class = DeepseekMLAConfig
    attention_class = DeepseekMLAAttention
    presets = PRESETS
