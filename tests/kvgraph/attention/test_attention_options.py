"""Layer options against dense float64 references: read-only KV sharing, encoder sliding window.

A layer that shares another layer's cache only reads it (vLLM's semantics): the target's writes
serve both. An encoder-only layer with a sliding window w lets token i see token j of its
request when |i - j| < w.
"""

from __future__ import annotations

import random

import pytest
import torch

import kvgraph
from tests.support.scenario import BLOCK_SIZE, NUM_BLOCKS, TOLERANCE, generate, make_model
from tests.support.attention_reference import (
    D, H, HKV, LORA, ROPE, assert_close, attention_batch, block_and_offset, check_caches,
    make_chunks, mla_batch, rand, ref_attention, ref_encoder_window, request_shapes,
)

TARGET, SHARER = "model.layers.0.attn", "model.layers.1.attn"


def mixed_batch(seed: int, make=attention_batch):
    rng = random.Random(seed)
    chunks, num_blocks = make_chunks(request_shapes("mixed", rng), 4, rng)
    return make(chunks, num_blocks, 4, seed=seed)


def cached_sequences(batch, chunk):
    """Every key and value of `chunk`'s sequence as the cache must hold them after the step."""
    slots = [block_and_offset(chunk, pos, batch.block_size) for pos in range(chunk.seq_len)]
    return [torch.stack([cache[b, o] for b, o in slots]) for cache in batch.expected_caches]


def layers_sharing(declared_at: str, scale: float):
    target = kvgraph.Attention(H, D, scale, HKV, TARGET)
    sharer = kvgraph.Attention(H, D, scale, HKV, SHARER, kv_sharing_target_layer_name=(
        TARGET if declared_at == "construction" else None))
    return target, sharer


@pytest.mark.parametrize("declared_at", ["construction", "bind"])
def test_a_sharing_layer_reads_the_target_cache_and_writes_nothing(declared_at):
    batch = mixed_batch(seed=5)
    target, sharer = layers_sharing(declared_at, batch.scale)
    model = torch.nn.ModuleDict({"a": target, "b": sharer})
    shared = {SHARER: TARGET} if declared_at == "bind" else None
    assert list(kvgraph.kv_cache_specs(model, 4, torch.float64, shared)) == [TARGET]
    kvgraph.bind_kv_cache({TARGET: target, SHARER: sharer}, {TARGET: tuple(batch.caches)}, shared)
    assert sharer.kv_cache is target.kv_cache
    assert sharer.kv_sharing_target_layer_name == TARGET

    gen = torch.Generator().manual_seed(1)
    q, k, v = batch.inputs
    T = q.shape[0]
    # The sharer's own keys and values differ from the target's: they must be ignored.
    sharer_q, sharer_k, sharer_v = (rand(gen, *t.shape) for t in (q, k, v))
    with kvgraph.set_forward_context(batch.md):
        target_out = target(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))
        sharer_out = sharer(sharer_q.reshape(T, -1), sharer_k.reshape(T, -1),
                            sharer_v.reshape(T, -1))
    check_caches(batch)  # exactly the target's keys and values, nothing of the sharer's
    assert_close(target_out.view(T, H, D), batch.ref, torch.float64)

    starts = batch.md.query_start_loc.tolist()
    expected = [ref_attention(sharer_q[lo:hi], *cached_sequences(batch, chunk),
                              chunk.num_computed_tokens, batch.scale)
                for chunk, lo, hi in zip(batch.chunks, starts, starts[1:])]
    assert_close(sharer_out.view(T, H, D), torch.cat(expected), torch.float64)


def test_a_sharing_mla_layer_reads_the_target_cache_and_writes_nothing():
    batch = mixed_batch(seed=6, make=mla_batch)
    for cache, written in zip(batch.caches, batch.expected_caches):
        cache.copy_(written)  # the target layer already wrote this step's tokens
    sharer = kvgraph.MLAAttention(H, LORA, ROPE, batch.scale, SHARER,
                                  kv_sharing_target_layer_name=TARGET)
    sharer.kv_cache = tuple(batch.caches)
    q_latent, q_pe, kv_c, k_pe = batch.inputs
    with kvgraph.set_forward_context(batch.md):
        out = sharer(q_latent, q_pe, torch.randn_like(kv_c), torch.randn_like(k_pe))
    check_caches(batch)
    assert_close(out, batch.ref, torch.float64)


