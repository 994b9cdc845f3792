"""The example models' merged projections (q/k/v, gate/up, MLA's q_a/kv_a): HF checkpoints load
into them unchanged and give the logits of separate linears; export and seeding keep HF's names
and values."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from examples.models.deepseek_mla import DeepseekMLA
from examples.models.layers import MergedLinear
from examples.models.llama import Llama
from tests.support.model_reference import TOLERANCE, prompt_logits

LLAMA = Llama.presets["tiny"]
MLA = DeepseekMLA.presets["tiny"]
CASES = {
    "llama-biases": (Llama, {**LLAMA, "attention_bias": True}),
    "llama-tied": (Llama, {**LLAMA, "tie_word_embeddings": True, "qkv_bias": True}),
    "mla-low-rank-q": (DeepseekMLA, MLA),
    "mla-full-rank-q": (DeepseekMLA, {**MLA, "q_lora_rank": None}),
}


def random_hf_state_dict(model_class, config: dict) -> dict[str, torch.Tensor]:
    """HF-named weights, every tensor (biases and norm scales too) random; tied as configured."""
    generator = torch.Generator().manual_seed(11)
    state_dict = {name: torch.randn(t.shape, generator=generator) * 0.1
                  for name, t in model_class.from_hf(config).hf_state_dict().items()}
    if config.get("tie_word_embeddings"):
        state_dict["lm_head.weight"] = state_dict["model.embed_tokens.weight"]
    return state_dict


class SeparateLinears(nn.Module):
    """Stands in for a `MergedLinear`: one matmul per HF tensor, outputs concatenated. It knows
    nothing of its parts' sizes, like any module swapped in for a merged linear (packed
    weights): the model splits the output by its own head counts."""

    def __init__(self, merged: MergedLinear, prefix: str, state_dict: dict):
        super().__init__()
        self.weights = [state_dict[f"{prefix}.{part.name}.weight"] for part in merged.parts]
        self.biases = [state_dict.get(f"{prefix}.{part.name}.bias") for part in merged.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(x, w, b) for w, b in zip(self.weights, self.biases)], -1)


def unmerged(model: nn.Module, state_dict: dict) -> nn.Module:
    """`model` with each merged linear replaced by separate matmuls over `state_dict`'s HF
    tensors (the model's own rows of them are not read)."""
    for path, module in list(model.named_modules()):
        if isinstance(module, MergedLinear):
            parent, _, leaf = path.rpartition(".")
            setattr(model.get_submodule(parent), leaf, SeparateLinears(module, parent, state_dict))
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_merged_model_gives_the_logits_of_separate_linears(case, no_cache):
    no_cache()
    model_class, config = CASES[case]
    state_dict = random_hf_state_dict(model_class, config)
    merged = model_class.from_hf(config, state_dict)
    assert any(isinstance(m, MergedLinear) for m in merged.modules())
    reference = unmerged(model_class.from_hf(config, state_dict), state_dict)
    torch.testing.assert_close(prompt_logits(merged), prompt_logits(reference), **TOLERANCE)


def test_what_is_merged():
    llama = Llama.from_preset("tiny").model.layers[0]
    assert [p.name for p in llama.self_attn.qkv_proj.parts] == ["q_proj", "k_proj", "v_proj"]
    assert [p.size for p in llama.self_attn.qkv_proj.parts] == [64, 32, 32]
    assert [p.name for p in llama.mlp.gate_up_proj.parts] == ["gate_proj", "up_proj"]
    low_rank = DeepseekMLA.from_preset("tiny").model.layers[0].self_attn
    assert [p.name for p in low_rank.fused_qkv_a_proj.parts] == ["q_a_proj", "kv_a_proj_with_mqa"]
    # A full-rank query is cut by heads under tensor parallelism, the latent not: vLLM keeps
    # them apart, and so do these models.
    full_rank = DeepseekMLA.from_hf({**MLA, "q_lora_rank": None}).model.layers[0].self_attn
    assert not any(isinstance(m, MergedLinear) for m in full_rank.modules())


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_state_dict_round_trips(case):
    model_class, config = CASES[case]
    state_dict = random_hf_state_dict(model_class, config)
    exported = model_class.from_hf(config, state_dict).hf_state_dict()
    assert exported.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert torch.equal(exported[name], tensor), name
    # Copies, not views of the merged weight: safetensors refuses tensors sharing storage.
    pointers = [t.untyped_storage().data_ptr() for t in exported.values()]
    assert len(set(pointers)) == len(pointers)


def test_seeded_llama_weights_are_drawn_per_hf_tensor_in_module_order():
    """The merged model draws what the unmerged one did: one tensor per HF name, in turn."""
    model = Llama.from_preset("tiny", seed=4)
    generator = torch.Generator().manual_seed(4)
    order = ["model.embed_tokens.weight"]
    for i in range(LLAMA["num_hidden_layers"]):
        order += [f"model.layers.{i}.{name}.weight" for name in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    order.append("lm_head.weight")
    exported = model.hf_state_dict()
    for name in order:
        drawn = torch.randn(exported[name].shape, generator=generator) * 0.02
        assert torch.equal(exported[name], drawn), name


def test_a_module_tree_state_dict_is_refused_with_a_hint():
    model = Llama.from_preset("tiny")
    with pytest.raises(ValueError, match=r"missing keys \[.*self_attn\.k_proj\.weight.*"
                                         r"'model\.layers\.0\.self_attn\.qkv_proj\.weight'.* "
                                         r"are this model's merged parameters.*hf_state_dict"):
        Llama.from_hf(LLAMA, model.state_dict())


@pytest.mark.parametrize("name, shape", [
    ("model.layers.1.self_attn.v_proj.weight", (32, 64)),
    ("model.layers.0.mlp.up_proj.weight", (128, 64)),
])
def test_a_part_of_the_wrong_shape_is_refused_before_anything_loads(name, shape):
    state_dict = Llama.from_preset("tiny", seed=2).hf_state_dict()
    state_dict[name] = torch.zeros(shape[0] + 16, shape[1])
    model = Llama.from_preset("tiny")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"{name}: expected the shape \({shape[0]}, "
                                         rf"{shape[1]}\), got \({shape[0] + 16}, {shape[1]}\)"):
        model.load_hf_state_dict(state_dict)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
