"""Rotary position embedding and its context-extension scalings, as HF `config.json`s give them.

`RopeParameters.from_hf` reads both forms Hugging Face writes: transformers 4's top-level
`rope_theta` beside a `rope_scaling` dict, and transformers 5's `rope_parameters` dict holding
`rope_theta` and the scaling keys together. The frequencies follow transformers'
`modeling_rope_utils`, computed from the positions on every call, so the module holds no state
(a model computes them once per step for all its layers: `RopeAngles`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_THETA = 10000.0
# HF Llama's context when a config.json gives none.
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048
# YaRN's ramp bounds, in rotations over the original context: the paper's (and HF's) defaults.
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
# HF widens an empty YaRN ramp by this much so that it does not divide by zero.
YARN_EMPTY_RAMP_WIDTH = 0.001
# The keys each scaling type cannot do without (HF infers the others).
REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor",),
                 "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


def _rope_dict(config: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The key holding the RoPE parameters and its dict; HF lets `rope_scaling` win."""
    for key in ("rope_scaling", "rope_parameters"):
        if config.get(key):
            return key, dict(config[key])
    return "rope_parameters", {}


@dataclass(frozen=True, kw_only=True)
class RopeParameters:
    """One model's RoPE: its type, base and the keys that type reads, under HF's names.

    `max_position_embeddings` is the model's (what dynamic NTK scales from);
    `original_max_position_embeddings` the pre-training context llama3 and YaRN stretch.
    """

    rope_type: str = "default"
    theta: float = DEFAULT_THETA
    factor: float = 1.0
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    original_max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = YARN_BETA_FAST
    beta_slow: float = YARN_BETA_SLOW
    truncate: bool = True
    attention_factor: float = 1.0

    @classmethod
    def from_hf(cls, config: Mapping[str, Any], supported: tuple[str, ...] = ROPE_TYPES,
                model: str = "this example model") -> RopeParameters:
        """The RoPE of a HF config dict; NotImplementedError naming the field for a type not in
        `supported`, ValueError naming a missing key."""
        key, params = _rope_dict(config)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in supported:
            raise NotImplementedError(
                f"{model}: {key}.rope_type={rope_type!r} is not implemented; supported: "
                f"{list(supported)}")
        if any(isinstance(value, Mapping) for value in params.values()):
            raise NotImplementedError(f"{model}: {key} per layer type is not implemented")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError(
                f"{model}: {key}.partial_rotary_factor={params['partial_rotary_factor']} is not "
                f"implemented; only 1.0 (the whole head rotates)")
        missing = [name for name in REQUIRED_KEYS.get(rope_type, ()) if params.get(name) is None]
        if missing:
            raise ValueError(f"{model}: {key} of rope_type {rope_type!r} lacks {missing}; it has "
                             f"{sorted(params)}")
        return cls(rope_type=rope_type, **_values(config, params))

    def __post_init__(self) -> None:
        for name in ("theta", "factor", "max_position_embeddings",
                     "original_max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"RoPE {name} must be > 0, got {getattr(self, name)}")


def _values(config: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The `RopeParameters` fields of a HF config, with HF's defaults for the keys it lacks."""
    max_positions = config.get("max_position_embeddings") or DEFAULT_MAX_POSITION_EMBEDDINGS
    # A top-level original_max_position_embeddings (Phi-3 style) wins, as in HF.
    original = (config.get("original_max_position_embeddings")
                or params.get("original_max_position_embeddings") or max_positions)
    factor = params.get("factor") or max_positions / original
    given = {"theta": params.get("rope_theta") or config.get("rope_theta"),
             "low_freq_factor": params.get("low_freq_factor"),
             "high_freq_factor": params.get("high_freq_factor"),
             "beta_fast": params.get("beta_fast"), "beta_slow": params.get("beta_slow"),
             "truncate": params.get("truncate")}
    values = {name: value for name, value in given.items() if value is not None}
    if params.get("rope_type", params.get("type")) == "yarn":
        values["attention_factor"] = _yarn_attention_factor(params, factor)
    return {**values, "factor": float(factor), "max_position_embeddings": max_positions,
            "original_max_position_embeddings": original}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 0.1 * mscale * math.log(scale) + 1.0 if scale > 1 else 1.0


def _yarn_attention_factor(params: Mapping[str, Any], factor: float) -> float:
    """YaRN's cos/sin scale: given, or HF's mscale ratio when both mscales are given."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def _exponents(head_dim: int, device: torch.device) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, device=device).float() / head_dim


def _llama3_inv_freq(rope: RopeParameters, inv_freq: torch.Tensor) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a blend between."""
    context = rope.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = context / rope.low_freq_factor
    high_freq_wavelen = context / rope.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_correction_dim(rope: RopeParameters, rotations: float, head_dim: int) -> float:
    """The dimension that turns `rotations` times over the original context."""
    context = rope.original_max_position_embeddings
    return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))


