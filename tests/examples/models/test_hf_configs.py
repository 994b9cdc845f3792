"""Checkpoints written by transformers itself load and reproduce transformers' logits.

Each case saves a tiny random HF model (safetensors), loads it with the example engine's
checkpoint loader and runs one whole-sequence prefill through kvgraph's paged cache (eager),
long enough that positions pass the scaled RoPE types' original context.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch._dynamo.testing import CompileCounter

import kvgraph
from examples.engine.checkpoint import load_checkpoint
from examples.models import MODELS, DeepseekMLA
from examples.models.rope import ROPE_TYPES, RopeParameters, RotaryEmbedding

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
SEQ_LEN = 40
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
# Tiny original contexts, so that SEQ_LEN tokens reach the stretched part.
ROPE_CASES = {
    "default-theta-500k": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 16},
    "yarn-mscales-untruncated": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 16, "mscale": 0.7,
                                 "mscale_all_dim": 0.3, "beta_fast": 16, "truncate": False},
    "dynamic-within-context": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tests.support.checkpoints import write_checkpoint

    return write_checkpoint(tmp_path_factory.mktemp("tokenizer"))


def save_hf(path, tokenizer_dir, config_class, model_class, **config):
    """A tiny random HF model saved under `path`, biases random too, with a tokenizer."""
    torch.manual_seed(0)
    model = model_class(config_class(**{**TINY, **config}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.5)
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path


def edit_config(path, **changes):
    """Rewrite `path`'s config.json; a None value removes the key."""
    config = {**json.loads((path / "config.json").read_text()), **changes}
    config = {k: v for k, v in config.items() if v is not None}
    (path / "config.json").write_text(json.dumps(config))


def input_ids(length: int = SEQ_LEN) -> list[int]:
    return torch.randint(TINY["vocab_size"], (length,),
                         generator=torch.Generator().manual_seed(1)).tolist()


def kvgraph_logits(path, token_ids: list[int]) -> torch.Tensor:
    """Every position's logits of one prefill of `token_ids` through kvgraph's paged cache."""
    model, _ = load_checkpoint(path, MODELS, torch.float32, "cpu")
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    specs = kvgraph.kv_cache_specs(model, BLOCK_SIZE, torch.float32)
    caches = kvgraph.allocate_kv_caches(specs, num_blocks, "cpu")
    kvgraph.bind_kv_cache(kvgraph.attention_layers(model), caches)
    chunks = [kvgraph.RequestChunk(token_ids, 0, list(range(num_blocks)))]
    metadata = kvgraph.build_attention_metadata(chunks, BLOCK_SIZE, "cpu")
    ids, positions = kvgraph.build_model_inputs(chunks, "cpu")
    with torch.no_grad(), kvgraph.set_forward_context(metadata):
        return model.compute_logits(model(ids, positions))


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_logits(path, token_ids: list[int]) -> torch.Tensor:
    """Transformers' own logits of the whole sequence in one forward."""
    with torch.no_grad():
        return hf_model(path)(torch.tensor([token_ids])).logits[0]


