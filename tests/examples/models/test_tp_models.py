"""Tensor-parallel example models: the sharding rules and loader on a fake group (no
torch.distributed), and two gloo ranks generating what one process does in every graph mode."""

import pytest
import torch
from torch import nn

import kvgraph
from examples.models.deepseek_mla import DeepseekMLA
from examples.models import MODELS
from examples.models.layers import MergedLinear
from examples.models.llama import Llama
from examples.models.tensor_parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLinear,
    RowParallelLinear,
    shard_model,
    shard_units,
)
from kvgraph.cpu.linear_packing import LinearPacking, linear_packing
from kvgraph.cpu.packed_linear import pack_linear_weights
from kvgraph.cpu.small_batch_linear import use_small_batch_linear
from kvgraph.distributed import TensorParallelGroup
from tests.support.scenario import NUM_BLOCKS, TOLERANCE, generate
from tests.support.tp_harness import run_ranks

MODES = ("eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
BLOCK_SIZE = 16
LLAMA = Llama.presets["tiny"]
LLAMA_ONE_KV_HEAD = {**LLAMA, "num_key_value_heads": 1}
MLA = DeepseekMLA.presets["tiny"]
# The graphs each mode's steps must have replayed (the CPU's default backend, cpu_paged,
# captures every batch, so "full" runs full graphs only).
GRAPHS_REPLAYED = {"piecewise": {"piecewise"}, "full": {"full"},
                   "full_decode_only": {"full"}, "full_and_piecewise": {"full", "piecewise"}}


def fake(rank: int, world_size: int = 2) -> TensorParallelGroup:
    """A rank/size carrier: enough to shard and load, not to run collectives."""
    return TensorParallelGroup(None, rank, world_size)


def cut(tensor: torch.Tensor, dim: int, rank: int, parts: int) -> torch.Tensor:
    return tensor.chunk(parts, dim)[rank]


def qkv(attn: nn.Module, leaf: str = "weight") -> tuple[torch.Tensor, ...]:
    """An attention module's q, k and v parts of its merged `qkv_proj` parameter `leaf`."""
    return getattr(attn.qkv_proj, leaf).split(part_sizes(attn.qkv_proj))


def part_sizes(merged: MergedLinear) -> list[int]:
    """The output features of each part a merged linear holds, in order."""
    return [part.size for part in merged.parts]


# --- the rules, on a fake group ---------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1])
def test_llama_shards_by_heads_columns_and_rows(rank):
    full = Llama.from_hf(LLAMA, seed=3)
    model = Llama.from_hf(LLAMA, seed=3, tp=fake(rank))
    attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
    whole, local = full.hf_state_dict(), model.hf_state_dict()
    p = "model.layers.1."
    kinds = {"self_attn.qkv_proj": MergedColumnParallelLinear,
             "self_attn.o_proj": RowParallelLinear,
             "mlp.gate_up_proj": MergedColumnParallelLinear, "mlp.down_proj": RowParallelLinear}
    for name, kind in kinds.items():
        assert type(model.get_submodule(p + name)) is kind, name
    dims = {  # 4 heads and 2 KV heads of 16, intermediate 128, over 2 ranks
        "self_attn.q_proj": 0, "self_attn.k_proj": 0, "self_attn.v_proj": 0,
        "self_attn.o_proj": 1, "mlp.gate_proj": 0, "mlp.up_proj": 0, "mlp.down_proj": 1,
    }
    for name, dim in dims.items():
        name = p + name + ".weight"
        assert torch.equal(local[name], cut(whole[name], dim, rank, 2)), name
    assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)
    assert part_sizes(attn.qkv_proj) == [32, 16, 16] and part_sizes(mlp.gate_up_proj) == [64, 64]
    assert mlp.down_proj.weight.shape == (64, 64)
    replicated = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                  p + "input_layernorm.weight"]
    for name in replicated:
        assert torch.equal(local[name], whole[name]), name
    assert kvgraph.kv_cache_specs(model, BLOCK_SIZE, torch.float32)[p + "self_attn.attn"] == \
        kvgraph.AttentionSpec(BLOCK_SIZE, 1, 16, torch.float32)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_kv_head_is_replicated_when_there_are_fewer_than_ranks(rank):
    full = Llama.from_hf(LLAMA_ONE_KV_HEAD)
    model = Llama.from_hf(LLAMA_ONE_KV_HEAD, tp=fake(rank))
    (q, k, v), (whole_q, whole_k, whole_v) = (qkv(m.model.layers[0].self_attn)
                                              for m in (model, full))
    assert torch.equal(k, whole_k) and torch.equal(v, whole_v)
    assert torch.equal(q, cut(whole_q, 0, rank, 2))
    attn = model.model.layers[0].self_attn
    assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)


