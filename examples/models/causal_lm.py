"""The decoder-only skeleton both example models share: HF module tree, config, weights.

A model subclasses `CausalLM` and supplies its config class, its attention module and its
presets; everything else (HF's module tree, its merged linears aside; building from a
`config.json` dict; loading or exporting a HF-named state dict, or seeding random weights)
lives here once.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, ClassVar, Mapping

import torch
from torch import nn

from kvgraph.distributed import TensorParallelGroup

from .hf_layout import hf_tensors, merged_names
from .layers import MLP, RMSNorm
from .rope import DEFAULT_MAX_POSITION_EMBEDDINGS, RopeParameters, RotaryEmbedding
from .tensor_parallel import shard_model

# Standard deviation of seeded random weights: small enough that activations stay sane.
INIT_STD = 0.02
# State-dict keys some HF checkpoints carry that hold no weights (recomputed from the config).
IGNORED_KEY_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """What every example decoder reads from a HF `config.json`; subclasses add attention fields.

    Build it with `from_hf`: keys these models do not use are ignored, a JSON `null` means the
    default, and every number must be positive. `rope` is read from either HF form (see
    `RopeParameters.from_hf`); a RoPE type outside `rope_types` is refused.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    rms_norm_eps: float = 1e-6
    rope: RopeParameters = field(default_factory=RopeParameters)
    max_position_embeddings: int = DEFAULT_MAX_POSITION_EMBEDDINGS
    tie_word_embeddings: bool = False

    # HF keys whose other values these examples do not implement, with the one value they do.
    supported_only: ClassVar[Mapping[str, Any]] = {"hidden_act": "silu", "mlp_bias": False}
    # The RoPE types (HF `rope_type`) the model implements.
    rope_types: ClassVar[tuple[str, ...]] = ("default",)

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> DecoderConfig:
        """The config of a HF `config.json` dict; a clear error for missing or unsupported keys."""
        for key, supported in cls.supported_only.items():
            value = config.get(key)
            if value is not None and value != supported:
                raise NotImplementedError(
                    f"{cls.__name__}: {key}={value!r} is not implemented by this example model; "
                    f"only {supported!r} is supported"
                )
        rope = RopeParameters.from_hf(config, cls.rope_types, cls.__name__)
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in config.items() if k in known and v is not None}
        values["rope"] = rope
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
        if missing:
            raise ValueError(
                f"{cls.__name__}: the config lacks required key(s) {missing}; "
                f"it has {sorted(config)}"
            )
        return cls(**values)

    @property
    def rope_theta(self) -> float:
        """The RoPE base, wherever the HF config kept it."""
        return self.rope.theta

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value <= 0:
                raise ValueError(f"{type(self).__name__}.{f.name} must be > 0, got {value}")