def assert_matches_hf(path, length: int = SEQ_LEN) -> None:
    token_ids = input_ids(length)
    torch.testing.assert_close(kvgraph_logits(path, token_ids), hf_logits(path, token_ids),
                               **TOLERANCE)


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_llama_rope_parameters_match_transformers(case, tmp_path, tokenizer_dir):
    rope = ROPE_CASES[case]
    save_hf(tmp_path, tokenizer_dir, transformers.LlamaConfig, transformers.LlamaForCausalLM,
            rope_parameters=dict(rope))
    saved = json.loads((tmp_path / "config.json").read_text())
    # The transformers 5 form: rope_theta inside rope_parameters, nothing at the top level.
    assert saved["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    assert "rope_theta" not in saved and "rope_scaling" not in saved
    assert_matches_hf(tmp_path)


@pytest.mark.parametrize("rope_type", ROPE_TYPES)
def test_rope_compiles_to_one_graph_equal_to_eager(rope_type):
    """No RoPE type branches on tensor values: one graph serves every batch of positions."""
    rope = RopeParameters(rope_type=rope_type, factor=4.0, max_position_embeddings=16,
                          original_max_position_embeddings=16, attention_factor=1.2)
    rotary, counter = RotaryEmbedding(16, rope), CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(rotary.cos_sin, fullgraph=True, dynamic=True, backend=counter)
    for positions in (torch.arange(5), torch.tensor([3, 40, 7, 100, 0, 15, 16])):
        for got, want in zip(compiled(positions), rotary.cos_sin(positions)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_rope_angles_are_one_opaque_op_equal_to_float64_cos_and_sin():
    """cos and sin come from `kvgraph_examples::rope_cos_sin`, which a traced graph keeps as
    one call (so inductor stores them once, see the next test), equal to float64 cos and sin."""
    rope = RopeParameters(rope_type="yarn", factor=4.0, max_position_embeddings=16,
                          original_max_position_embeddings=16, attention_factor=1.2)
    rotary, graphs = RotaryEmbedding(16, rope), []
    torch._dynamo.reset()
    compiled = torch.compile(rotary.cos_sin, fullgraph=True, dynamic=True,
                             backend=lambda gm, _: graphs.append(gm) or gm.forward)
    positions = torch.tensor([0, 3, 40, 7, 100])
    cos, sin = compiled(positions)
    calls = [str(n.target) for n in graphs[0].graph.nodes if n.op.startswith("call_")]
    assert sum("rope_cos_sin" in call for call in calls) == 1
    assert not [call for call in calls if "rope_cos_sin" not in call
                and ("cos" in call or "sin" in call)], calls
    angles = positions.double()[:, None] * rotary.inv_freq(positions).double()
    angles = torch.cat((angles, angles), dim=-1)[:, None, :]
    torch.testing.assert_close(cos, (angles.cos() * 1.2).float(), rtol=0, atol=1e-5)
    torch.testing.assert_close(sin, (angles.sin() * 1.2).float(), rtol=0, atol=1e-5)


@pytest.mark.slow
def test_inductor_evaluates_cos_and_sin_once_for_every_layer_in_one_graph(tmp_path, monkeypatch):
    """In one graph holding several layers (graph mode `full`), inductor would inline the angles
    into every head's rotation of every layer; with the opaque op no kernel it writes calls cos
    or sin."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    rotary = RotaryEmbedding(16, 10000.0)

    def two_layers(positions, q1, k1, q2, k2):
        angles = rotary.cos_sin(positions)
        return rotary(angles, q1, k1) + rotary(angles, q2, k2)

    tokens = 8
    args = (torch.arange(tokens), *(torch.randn(tokens, heads, 16) for heads in (4, 2, 4, 2)))
    torch._dynamo.reset()
    got, code = run_and_get_code(torch.compile(two_layers, fullgraph=True), *args)
    for g, w in zip(got, two_layers(*args)):
        torch.testing.assert_close(g, w)
    kernels = "\n".join(code)
    assert "rope_cos_sin" in kernels
    assert "std::cos" not in kernels and "std::sin" not in kernels, kernels


def test_transformers_4_form_top_level_theta_and_rope_scaling(tmp_path, tokenizer_dir):
    save_hf(tmp_path, tokenizer_dir, transformers.LlamaConfig, transformers.LlamaForCausalLM,
            rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0})
    edit_config(tmp_path, rope_parameters=None, rope_theta=500000.0,
                rope_scaling={"type": "linear", "factor": 4.0})
    model, _ = load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")
    assert model.config.rope.rope_type == "linear" and model.config.rope_theta == 500000.0
    assert_matches_hf(tmp_path)


def test_dynamic_ntk_past_the_context_matches_transformers_generating_token_by_token(
        tmp_path, tokenizer_dir):
    """Past max_position_embeddings, each token's base is scaled for the sequence ending at it:
    transformers' cached generation one token at a time, not its one-shot long prefill."""
    context = 16
    save_hf(tmp_path, tokenizer_dir, transformers.LlamaConfig, transformers.LlamaForCausalLM,
            max_position_embeddings=context,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    token_ids = input_ids()
    model, ids = hf_model(tmp_path), torch.tensor([token_ids])
    with torch.no_grad():
        out = model(ids[:, :context], use_cache=True)
        rows, cache = [out.logits[0]], out.past_key_values
        for position in range(context, len(token_ids)):
            out = model(ids[:, position:position + 1], cache=cache, use_cache=True)
            rows.append(out.logits[0])
    torch.testing.assert_close(kvgraph_logits(tmp_path, token_ids), torch.cat(rows),
                               **TOLERANCE)


def test_mistral_sliding_window_matches_transformers(tmp_path, tokenizer_dir):
    save_hf(tmp_path, tokenizer_dir, transformers.MistralConfig,
            transformers.MistralForCausalLM, sliding_window=6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    model, _ = load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")
    assert model.config.sliding_window == 6
    assert_matches_hf(tmp_path)


def test_qwen2_qkv_bias_matches_transformers(tmp_path, tokenizer_dir):
    save_hf(tmp_path, tokenizer_dir, transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    model, _ = load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")
    attention = model.model.layers[0].self_attn
    assert attention.qkv_proj.bias is not None and attention.o_proj.bias is None
    assert_matches_hf(tmp_path)


def test_qwen2_per_layer_sliding_window_is_refused(tmp_path, tokenizer_dir):
    save_hf(tmp_path, tokenizer_dir, transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
    edit_config(tmp_path, use_sliding_window=True, sliding_window=8)
    with pytest.raises(NotImplementedError, match="use_sliding_window=True"):
        load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, tokenizer_dir):
    return save_hf(tmp_path_factory.mktemp("llama"), tokenizer_dir, transformers.LlamaConfig,
                   transformers.LlamaForCausalLM)


@pytest.mark.parametrize("changes, error, named", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, NotImplementedError,
     r"rope_parameters\.rope_type='longrope' is not implemented"),
    ({"rope_parameters": None, "rope_scaling": {"type": "su", "factor": 2.0}},
     NotImplementedError, r"rope_scaling\.rope_type='su' is not implemented"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, ValueError,
     r"rope_parameters of rope_type 'llama3' lacks \['low_freq_factor', 'high_freq_factor'\]"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     NotImplementedError, r"rope_parameters\.partial_rotary_factor=0\.5"),
    ({"architectures": ["GemmaForCausalLM"]}, NotImplementedError,
     r"architectures \['GemmaForCausalLM'\] are not served"),
    ({"model_type": "gemma"}, NotImplementedError, "model_type='gemma'"),
], ids=["unknown-rope-type", "unknown-rope-scaling-type", "llama3-missing-keys",
        "partial-rotary", "unknown-architecture", "unknown-model-type"])
def test_unsupported_configs_are_refused_naming_the_field(llama_dir, tmp_path, changes,
                                                          error, named):
    for file in llama_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    edit_config(tmp_path, **changes)
    with pytest.raises(error, match=named):
        load_checkpoint(tmp_path, MODELS, torch.float32, "cpu")


def test_deepseek_refuses_rope_scaling_in_the_transformers_5_form():
    config = {**DeepseekMLA.presets["tiny"],
              "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4}}
    with pytest.raises(NotImplementedError, match=r"rope_parameters\.rope_type='yarn'"):
        DeepseekMLA.from_hf(config)
