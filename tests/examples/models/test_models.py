"""The example models: paged generation equals a no-cache recompute; HF loading; presets."""

from dataclasses import dataclass

import re

import pytest
import torch

import kvgraph
from examples import generate
from examples.models.deepseek_mla import PRESETS as MLA_PRESETS
from examples.models.deepseek_mla import DeepseekMLA, DeepseekMLAAttention, DeepseekMLAConfig
from examples.models.llama import PRESETS as LLAMA_PRESETS
from examples.models.llama import Llama, LlamaConfig
from examples.models.rope import RotaryEmbedding
from tests.support.model_reference import TOLERANCE, causal_softmax, prompt_logits

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPT_LENS = (5, 9, 3, 7)
MAX_NEW_TOKENS = 8  # room in each block table beyond the prompt

# Each step is a batch of (request, new tokens), in batch order. Request 1's prompt is prefilled
# in two chunks, the second among decodes; request 3 arrives late, its prefill among decodes.
SCHEDULE = [
    [(0, 5), (1, 6), (2, 3)],
    [(2, 1), (1, 3), (0, 1)],
    [(0, 1), (3, 7), (1, 1), (2, 1)],
    [(3, 1), (2, 1), (1, 1), (0, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]

MODEL_CASES = {
    "llama": (Llama, LLAMA_PRESETS["tiny"]),
    "llama-sliding-window": (Llama, {**LLAMA_PRESETS["tiny"], "sliding_window": 5}),
    "mla-low-rank-q": (DeepseekMLA, MLA_PRESETS["tiny"]),
    "mla-full-rank-q": (DeepseekMLA, {**MLA_PRESETS["tiny"], "q_lora_rank": None}),
}


# --- the reference: one whole sequence, no cache, under `no_cache`'s dense float64 attention ---

def full_recompute_logits(model, token_ids) -> torch.Tensor:
    """Last-token logits of `token_ids` run as one whole sequence from position 0."""
    hidden = model(torch.tensor(token_ids), torch.arange(len(token_ids)))
    return model.compute_logits(hidden[-1:])[0]


# --- the system under test: a step-by-step run through the paged cache ---

@dataclass
class Request:
    """One request's tokens (prompt, then greedy picks), block table and cached count."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int = 0

    def chunk(self, num_new: int) -> kvgraph.RequestChunk:
        start, end = self.num_computed_tokens, self.num_computed_tokens + num_new
        assert end <= len(self.token_ids), "the schedule feeds a token that does not exist yet"
        return kvgraph.RequestChunk(self.token_ids[start:end], start, self.block_ids)

    def advance(self, num_new: int, logits: torch.Tensor) -> list[int]:
        """Count the chunk as cached; once the prompt is done, append the greedy pick."""
        self.num_computed_tokens += num_new
        seen = self.token_ids[:self.num_computed_tokens]
        if self.num_computed_tokens == len(self.token_ids):
            self.token_ids.append(int(logits.argmax()))
        return seen


def make_requests(vocab_size: int) -> list[Request]:
    """Random prompts, each with its own shuffled (non-contiguous) blocks."""
    generator = torch.Generator().manual_seed(0)
    free_blocks = torch.randperm(NUM_BLOCKS, generator=generator).tolist()
    requests = []
    for length in PROMPT_LENS:
        num_blocks = -(-(length + MAX_NEW_TOKENS) // BLOCK_SIZE)
        blocks, free_blocks = free_blocks[:num_blocks], free_blocks[num_blocks:]
        prompt = torch.randint(vocab_size, (length,), generator=generator).tolist()
        requests.append(Request(prompt, blocks))
    return requests


def paged_run(model) -> list[tuple[list[int], torch.Tensor]]:
    """Run SCHEDULE through a bound paged cache; per chunk, (tokens so far, last-token logits)."""
    specs = kvgraph.kv_cache_specs(model, BLOCK_SIZE, torch.float32)
    caches = kvgraph.allocate_kv_caches(specs, NUM_BLOCKS, "cpu")
    kvgraph.bind_kv_cache(kvgraph.attention_layers(model), caches)
    requests = make_requests(model.config.vocab_size)
    records = []
    for step in SCHEDULE:
        chunks = [requests[index].chunk(num_new) for index, num_new in step]
        metadata = kvgraph.build_attention_metadata(chunks, BLOCK_SIZE, "cpu")
        input_ids, positions = kvgraph.build_model_inputs(chunks, "cpu")
        with kvgraph.set_forward_context(metadata):
            hidden = model(input_ids, positions)
        logits = model.compute_logits(hidden[metadata.query_start_loc[1:].long() - 1])
        for (index, num_new), row in zip(step, logits):
            records.append((requests[index].advance(num_new, row), row))
    return records


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_paged_generation_matches_full_recompute(case, no_cache):
    model_class, config = MODEL_CASES[case]
    model = model_class.from_hf(config)
    records = paged_run(model)
    assert len(records) == sum(len(step) for step in SCHEDULE)
    no_cache()
    for token_ids, logits in records:
        expected = full_recompute_logits(model, token_ids)
        torch.testing.assert_close(logits, expected, **TOLERANCE,
                                   msg=lambda m: f"after {len(token_ids)} tokens: {m}")


# --- Hugging Face names, shapes and loading ---

def hf_llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The parameter names and shapes of HF's LlamaForCausalLM for `config`, written out."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    shapes = {
        "model.embed_tokens.weight": (config["vocab_size"], hidden),
        "model.norm.weight": (hidden,),
        "lm_head.weight": (config["vocab_size"], hidden),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def hf_deepseek_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The dense-layer parameter names and shapes of HF's DeepSeek-V2 for `config`."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    rank = config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    q_rank = config.get("q_lora_rank")
    shapes = {name: shape for name, shape in hf_llama_shapes(config).items()
              if "self_attn" not in name}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        if q_rank is None:
            shapes[p + "q_proj.weight"] = (heads * (nope + rope), hidden)
        else:
            shapes[p + "q_a_proj.weight"] = (q_rank, hidden)
            shapes[p + "q_a_layernorm.weight"] = (q_rank,)
            shapes[p + "q_b_proj.weight"] = (heads * (nope + rope), q_rank)
        shapes |= {
            p + "kv_a_proj_with_mqa.weight": (rank + rope, hidden),
            p + "kv_a_layernorm.weight": (rank,),
            p + "kv_b_proj.weight": (heads * (nope + v), rank),
            p + "o_proj.weight": (hidden, heads * v),
        }
    return shapes


def shapes_of(model) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in model.hf_state_dict().items()}


@pytest.mark.parametrize("tied", [False, True])
def test_llama_state_dict_has_hf_names(tied):
    config = {**LLAMA_PRESETS["tiny"], "tie_word_embeddings": tied}
    assert shapes_of(Llama.from_hf(config)) == hf_llama_shapes(config)


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_deepseek_state_dict_has_hf_names(q_lora_rank):
    config = {**MLA_PRESETS["tiny"], "q_lora_rank": q_lora_rank}
    assert shapes_of(DeepseekMLA.from_hf(config)) == hf_deepseek_shapes(config)


def test_layer_names_are_module_paths():
    for model in (Llama.from_preset("tiny"), DeepseekMLA.from_preset("tiny")):
        layers = kvgraph.attention_layers(model)
        assert list(layers) == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        assert all(dict(model.named_modules())[name] is layer for name, layer in layers.items())


@pytest.mark.parametrize("model_class", [Llama, DeepseekMLA])
def test_loading_a_state_dict_reproduces_the_model(model_class, no_cache):
    no_cache()
    source = model_class.from_preset("tiny", seed=1)
    state_dict = source.hf_state_dict()
    # Some HF checkpoints carry the rotary frequencies; they are recomputed, so ignored.
    state_dict["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    loaded = model_class.from_hf(model_class.presets["tiny"], state_dict)
    assert torch.equal(prompt_logits(loaded), prompt_logits(source))
    assert not torch.equal(prompt_logits(model_class.from_preset("tiny")), prompt_logits(source))


def test_tied_embeddings_load_without_lm_head(no_cache):
    no_cache()
    config = {**LLAMA_PRESETS["tiny"], "tie_word_embeddings": True}
    source = Llama.from_hf(config, seed=1)
    state_dict = {k: v for k, v in source.hf_state_dict().items() if k != "lm_head.weight"}
    loaded = Llama.from_hf(config, state_dict)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, source.model.embed_tokens.weight)
    assert torch.equal(prompt_logits(loaded), prompt_logits(source))


@pytest.mark.parametrize("edit, named", [
    (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), "model.layers.1.mlp.up_proj.weight"),
    (lambda sd: sd.pop("lm_head.weight"), "lm_head.weight"),  # untied: lm_head is required
    (lambda sd: sd.update({"model.layers.0.mlp.extra.weight": torch.ones(1)}),
     "model.layers.0.mlp.extra.weight"),
], ids=["missing", "missing-untied-lm-head", "unexpected"])
def test_state_dict_mismatch_names_the_keys(edit, named):
    state_dict = Llama.from_preset("tiny").hf_state_dict()
    edit(state_dict)
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        Llama.from_hf(LLAMA_PRESETS["tiny"], state_dict)


@pytest.mark.parametrize("model_class, change, error, named", [
    (Llama, {"hidden_size": None}, ValueError, "hidden_size"),
    (Llama, {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, NotImplementedError,
     "rope_scaling"),
    (Llama, {"hidden_act": "gelu"}, NotImplementedError, "hidden_act"),
    (Llama, {"num_key_value_heads": 3}, ValueError, "num_key_value_heads"),
    (Llama, {"num_hidden_layers": 0}, ValueError, "num_hidden_layers"),
    (DeepseekMLA, {"kv_lora_rank": None}, ValueError, "kv_lora_rank"),
    (DeepseekMLA, {"n_routed_experts": 64, "first_k_dense_replace": 1}, NotImplementedError,
     "n_routed_experts"),
    (DeepseekMLA, {"rope_scaling": {"type": "yarn", "factor": 40}}, NotImplementedError,
     "rope_scaling"),
], ids=lambda x: x if isinstance(x, str) else None)
def test_bad_config_is_refused(model_class, change, error, named):
    """A config error names the key; a None in `change` removes that key from the config."""
    config = {k: v for k, v in {**model_class.presets["tiny"], **change}.items() if v is not None}
    with pytest.raises(error, match=named):
        model_class.from_hf(config)


def test_llama_config_defaults_follow_hf():
    required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads")
    config = LlamaConfig.from_hf({k: LLAMA_PRESETS["tiny"][k] for k in required})
    assert config.num_key_value_heads == config.num_attention_heads == 4
    assert config.head_dim == 16
    assert config.rms_norm_eps == 1e-6 and config.rope_theta == 1e4
    assert not config.tie_word_embeddings


def test_deepseek_config_with_experts_but_only_dense_layers_is_accepted():
    config = {**MLA_PRESETS["tiny"], "n_routed_experts": 64, "first_k_dense_replace": 2}
    assert DeepseekMLAConfig.from_hf(config).num_hidden_layers == 2


def expanded_mla(self, positions, hidden):
    """Stands in for `DeepseekMLAAttention.forward`: HF's form, per-head keys and values."""
    num_tokens = hidden.shape[0]
    query, kv_a = self._query_and_latent(hidden)
    q_nope, q_pe = query.view(num_tokens, self.heads, -1).split([self.nope_dim, self.rope_dim], -1)
    kv_c, k_pe = kv_a.split([self.rank, self.rope_dim], dim=-1)
    kv = self.kv_b_proj(self.kv_a_layernorm(kv_c)).view(num_tokens, self.heads, -1)
    k_nope, value = kv.split([self.nope_dim, self.v_dim], dim=-1)
    q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe[:, None])
    query = torch.cat([q_nope, q_pe], dim=-1).double()
    key = torch.cat([k_nope, k_pe.expand(-1, self.heads, -1)], dim=-1).double()
    scores = torch.einsum("qhd,khd->hqk", query, key) * self.attn.scale
    out = torch.einsum("hqk,khd->qhd", causal_softmax(scores), value.double()).float()
    return self.o_proj(out.flatten(1))


@pytest.mark.parametrize("q_lora_rank", [None, 32])
def test_mla_weight_absorption_matches_expanded_attention(q_lora_rank, no_cache, monkeypatch):
    no_cache()
    model = DeepseekMLA.from_hf({**MLA_PRESETS["tiny"], "q_lora_rank": q_lora_rank})
    absorbed = prompt_logits(model)
    monkeypatch.setattr(DeepseekMLAAttention, "forward", expanded_mla)
    torch.testing.assert_close(prompt_logits(model), absorbed, **TOLERANCE)


# --- presets and seeded weights ---

@pytest.mark.parametrize("model_class, config_class", [
    (Llama, LlamaConfig), (DeepseekMLA, DeepseekMLAConfig),
])
def test_presets(model_class, config_class):
    assert {"tiny", "small"} <= set(model_class.presets)
    for config in model_class.presets.values():
        with torch.device("meta"):  # every preset builds; no memory needed to see that
            model_class(config_class.from_hf(config))
    available = ", ".join(repr(name) for name in sorted(model_class.presets))
    with pytest.raises(ValueError, match=rf"'huge'.*\[{re.escape(available)}\]"):
        model_class.from_preset("huge")


@pytest.mark.parametrize("model_class", [Llama, DeepseekMLA])
def test_random_weights_are_seeded(model_class):
    first, again = model_class.from_preset("tiny"), model_class.from_preset("tiny")
    other = model_class.from_preset("tiny", seed=1)
    for (name, a), b, c in zip(first.state_dict().items(), again.state_dict().values(),
                               other.state_dict().values()):
        assert torch.equal(a, b), name
        assert name.endswith("norm.weight") or not torch.equal(a, c), name
    half = model_class.from_preset("tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_generate_demo_runs_and_graph_mode_generates_what_eager_does(capsys):
    args = ["--preset", "tiny", "--num-prompts", "3", "--max-new-tokens", "4", "--block-size", "4",
            "--piece-compiler", "eager"]
    for model in ("llama", "deepseek_mla"):
        outputs = {}
        for mode in ("eager", "full_and_piecewise"):
            assert generate.main([*args, "--model", model, "--graph-mode", mode]) == 0
            lines = capsys.readouterr().out.splitlines()
            assert lines[0].startswith(f"model: the example {model!r} (tiny preset) with random "
                                       "weights")
            assert lines[1].startswith(f"graph mode {mode}")
            summary = next(line for line in lines if " steps, " in line)
            assert "4 steps" in summary and "12 generated" in summary
            outputs[mode] = [line for line in lines
                             if line.startswith(("request ", "  text ", "  token ids "))]
        assert len(outputs["eager"]) == 3 * 3
        assert outputs["eager"] == outputs["full_and_piecewise"]


@pytest.mark.parametrize("model_class", [Llama, DeepseekMLA])
def test_the_rope_angles_are_computed_once_a_step_with_the_same_result(model_class, no_cache,
                                                                     monkeypatch):
    """Every layer rotates alike, so the model computes the step's angles once (not inside each
    layer, where inductor would inline them into every head's rotation): same logits, bit for
    bit, as each layer computing its own from the positions."""
    no_cache()
    model = model_class.from_preset("tiny")
    assert model.model.shared_rotary() is model.model.layers[0].self_attn.rotary_emb
    calls = []
    original = RotaryEmbedding.cos_sin
    monkeypatch.setattr(RotaryEmbedding, "cos_sin",
                        lambda self, positions: calls.append(self) or original(self, positions))
    shared = prompt_logits(model)
    assert len(calls) == 1
    model.model.share_rope_angles = False
    assert torch.equal(prompt_logits(model), shared)
    assert len(calls) == 1 + model.config.num_hidden_layers