def _yarn_inv_freq(rope: RopeParameters, inv_freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """YaRN: dimensions fast enough to rotate `beta_fast` times keep their frequency, those
    slower than `beta_slow` rotations are interpolated by `factor`, a linear ramp between."""
    low = _yarn_correction_dim(rope, rope.beta_fast, head_dim)
    high = _yarn_correction_dim(rope, rope.beta_slow, head_dim)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += YARN_EMPTY_RAMP_WIDTH
    dims = torch.arange(head_dim // 2, device=inv_freq.device).float()
    interpolated = ((dims - low) / (high - low)).clamp(0, 1)
    return inv_freq / rope.factor * interpolated + inv_freq * (1 - interpolated)


def _dynamic_inv_freq(rope: RopeParameters, head_dim: int,
                      positions: torch.Tensor) -> torch.Tensor:
    """Dynamic NTK, per token: `[T, head_dim/2]`.

    HF rescales the base for the sequence length seen so far. Here each token uses the length
    of the sequence ending at it, so a token's rotation never changes once its key is cached
    and nothing branches on tensor values (graph-safe). That equals HF for any sequence within
    `max_position_embeddings` and for HF's cached generation fed one token at a time beyond
    it; a prompt longer than that prefilled at once HF rotates with the whole prompt's length.
    """
    seq_len = (positions.float() + 1).clamp(min=rope.max_position_embeddings)
    ratio = rope.factor * seq_len / rope.max_position_embeddings - (rope.factor - 1)
    base = rope.theta * ratio ** (head_dim / (head_dim - 2))
    return 1.0 / base[:, None] ** _exponents(head_dim, positions.device)[None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RopeAngles(NamedTuple):
    """A step's rotation, `RotaryEmbedding.cos_sin(positions)`: cos and sin `[T, 1, head_dim]`.

    A model whose layers rotate alike computes it once and hands it to every layer in place of
    the positions: computed inside each layer, inductor inlines the angles into every head's
    rotation and evaluates pow, cos and sin per element (an eighth of a bf16 prefill, measured).
    """

    cos: torch.Tensor
    sin: torch.Tensor


# cos and sin are made by an op of their own, opaque to inductor: it inlines a reused pointwise
# result into each user unless the result uses one of a few "heavy" ops (exp, log, tanh, ...;
# not cos or sin), so in a graph holding every layer (graph mode `full`) it evaluated cos and
# sin per head of every layer (5% of a CPU prefill, measured); a piece boundary stored them.
_library = torch.library.Library("kvgraph_examples", "DEF")  # kept alive: owns the op
_library.define("rope_cos_sin(Tensor angles, float scale) -> (Tensor, Tensor)")


def _rope_cos_sin(angles: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`[T, head_dim/2]` angles -> cos and sin `[T, 1, head_dim]`, times `scale`."""
    doubled = torch.cat((angles, angles), dim=-1)[:, None, :]
    return doubled.cos() * scale, doubled.sin() * scale


def _rope_cos_sin_fake(angles: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (angles.shape[0], 1, 2 * angles.shape[1])
    return angles.new_empty(shape), angles.new_empty(shape)


_library.impl("rope_cos_sin", _rope_cos_sin, "CompositeExplicitAutograd")
torch.library.register_fake("kvgraph_examples::rope_cos_sin", _rope_cos_sin_fake, lib=_library)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the "rotate half" (GPT-NeoX, HF Llama) layout.

    `rope` is a model's `RopeParameters`, or just a base for unscaled RoPE. The angles are
    computed from `positions` on every call rather than kept in a buffer, so the module holds
    no state: nothing to load, and nothing to re-create after meta-device building.
    """

    def __init__(self, head_dim: int, rope: RopeParameters | float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dimension, got {head_dim}")
        if not isinstance(rope, RopeParameters):
            rope = RopeParameters(theta=rope)
        if rope.rope_type == "dynamic" and head_dim == 2:
            # The NTK base exponent is head_dim / (head_dim - 2).
            raise ValueError("dynamic NTK RoPE needs a head dimension > 2, got 2")
        self.head_dim, self.rope = head_dim, rope

    def inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """The inverse frequencies: `[head_dim/2]`, or `[T, head_dim/2]` for dynamic NTK."""
        rope, head_dim = self.rope, self.head_dim
        if rope.rope_type == "dynamic":
            return _dynamic_inv_freq(rope, head_dim, positions)
        inv_freq = 1.0 / rope.theta ** _exponents(head_dim, positions.device)
        if rope.rope_type == "linear":
            return inv_freq / rope.factor
        if rope.rope_type == "llama3":
            return _llama3_inv_freq(rope, inv_freq)
        if rope.rope_type == "yarn":
            return _yarn_inv_freq(rope, inv_freq, head_dim)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor) -> RopeAngles:
        """`[T]` positions -> cos and sin, each `[T, 1, head_dim]` in float32."""
        angles = positions.float()[:, None] * self.inv_freq(positions)
        # YaRN scales cos and sin (so attention logits by its square); 1 for every other type.
        cos, sin = torch.ops.kvgraph_examples.rope_cos_sin(angles, self.rope.attention_factor)
        return RopeAngles(cos, sin)

    def rotates_like(self, other: RotaryEmbedding) -> bool:
        """Whether `other` turns every position by the same angles."""
        return (self.head_dim, self.rope) == (other.head_dim, other.rope)

    def forward(self, positions: torch.Tensor | RopeAngles, *xs: torch.Tensor
                ) -> tuple[torch.Tensor, ...]:
        """Rotate each `[T, heads, head_dim]` tensor of `xs` by its token's position: `[T]`
        positions, or the `RopeAngles` a model computed from them once for all its layers."""
        cos, sin = positions if isinstance(positions, RopeAngles) else self.cos_sin(positions)
        return tuple(
            x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype) for x in xs
        )

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, {self.rope}"