class DecoderLayer(nn.Module):
    """One pre-norm transformer block: attention, then the MLP, each inside a residual."""

    def __init__(self, config: DecoderConfig, self_attn: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderModel(nn.Module):
    """The `model.` part of a HF causal LM: token embeddings, decoder layers, final norm.

    `make_attention(config, prefix)` builds each layer's `self_attn`; `prefix` is its module
    path (`model.layers.3.self_attn`), from which kvgraph layer names are made. Each layer
    gets the positions, or, where every `self_attn.rotary_emb` rotates alike, the step's
    `RopeAngles` (computed once here), which a `RotaryEmbedding` takes in their place.
    """

    def __init__(self, config: DecoderConfig,
                 make_attention: Callable[[DecoderConfig, str], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, make_attention(config, f"model.layers.{i}.self_attn"))
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.share_rope_angles = True  # False: each layer computes its own (tests compare)

    def shared_rotary(self) -> RotaryEmbedding | None:
        """The `RotaryEmbedding` every layer's `self_attn` has, if they all rotate alike (asked
        on each call: a layer may have been wrapped or swapped since construction)."""
        rotaries = [getattr(getattr(layer, "self_attn", None), "rotary_emb", None)
                    for layer in self.layers]
        first = rotaries[0] if rotaries else None
        if self.share_rope_angles and isinstance(first, RotaryEmbedding) and all(
                isinstance(r, RotaryEmbedding) and r.rotates_like(first) for r in rotaries):
            return first
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        rotary = self.shared_rotary()
        rotation = positions if rotary is None else rotary.cos_sin(positions)
        for layer in self.layers:
            hidden = layer(rotation, hidden)
        return self.norm(hidden)


class CausalLM(nn.Module):
    """Base of the example models: `forward(input_ids [T], positions [T]) -> hidden [T, hidden]`.

    Subclasses set `config_class`, `attention_class` (called as `attention_class(config,
    prefix)`) and `presets` (name -> HF config dict). The module tree mirrors HF's
    `*ForCausalLM` but for merged linears (`qkv_proj`, `gate_up_proj`, ...), so `state_dict()`
    has module-tree names; `load_hf_state_dict` and `hf_state_dict` speak HF's names.
    """

    config_class: ClassVar[type[DecoderConfig]]
    attention_class: ClassVar[Callable[[DecoderConfig, str], nn.Module]]
    presets: ClassVar[Mapping[str, Mapping[str, Any]]]

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, type(self).attention_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make `lm_head` share the embedding matrix when the config asks for it."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[N, hidden]` -> `[N, vocab_size]` logits."""
        return self.lm_head(hidden)

    @classmethod
    def from_preset(cls, name: str, **kwargs: Any) -> CausalLM:
        """The model of preset `name`; `kwargs` go to `from_hf` (dtype, device, seed, tp, ...)."""
        if name not in cls.presets:
            raise ValueError(
                f"unknown {cls.__name__} preset {name!r}; available: {sorted(cls.presets)}"
            )
        return cls.from_hf(dict(cls.presets[name]), **kwargs)

    @classmethod
    def first_layers(cls, config: Mapping[str, Any], num_layers: int, *, seed: int = 0,
                     **kwargs: Any) -> CausalLM:
        """A layer-skip draft: the seeded model of HF config `config` cut to its first
        `num_layers` decoder layers, with its embedding, final norm and head (an early exit,
        as self-speculative decoding drafts); `kwargs` go to `from_hf` (dtype, device)."""
        layers = config["num_hidden_layers"]
        if not 1 <= num_layers <= layers:
            raise ValueError(f"num_layers: expected 1 to the model's {layers} layers, got "
                             f"{num_layers}")
        full = cls.from_hf(config, seed=seed).hf_state_dict()  # on the CPU, in float32
        kept = {name: tensor for name, tensor in full.items()
                if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
        return cls.from_hf({**config, "num_hidden_layers": num_layers}, kept, **kwargs)

    @classmethod
    def from_hf(
        cls,
        config: Mapping[str, Any],
        state_dict: Mapping[str, torch.Tensor] | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        tp: TensorParallelGroup | None = None,
    ) -> CausalLM:
        """The model of a HF config dict, with `state_dict`'s weights or seeded random ones.

        `tp`: this rank's shard of the model (see tensor_parallel.py), its weights cut from the
        full ones (`state_dict` or the same seeded ones), so every rank loads the same
        `state_dict`. None (or size 1): the whole model.
        """
        # Built on the meta device so no memory is filled twice and no global RNG is consumed.
        with torch.device("meta"):
            model = cls(cls.config_class.from_hf(config))
        if tp is not None:
            shard_model(model, tp)
        model = model.to(dtype).to_empty(device=device)
        model.tie_weights()  # moving off the meta device makes new parameters: tie them again
        if state_dict is None:
            model.init_random(seed)
        else:
            model.load_hf_state_dict(state_dict)
        # Inference weights: no autograd graph is recorded even outside torch.no_grad().
        return model.eval().requires_grad_(False)

    @torch.no_grad()
    def init_random(self, seed: int) -> None:
        """Seeded weights, identical on every device and dtype: N(0, INIT_STD), norm scales 1.

        One draw per HF tensor, in the model's parameter order, a merged linear's parts in
        turn: where HF's module tree has those parts side by side (Llama's q/k/v and gate/up),
        the weights are those of an unmerged model. A sharded model gets its part of the
        unsharded model's weights: each full tensor is drawn (so the generator advances as it
        does unsharded) and cut.
        """
        generator = torch.Generator().manual_seed(seed)
        for name, tensor in hf_tensors(self, remove_duplicate=True).items():
            if name.endswith("norm.weight"):  # every RMSNorm scale's HF name ends so
                tensor.target.fill_(1.0)
            elif name.endswith(".bias"):
                tensor.target.zero_()
            else:
                full = torch.randn(tensor.full_shape, generator=generator) * INIT_STD
                tensor.target.copy_(tensor.local_part(name, full))

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load HF-named weights; a ValueError naming every missing or unexpected key, or a
        tensor of the wrong shape.

        The tensors are the full (unsharded) ones: a sharded model takes its part of each, and
        a merged linear's parts (HF's `q_proj`, `k_proj`, ...) each fill their rows of it.
        """
        given = {k: v for k, v in state_dict.items() if not k.endswith(IGNORED_KEY_SUFFIXES)}
        tensors = hf_tensors(self)
        expected = set(tensors)
        if self.config.tie_word_embeddings:
            # HF ties after loading, so the embedding wins over a stored lm_head copy.
            given.pop("lm_head.weight", None)
            expected.discard("lm_head.weight")
        missing, unexpected = sorted(expected - given.keys()), sorted(given.keys() - expected)
        if missing or unexpected:
            merged = sorted(set(unexpected) & set(merged_names(self)))
            hint = (f"; {merged} are this model's merged parameters, not HF names: pass "
                    f"hf_state_dict(), not state_dict()" if merged else "")
            raise ValueError(
                f"{type(self).__name__}: the state dict does not match the model: "
                f"missing keys {missing}, unexpected keys {unexpected}{hint}"
            )
        # Every shape is checked before anything is copied, so a refused state dict changes
        # nothing.
        parts = {name: tensors[name].local_part(name, full) for name, full in given.items()}
        for name, part in parts.items():
            tensors[name].target.copy_(part)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under HF's names (a merged linear's parts apart), as `load_hf_state_dict`
        and HF checkpoints have them; this rank's parts when sharded. Each a copy: a merged
        linear's parts would otherwise share storage, which safetensors refuses to save."""
        return {name: tensor.target.detach().clone()
                for name, tensor in hf_tensors(self).items()}
