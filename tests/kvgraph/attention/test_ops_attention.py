"""unified_attention and the Attention layer (MHA/GQA/MQA, sliding window, encoder-only)
against the float64 references of tests/support/attention_reference.py; nested forward contexts."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

import kvgraph
from kvgraph import BatchError, ForwardContextError
from kvgraph.forward_context import get_forward_context
from tests.support.attention_reference import (
    BLOCK_SIZES, D, H, HEAD_CONFIGS, HKV, KINDS, LAYER, Batch, OpRecorder,
    assert_bitwise_equal, assert_close, attention_batch, block_and_offset, check_caches,
    check_inputs_unchanged, encoder_batch, make_chunks, rand, random_attention_batch,
    request_shapes, run_op,
)


# --- standard attention: the op ---------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_unified_attention_matches_reference(kind, heads, block_size):
    b = random_attention_batch(kind, block_size, heads)
    originals = [t.clone() for t in b.inputs]
    out = run_op(b)
    assert_close(out, b.ref, torch.float64)
    check_caches(b)
    check_inputs_unchanged(b, originals)


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("window", [1, 2, 5, 10_000])
@pytest.mark.parametrize("kind", KINDS)
def test_unified_attention_sliding_window(kind, window, block_size):
    b = random_attention_batch(kind, block_size, "gqa", window=window)
    out = run_op(b, window=window)
    assert_close(out, b.ref, torch.float64)
    check_caches(b)


def test_sliding_window_actually_masks():
    """On the same data the window-1 reference differs from full attention (so the window
    tests can fail), and with window 1 every token sees only itself: its output is its value."""
    rng = random.Random(3)
    chunks, num_blocks = make_chunks(request_shapes("chunked", rng), 4, rng)
    num_heads, num_kv_heads = HEAD_CONFIGS["gqa"]
    b = attention_batch(chunks, num_blocks, 4, num_heads, num_kv_heads, seed=3, window=1)
    full = attention_batch(chunks, num_blocks, 4, num_heads, num_kv_heads, seed=3, window=None)
    assert torch.equal(b.inputs[0], full.inputs[0])
    assert not torch.allclose(b.ref, full.ref, atol=1e-3)
    out = run_op(b, window=1)
    assert_close(out, b.ref, torch.float64)
    own_value = b.inputs[2].double().repeat_interleave(num_heads // num_kv_heads, dim=1)
    assert_close(out, own_value, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_unified_attention_low_precision(kind, dtype):
    b = random_attention_batch(kind, 4, "gqa", dtype=dtype, window=None, head_size=16)
    out = run_op(b)
    assert out.dtype == dtype
    assert_close(out, b.ref, dtype)
    check_caches(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_attention_low_precision_window(dtype):
    b = random_attention_batch("chunked", 16, "mqa", dtype=dtype, window=3)
    assert_close(run_op(b, window=3), b.ref, dtype)
    check_caches(b)


def test_unified_attention_hand_sized_batch():
    """A fixed batch small enough to read: decode + chunked prefill + fresh prefill."""
    chunks = [
        kvgraph.RequestChunk([7], 5, [3, 0]),  # decode at position 5
        kvgraph.RequestChunk([1, 2, 3], 2, [4, 2]),  # positions 2..4
        kvgraph.RequestChunk([9, 9], 0, [1]),  # positions 0..1
    ]
    b = attention_batch(chunks, 6, 4, 4, 2, 8, seed=11)
    out = run_op(b)
    assert_close(out, b.ref, torch.float64)
    check_caches(b)
    # the decode token at position 5 lives in block 0 offset 1; its key is the first new key
    assert_bitwise_equal(b.caches[0][0, 1], b.inputs[1][0], "decode slot")


def test_cached_prefix_is_read():
    """Changing a cached key changes the output: the op reads the prefix through the block table."""
    b = random_attention_batch("chunked", 4, "gqa")
    c = b.chunks[0]
    blk, off = block_and_offset(c, 0, 4)
    b.caches[0][blk, off] += 3.0
    out = run_op(b)
    n0 = len(c.token_ids)
    assert not torch.allclose(out[:n0].double(), b.ref[:n0], rtol=1e-6, atol=1e-6)


# --- standard attention: the layer ------------------------------------------------------------


def run_layer(b: Batch, num_heads, num_kv_heads, window=None):
    head_size = b.inputs[0].shape[-1]
    layer = kvgraph.Attention(num_heads, head_size, b.scale, num_kv_heads, LAYER,
                              sliding_window=window)
    assert layer.kv_cache_spec(b.block_size, b.dtype) == kvgraph.AttentionSpec(
        b.block_size, num_kv_heads, head_size, b.dtype)
    kvgraph.bind_kv_cache({LAYER: layer}, {LAYER: tuple(b.caches)})
    assert layer.kv_cache[0] is b.caches[0] and layer.kv_cache[1] is b.caches[1]
    q, k, v = b.inputs
    T = q.shape[0]
    with kvgraph.set_forward_context(b.md):
        out = layer(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))
    assert out.shape == (T, num_heads * head_size)
    return out.view(T, num_heads, head_size)


@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
@pytest.mark.parametrize("kind", KINDS)
def test_attention_layer_matches_reference(kind, heads):
    b = random_attention_batch(kind, 4, heads)
    out = run_layer(b, *HEAD_CONFIGS[heads])
    assert_close(out, b.ref, torch.float64)
    check_caches(b)


@pytest.mark.parametrize("window", [1, 3, 10_000])
@pytest.mark.parametrize("kind", ["mixed", "chunked"])
def test_attention_layer_sliding_window(kind, window):
    b = random_attention_batch(kind, 1, "mqa", window=window)
    assert_close(run_layer(b, *HEAD_CONFIGS["mqa"], window=window), b.ref, torch.float64)
    check_caches(b)


def test_attention_layer_bfloat16():
    b = random_attention_batch("mixed", 16, "gqa", dtype=torch.bfloat16)
    out = run_layer(b, *HEAD_CONFIGS["gqa"])
    assert out.dtype == torch.bfloat16
    assert_close(out, b.ref, torch.bfloat16)
    check_caches(b)


# --- encoder-only -----------------------------------------------------------------------------


@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
def test_encoder_only_layer(heads):
    num_heads, num_kv_heads = HEAD_CONFIGS[heads]
    layer = kvgraph.Attention(num_heads, D, 0.3, num_kv_heads, LAYER, attn_type="encoder_only")
    assert layer.kv_cache_spec(16, torch.float64) is None
    assert not layer.needs_kv_cache
    assert kvgraph.bind_kv_cache({LAYER: layer}, {}) == {}
    assert len(layer.kv_cache) == 0
    md, q, k, v, ref = encoder_batch(num_heads=num_heads, num_kv_heads=num_kv_heads)
    T = q.shape[0]
    with kvgraph.set_forward_context(md), OpRecorder() as rec:
        out = layer(q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1))
    assert_close(out.view(T, num_heads, D), ref, torch.float64)
    assert "kvgraph.encoder_attention.default" in rec.ops
    assert not any(op.startswith("kvgraph.unified") for op in rec.ops)


def test_encoder_attention_op_with_padding():
    md, q, k, v, ref = encoder_batch(seed=22)
    T = q.shape[0]
    gen = torch.Generator().manual_seed(0)
    md = dataclasses.replace(md, slot_mapping=torch.cat([md.slot_mapping, torch.full((2,), -1)]))
    q, k, v = (torch.cat([t, rand(gen, 2, *t.shape[1:])]) for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    with kvgraph.set_forward_context(md):
        assert torch.ops.kvgraph.encoder_attention(q, k, v, out, 0.3) is None
    assert_close(out[:T], ref, torch.float64)
    assert (out[T:] == 0).all()


def test_encoder_model_skips_encoder_layer_cache():
    """A model with an encoder-only and a decoder layer gets a spec (and a cache) only for the
    decoder layer; binding skips the encoder layer."""
    model = torch.nn.Module()
    model.enc = kvgraph.Attention(H, D, 0.3, HKV, "layers.0.attn", attn_type="encoder_only")
    model.dec = kvgraph.Attention(H, D, 0.3, HKV, "layers.1.attn")
    specs = kvgraph.kv_cache_specs(model, 4, torch.float32)
    assert list(specs) == ["layers.1.attn"]
    caches = kvgraph.allocate_kv_caches(specs, 3, "cpu")
    kvgraph.bind_kv_cache(kvgraph.attention_layers(model), caches)
    assert len(model.enc.kv_cache) == 0 and model.dec.kv_cache is caches["layers.1.attn"]


# --- nested forward contexts --------------------------------------------------------------


def test_nested_forward_contexts():
    outer_b = random_attention_batch("mixed", 4, "gqa")
    inner_b = random_attention_batch("decode", 16, "gqa")
    assert outer_b.num_tokens != inner_b.num_tokens
    d_outer = kvgraph.BatchDescriptor(outer_b.num_tokens)
    d_inner = kvgraph.BatchDescriptor(inner_b.num_tokens, inner_b.md.num_reqs, True)

    def call(b):
        q, k, v = b.inputs
        out = torch.full_like(q, float("nan"))
        torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), out, b.scale, -1)
        return out

    with kvgraph.set_forward_context(outer_b.md, d_outer) as outer:
        assert get_forward_context() is outer
        with kvgraph.set_forward_context(inner_b.md, d_inner) as inner:
            ctx = get_forward_context()
            assert ctx is inner and ctx.attn_metadata is inner_b.md
            assert ctx.batch_descriptor == d_inner
            assert_close(call(inner_b), inner_b.ref, torch.float64)
            with pytest.raises(BatchError, match="slot_mapping"):  # the outer batch's inputs
                call(outer_b)
        ctx = get_forward_context()
        assert ctx is outer and ctx.attn_metadata is outer_b.md and ctx.batch_descriptor == d_outer

        # restored after an exception, raised by user code or by the op itself
        with pytest.raises(RuntimeError, match="boom"):
            with kvgraph.set_forward_context(inner_b.md):
                raise RuntimeError("boom")
        assert get_forward_context() is outer
        with pytest.raises(BatchError, match="slot_mapping"):
            with kvgraph.set_forward_context(inner_b.md):
                call(outer_b)
        assert get_forward_context() is outer
        check_caches(outer_b, expected=outer_b.before_caches)  # the rejected calls wrote nothing

        assert_close(call(outer_b), outer_b.ref, torch.float64)
    check_caches(outer_b)
    check_caches(inner_b)
    with pytest.raises(ForwardContextError):
        get_forward_context()