def test_kv_heads_replicated_by_rank_groups():
    # vLLM's rule: rank r of tp holds kv head r // (tp // num_kv_heads).
    assert [shard_units(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [shard_units(8, r, 4) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    config = {**LLAMA, "num_attention_heads": 8, "head_dim": 8, "num_key_value_heads": 2}
    full_q, full_k, full_v = qkv(Llama.from_hf(config).model.layers[0].self_attn)
    for rank in range(4):
        attn = Llama.from_hf(config, tp=fake(rank, 4)).model.layers[0].self_attn
        q, k, v = qkv(attn)
        assert torch.equal(k, full_k[rank // 2 * 8:][:8])
        assert torch.equal(v, full_v[rank // 2 * 8:][:8])
        assert torch.equal(q, cut(full_q, 0, rank, 4))
        assert (attn.attn.num_heads, attn.attn.num_kv_heads) == (2, 1)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_merged_linears_hold_each_parts_share_in_order(kv_heads):
    """Rank r's qkv_proj computes [q_r, k_r, v_r] (k, v whole when replicated), its gate_up_proj
    [gate_r, up_r]: the matching slices of the unsharded merged outputs."""
    config = {**LLAMA, "num_key_value_heads": kv_heads, "attention_bias": True}
    state_dict = random_state_dict(Llama, config)
    full = Llama.from_hf(config, state_dict).model.layers[0]
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    full_q, full_k, full_v = full.self_attn.qkv_proj(x).split([64, 16 * kv_heads, 16 * kv_heads],
                                                              -1)
    full_gate, full_up = full.mlp.gate_up_proj(x).chunk(2, -1)
    for rank in range(2):
        layer = Llama.from_hf(config, state_dict, tp=fake(rank)).model.layers[0]
        q, k, v = layer.self_attn.qkv_proj(x).split(part_sizes(layer.self_attn.qkv_proj), -1)
        kv_cut = (lambda t: cut(t, 1, rank, 2)) if kv_heads == 2 else (lambda t: t)
        for got, want in [(q, cut(full_q, 1, rank, 2)), (k, kv_cut(full_k)),
                          (v, kv_cut(full_v))]:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        gate, up = layer.mlp.gate_up_proj(x).split(part_sizes(layer.mlp.gate_up_proj), -1)
        torch.testing.assert_close(gate, cut(full_gate, 1, rank, 2), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(up, cut(full_up, 1, rank, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("q_lora_rank", [None, 32])
@pytest.mark.parametrize("rank", [0, 1])
def test_mla_shards_heads_and_replicates_the_latent(rank, q_lora_rank):
    config = {**MLA, "q_lora_rank": q_lora_rank}
    whole = DeepseekMLA.from_hf(config).hf_state_dict()
    model = DeepseekMLA.from_hf(config, tp=fake(rank))
    local = model.hf_state_dict()
    attn = model.model.layers[0].self_attn
    assert attn.heads == attn.attn.num_heads == 2
    p = "model.layers.0.self_attn."
    split = {"kv_b_proj": 0, "o_proj": 1, ("q_proj" if q_lora_rank is None else "q_b_proj"): 0}
    for name, dim in split.items():
        assert torch.equal(local[p + name + ".weight"],
                           cut(whole[p + name + ".weight"], dim, rank, 2)), name
    # The latent projections (with a low-rank query, merged as fused_qkv_a_proj) stay whole.
    latent = "kv_a_proj_with_mqa" if q_lora_rank is None else "fused_qkv_a_proj"
    assert type(attn.get_submodule(latent)) is (nn.Linear if q_lora_rank is None else MergedLinear)
    replicated = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"]
    replicated += [] if q_lora_rank is None else ["q_a_proj.weight", "q_a_layernorm.weight"]
    for name in replicated:
        assert torch.equal(local[p + name], whole[p + name]), name
    assert kvgraph.kv_cache_specs(model, BLOCK_SIZE, torch.float32)[p + "attn"] == \
        kvgraph.MLASpec(BLOCK_SIZE, 32, 8, torch.float32)


def test_a_weight_read_as_a_matrix_stays_plain_when_cut():
    """MLA reads `kv_b_proj`'s weight as W_UK/W_UV matrices: its column-parallel cut keeps the
    PLAIN declaration, so neither CPU weight transform packs or swaps it."""
    attn = (model := DeepseekMLA.from_hf(MLA, tp=fake(0))).model.layers[0].self_attn
    assert type(attn.kv_b_proj) is ColumnParallelLinear
    assert linear_packing(attn.kv_b_proj) is LinearPacking.PLAIN
    weight = attn.kv_b_proj.weight
    pack_linear_weights(model, dtypes=(torch.float32,))
    use_small_batch_linear(model)
    assert type(attn.kv_b_proj) is ColumnParallelLinear and attn.kv_b_proj.weight is weight


@pytest.mark.parametrize("model_class, config", [(Llama, LLAMA), (DeepseekMLA, MLA)])
def test_the_loader_and_sharding_a_built_model_cut_the_same_parts(model_class, config):
    source = model_class.from_hf(config, seed=5)
    state_dict = source.hf_state_dict()
    for rank in range(2):
        loaded = model_class.from_hf(config, state_dict, tp=fake(rank)).hf_state_dict()
        seeded = model_class.from_hf(config, seed=5, tp=fake(rank)).hf_state_dict()
        sharded = shard_model(model_class.from_hf(config, seed=5), fake(rank)).hf_state_dict()
        assert loaded.keys() == seeded.keys() == sharded.keys() == state_dict.keys()
        for name in state_dict:
            assert torch.equal(loaded[name], seeded[name]), name
            assert torch.equal(sharded[name], seeded[name]), name


def random_state_dict(model_class, config: dict, seed: int = 0) -> dict:
    """Full HF weights, seeded, with random (not zero) biases."""
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(t.shape, generator=generator) * 0.1 if name.endswith(".bias") else t
            for name, t in model_class.from_hf(config, seed=seed).hf_state_dict().items()}


def test_biases_are_cut_with_columns_and_kept_whole_with_rows():
    config = {**LLAMA, "attention_bias": True}
    state_dict = random_state_dict(Llama, config)
    p = "model.layers.0.self_attn."
    for rank in range(2):
        attn = Llama.from_hf(config, state_dict, tp=fake(rank)).model.layers[0].self_attn
        q, k, v = qkv(attn, "bias")
        assert torch.equal(q, cut(state_dict[p + "q_proj.bias"], 0, rank, 2))
        assert torch.equal(k, cut(state_dict[p + "k_proj.bias"], 0, rank, 2))
        assert torch.equal(v, cut(state_dict[p + "v_proj.bias"], 0, rank, 2))
        # Whole: the row-parallel sum adds it once.
        assert torch.equal(attn.o_proj.bias, state_dict[p + "o_proj.bias"])


def test_a_tensor_of_the_wrong_unsharded_shape_is_refused():
    state_dict = Llama.from_hf(LLAMA).hf_state_dict()
    name = "model.layers.1.self_attn.k_proj.weight"
    state_dict[name] = torch.zeros(48, 64)  # would still hold rank 0's 16 rows
    with pytest.raises(ValueError, match=rf"{name}: expected the unsharded shape \(32, 64\), "
                                         r"got \(48, 64\)"):
        Llama.from_hf(LLAMA, state_dict, tp=fake(0))


def test_size_one_builds_the_very_same_modules():
    for model_class, config in [(Llama, LLAMA), (DeepseekMLA, MLA)]:
        plain, one = model_class.from_hf(config), model_class.from_hf(config, tp=fake(0, 1))
        assert [type(m) for m in one.modules()] == [type(m) for m in plain.modules()]
        assert not any(isinstance(m, ParallelLinear) for m in one.modules())
        for (name, a), b in zip(plain.state_dict().items(), one.state_dict().values()):
            assert torch.equal(a, b), name
        assert shard_model(plain, fake(0, 1)) is plain


@pytest.mark.parametrize("model_class, change, size, named", [
    (Llama, {}, 3, r"size 3 does not divide Llama's num_attention_heads \(4\)"),
    (Llama, {"num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 16}, 4,
     r"size 4 does not divide Llama's num_key_value_heads \(6\), nor is it a multiple"),
    (Llama, {"intermediate_size": 129}, 2, r"intermediate_size \(129\)"),
    (DeepseekMLA, {}, 8, r"size 8 does not divide DeepseekMLA's num_attention_heads \(4\)"),
], ids=["heads", "kv-heads", "intermediate", "mla-heads"])
def test_a_size_that_does_not_fit_is_refused(model_class, change, size, named):
    config = {**model_class.presets["tiny"], **change}
    with pytest.raises(ValueError, match=named):
        model_class.from_hf(config, tp=fake(0, size))
    model = model_class.from_hf(config)
    types = [type(m) for m in model.modules()]
    with pytest.raises(ValueError, match=named):
        shard_model(model, fake(0, size))
    assert [type(m) for m in model.modules()] == types  # refused before anything changed


def test_sharding_twice_is_refused():
    model = Llama.from_hf(LLAMA, tp=fake(0))
    with pytest.raises(ValueError, match="already sharded"):
        shard_model(model, fake(0))


def test_parallel_linears_cut_evenly_by_default():
    column = ColumnParallelLinear(8, 6, tp=fake(1), device="meta")
    row = RowParallelLinear(6, 8, bias=True, tp=fake(1), device="meta")
    assert column.weight.shape == (3, 8) and column.shard == slice(3, 6)
    assert row.weight.shape == (8, 3) and row.bias.shape == (8,)
    assert row.full_shape("weight") == (8, 6) and column.full_shape("bias") == (6,)
    with pytest.raises(ValueError, match=r"size 2 does not divide .*out_features \(5\)"):
        ColumnParallelLinear(8, 5, tp=fake(0), device="meta")


# --- two gloo ranks against one process -------------------------------------------------------

def _runner(model, mode: str, piece_compiler: str = "eager", cache_dir: str | None = None):
    config = kvgraph.CompilationConfig(
        graph_mode=mode, piece_compiler=piece_compiler, capture_sizes=(1, 2, 4, 8),
        use_compile_cache=cache_dir is not None, **({"cache_dir": cache_dir} if cache_dir else {}))
    return kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                               max_num_seqs=8, max_num_tokens=32, device="cpu")


def _generate(runner) -> dict:
    """The scenario's greedy plan (prefills, chunked prefill, decodes) and the caches after."""
    logits, tokens = generate(runner, runner.vocab_size)
    return {"logits": [x.clone() for x in logits], "tokens": tokens,
            "caches": {name: tuple(t.clone() for t in cache)
                       for name, cache in runner.kv_caches.items()}}


def _rank_modes(rank: int, kind: str, config: dict, state_dict: dict | None, modes: tuple,
                piece_compiler: str, cache_dir: str | None) -> dict:
    from kvgraph.distributed import tensor_parallel_group

    results = {}
    for mode in modes:
        model = MODELS[kind].from_hf(config, state_dict, tp=tensor_parallel_group())
        runner = _runner(model, mode, piece_compiler, cache_dir)
        runner.capture()
        results[mode] = _generate(runner)
        # How steps ran ("full", "piecewise", "none", "eager"): graphs were replayed.
        results[mode]["ran"] = {label.split(":")[0] for label in runner.stats()["hits"]}
        runner.close()
    return results


def _reference(kind: str, config: dict, state_dict: dict | None) -> dict:
    runner = _runner(MODELS[kind].from_hf(config, state_dict), "eager")
    try:
        return _generate(runner)
    finally:
        runner.close()


def _cache_part(kind: str, config: dict, rank: int, cache: tuple) -> tuple:
    """Rank `rank`'s part of a TP=1 cache: its KV heads (Llama), or all of it (MLA's latent)."""
    if kind == "deepseek_mla":
        return cache
    kv_heads = config["num_key_value_heads"]
    first, count = (rank, 1) if kv_heads == 2 else (0, 1)  # 2 heads: one each; 1: replicated
    return tuple(t[:, :, first:first + count] for t in cache)


def assert_ranks_match_one_process(kind, config, tmp_path, state_dict=None, modes=MODES,
                                   piece_compiler="eager", cache_dir=None):
    """Every rank's greedy tokens, logits and cache part equal one process's (TP=1, eager);
    the ranks' logits equal each other's bit for bit. `state_dict`: else seeded weights."""
    want = _reference(kind, config, state_dict)
    ranks = run_ranks(_rank_modes, tmp_path,
                      args=(kind, config, state_dict, modes, piece_compiler, cache_dir))
    for mode in modes:
        got = [ranks[r][mode] for r in range(2)]
        for rank, result in enumerate(got):
            assert GRAPHS_REPLAYED.get(mode, set()) <= result["ran"], (mode, result["ran"])
            assert result["tokens"] == want["tokens"], (mode, rank)
            for step, (a, b) in enumerate(zip(result["logits"], want["logits"])):
                torch.testing.assert_close(a, b, **TOLERANCE, msg=f"{mode} rank {rank} step {step}")
            for name, cache in want["caches"].items():
                for a, b in zip(result["caches"][name], _cache_part(kind, config, rank, cache)):
                    torch.testing.assert_close(a, b, **TOLERANCE, msg=f"{mode} rank {rank} {name}")
        for step, (a, b) in enumerate(zip(got[0]["logits"], got[1]["logits"])):
            assert torch.equal(a, b), f"{mode}: the ranks' logits differ at step {step}"


@pytest.mark.parametrize("kind, config", [
    ("llama", LLAMA), ("deepseek_mla", MLA),
], ids=["llama", "deepseek_mla"])
def test_two_ranks_generate_what_one_process_does(kind, config, tmp_path):
    assert_ranks_match_one_process(kind, config, tmp_path)


def test_two_ranks_with_one_replicated_kv_head_and_biases(tmp_path):
    # Loaded weights with random biases: column biases cut, the row bias added once.
    config = {**LLAMA_ONE_KV_HEAD, "attention_bias": True}
    assert_ranks_match_one_process("llama", config, tmp_path, random_state_dict(Llama, config),
                                   modes=("eager", "full_and_piecewise"))


@pytest.mark.slow
def test_two_ranks_with_inductor_pieces(tmp_path, compile_cache_dir):
    assert_ranks_match_one_process("llama", LLAMA, tmp_path,
                                   modes=("piecewise", "full_and_piecewise"),
                                   piece_compiler="inductor", cache_dir=compile_cache_dir)