def test_sharing_declared_twice_must_agree():
    target, sharer = layers_sharing("construction", 0.3)
    other = kvgraph.Attention(H, D, 0.3, HKV, "model.layers.2.attn")
    layers = {TARGET: target, SHARER: sharer, "model.layers.2.attn": other}
    caches = kvgraph.allocate_kv_caches(
        {TARGET: kvgraph.AttentionSpec(4, HKV, D, torch.float32),
         "model.layers.2.attn": kvgraph.AttentionSpec(4, HKV, D, torch.float32)}, 2, "cpu")
    with pytest.raises(kvgraph.KVCacheError, match="built with kv_sharing_target_layer_name="):
        kvgraph.bind_kv_cache(layers, caches, {SHARER: "model.layers.2.attn"})
    assert len(sharer.kv_cache) == 0, "a failed bind binds nothing"


def test_an_encoder_only_layer_cannot_share_a_cache():
    with pytest.raises(ValueError, match="encoder-only layer keeps no cache"):
        kvgraph.Attention(H, D, 0.3, HKV, SHARER, attn_type="encoder_only",
                          kv_sharing_target_layer_name=TARGET)


@pytest.mark.parametrize("window", [1, 2, 5, 100])
def test_encoder_only_attention_honours_the_sliding_window(window):
    gen = torch.Generator().manual_seed(window)
    lens = [7, 1, 12, 3]
    chunks = [kvgraph.RequestChunk(list(range(n)), 0, [0] * -(-n // 4)) for n in lens]
    md = kvgraph.build_attention_metadata(chunks, 4, "cpu")
    layer = kvgraph.Attention(H, D, 0.3, HKV, TARGET, sliding_window=window,
                              attn_type="encoder_only")
    q, k, v = rand(gen, sum(lens), H, D), rand(gen, sum(lens), HKV, D), rand(gen, sum(lens), HKV, D)
    T = q.shape[0]
    with kvgraph.set_forward_context(md):
        out = layer(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)).view(T, H, D)
    starts = md.query_start_loc.tolist()
    expected = torch.cat([ref_encoder_window(q[lo:hi], k[lo:hi], v[lo:hi], 0.3, window)
                          for lo, hi in zip(starts, starts[1:])])
    assert_close(out, expected, torch.float64)
    if window == 1:  # each token sees only itself
        torch.testing.assert_close(out, v.repeat_interleave(H // HKV, dim=1))


def sharing_llama_runner(graph_mode: str) -> kvgraph.ModelRunner:
    """The tiny Llama with its second layer reading the first layer's cache."""
    model = make_model("llama")
    first, second = (layer.self_attn.attn for layer in model.model.layers[:2])
    second.kv_sharing_target_layer_name = first.layer_name
    config = kvgraph.CompilationConfig(graph_mode=graph_mode, piece_compiler="eager",
                                       capture_sizes=(1, 2, 4, 8, 16))
    runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                 max_num_tokens=32, max_num_seqs=8)
    assert second.layer_name not in runner.kv_caches and second.kv_cache is first.kv_cache
    return runner


@pytest.mark.parametrize("mode", ["none", "full_and_piecewise"])
def test_a_sharing_layer_runs_the_same_in_graph_mode_as_in_eager(mode):
    eager, graph = sharing_llama_runner("eager"), sharing_llama_runner(mode)
    graph.capture()
    expected_logits, expected_tokens = generate(eager, eager.model.config.vocab_size)
    logits, tokens = generate(graph, graph.model.config.vocab_size)
    assert tokens == expected_tokens
    torch.testing.assert_close(logits, expected_logits, **TOLERANCE)
    for name, cache in eager.kv_caches.items():
        for got, want in zip(graph.kv_caches[name], cache):
            torch.testing.assert_close(got, want, **TOLERANCE)
