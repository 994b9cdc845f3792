"""Rejected calls: outside a forward context, bad shapes, bad caches, a batch whose metadata does
not match; each names what is wrong and leaves the caches bit for bit unchanged."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import kvgraph
from kvgraph import BatchError, ForwardContextError, KVCacheError
from kvgraph.forward_context import get_forward_context
from tests.support.attention_reference import (
    D, H, HEAD_CONFIGS, HKV, LAYER, LORA, ROPE, assert_bitwise_equal, check_caches,
    encoder_batch, random_attention_batch, random_mla_batch,
)


# --- errors -------------------------------------------------------------------------------


def small_batch():
    return random_attention_batch("mixed", 4, "gqa")


def test_op_outside_forward_context():
    b = small_batch()
    q, k, v = b.inputs
    with pytest.raises(ForwardContextError, match="set_forward_context"):
        torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), torch.empty_like(q), 0.1, -1)
    m = random_mla_batch("mixed", 4)
    with pytest.raises(ForwardContextError, match="set_forward_context"):
        torch.ops.kvgraph.unified_mla_attention(*m.inputs, list(m.caches),
                                                torch.empty_like(m.inputs[0]), 0.1)
    with pytest.raises(ForwardContextError, match="set_forward_context"):
        torch.ops.kvgraph.encoder_attention(q, k, v, torch.empty_like(q), 0.1)
    with pytest.raises(ForwardContextError, match="set_forward_context"):
        get_forward_context()
    check_caches(b, expected=b.before_caches)  # nothing written
    check_caches(m, expected=m.before_caches)


def test_layer_outside_forward_context():
    b = small_batch()
    num_heads, num_kv_heads = HEAD_CONFIGS["gqa"]
    layer = kvgraph.Attention(num_heads, D, b.scale, num_kv_heads, LAYER)
    kvgraph.bind_kv_cache({LAYER: layer}, {LAYER: tuple(b.caches)})
    T = b.num_tokens
    with pytest.raises(ForwardContextError) as info:
        layer(*(t.reshape(T, -1) for t in b.inputs))
    msg = str(info.value)
    assert "set_forward_context" in msg and "build_attention_metadata" in msg
    mla = kvgraph.MLAAttention(H, LORA, ROPE, 0.1, "model.layers.1.attn")
    m = random_mla_batch("decode", 4)
    kvgraph.bind_kv_cache({"model.layers.1.attn": mla}, {"model.layers.1.attn": tuple(m.caches)})
    with pytest.raises(ForwardContextError, match="set_forward_context"):
        mla(*m.inputs)
    enc = kvgraph.Attention(H, D, 0.1, HKV, "enc", attn_type="encoder_only")
    q = torch.randn(3, H * D)
    with pytest.raises(ForwardContextError, match="set_forward_context"):
        enc(q, torch.randn(3, HKV * D), torch.randn(3, HKV * D))
    check_caches(b, expected=b.before_caches)
    check_caches(m, expected=m.before_caches)


NO_METADATA = re.escape("the forward context has no attn_metadata; attention needs one (build "
                        "it with kvgraph.build_attention_metadata)")


def test_forward_context_without_metadata():
    b = small_batch()
    q, k, v = b.inputs
    m = random_mla_batch("mixed", 4)
    with kvgraph.set_forward_context(None):
        with pytest.raises(ForwardContextError, match=NO_METADATA):
            torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), torch.empty_like(q), 0.1,
                                                -1)
        with pytest.raises(ForwardContextError, match=NO_METADATA):
            torch.ops.kvgraph.unified_mla_attention(*m.inputs, list(m.caches),
                                                    torch.empty_like(m.inputs[0]), 0.1)
        with pytest.raises(ForwardContextError, match=NO_METADATA):
            torch.ops.kvgraph.encoder_attention(q, k, v, torch.empty_like(q), 0.1)
    check_caches(b, expected=b.before_caches)  # nothing written
    check_caches(m, expected=m.before_caches)


def refused_twice(md, op, *args) -> str:
    """The ValueError message of `op(*args)` under `md`, raised again when the call is repeated:
    a refused shape signature must not be remembered as checked."""
    messages = []
    for _ in range(2):
        with kvgraph.set_forward_context(md):
            with pytest.raises(ValueError) as info:
                op(*args)
        messages.append(str(info.value))
    assert messages[0] == messages[1], messages
    return messages[0]


def _shape_error(b, q, k, v, caches, out, bad):
    msg = refused_twice(b.md, torch.ops.kvgraph.unified_attention,
                        q, k, v, caches, out, b.scale, -1)
    assert "expected" in msg and "got" in msg, msg
    assert str(bad) in msg, f"{bad} not named in: {msg}"
    check_caches(b, expected=b.before_caches)  # a rejected call writes nothing


def test_unified_attention_shape_errors():
    b = small_batch()
    q, k, v = b.inputs
    T, Hq, Dh = q.shape
    Hk = k.shape[1]
    kc, vc = b.caches
    out = torch.empty_like(q)
    cases = {
        "key head size": (q, k[..., :-1], v, [kc, vc], out, (T, Hk, Dh - 1)),
        "key tokens": (q, k[:-1], v, [kc, vc], out, (T - 1, Hk, Dh)),
        "value kv heads": (q, k, torch.cat([v, v[:, :1]], 1), [kc, vc], out, (T, Hk + 1, Dh)),
        "out head size": (q, k, v, [kc, vc], out[..., :-1], (T, Hq, Dh - 1)),
        "out heads": (q, k, v, [kc, vc], out[:, :-1], (T, Hq - 1, Dh)),
        "key cache row": (q, k, v, [kc[..., :-1].contiguous(), vc], out, (Hk, Dh - 1)),
        "value cache row": (q, k, v, [kc, vc[:, :, :1].contiguous()], out, (1, Dh)),
        "one cache tensor": (q, k, v, [kc], out, ((Hk, Dh),)),
        "three cache tensors": (q, k, v, [kc, vc, vc.clone()], out, ((Hk, Dh),) * 3),
    }
    for name, (*args, bad) in cases.items():
        try:
            _shape_error(b, *args, bad)
        except BaseException as e:
            raise AssertionError(f"case {name!r}") from e


def test_unified_mla_attention_shape_errors():
    b = random_mla_batch("mixed", 4)
    ql, qp, kv_c, k_pe = b.inputs
    T = ql.shape[0]
    cc, pc = b.caches
    out = torch.empty_like(ql)
    cases = {
        "q_pe heads": (ql, qp[:, :-1], kv_c, k_pe, [cc, pc], out, (T, H - 1, ROPE)),
        "kv_c rank": (ql, qp, kv_c[:, :-1], k_pe, [cc, pc], out, (T, LORA - 1)),
        "k_pe tokens": (ql, qp, kv_c, k_pe[:-1], [cc, pc], out, (T - 1, ROPE)),
        "out rank": (ql, qp, kv_c, k_pe, [cc, pc], out[..., :-1], (T, H, LORA - 1)),
        "kv_c cache row": (ql, qp, kv_c, k_pe, [cc[..., :-1].contiguous(), pc], out, (LORA - 1,)),
        "k_pe cache row": (ql, qp, kv_c, k_pe, [cc, pc[..., :-1].contiguous()], out, (ROPE - 1,)),
    }
    for name, (*args, bad) in cases.items():
        msg = refused_twice(b.md, torch.ops.kvgraph.unified_mla_attention, *args, b.scale)
        assert "expected" in msg and "got" in msg and str(bad) in msg, (name, msg)
        check_caches(b, expected=b.before_caches)


def test_encoder_attention_shape_errors():
    md, q, k, v, _ = encoder_batch()
    T = q.shape[0]
    out = torch.empty_like(q)
    cases = {
        "key head size": (q, k[..., :-1], v, out, (T, HKV, D - 1)),
        "value not like key": (q, k, v[:, :1], out, (T, 1, D)),
        "out": (q, k, v, out[:, :-1], (T, H - 1, D)),
    }
    for name, (*args, bad) in cases.items():
        msg = refused_twice(md, torch.ops.kvgraph.encoder_attention, *args, 0.3)
        assert "expected" in msg and "got" in msg and str(bad) in msg, (name, msg)


def test_unified_attention_rejects_heads_not_multiple_of_kv_heads():
    b = random_attention_batch("decode", 4, "gqa")  # q has 6 heads, k/v 2
    q, k, v = b.inputs
    q5 = q[:, :5].contiguous()
    msg = refused_twice(b.md, torch.ops.kvgraph.unified_attention, q5, k, v, list(b.caches),
                        torch.empty_like(q5), b.scale, -1)
    assert ("query has 5 heads and key 2: expected num_heads to be a multiple of "
            "num_kv_heads") in msg, msg
    check_caches(b, expected=b.before_caches)


def test_unified_attention_rejects_cache_block_size_mismatch():
    b = random_attention_batch("decode", 4, "gqa")
    q, k, v = b.inputs
    # the same bytes viewed as blocks of 2: rows match, [num_blocks, block_size] does not
    caches = [c.view(-1, 2, *c.shape[2:]) for c in b.caches]
    num_blocks = b.caches[0].shape[0]
    msg = refused_twice(b.md, torch.ops.kvgraph.unified_attention, q, k, v, caches,
                        torch.empty_like(q), b.scale, -1)
    assert "kv_cache: expected every tensor to be [num_blocks, block_size=4, ...]" in msg, msg
    assert msg.endswith(f"got leading dims {[(2 * num_blocks, 2)] * 2}"), msg
    check_caches(b, expected=b.before_caches)


def test_unified_attention_rejects_mismatched_cache_pair():
    b = random_attention_batch("decode", 4, "gqa")
    q, k, v = b.inputs
    kc, vc = b.caches
    big_vc = torch.cat([vc, vc])  # twice the blocks: a block id no longer addresses the same bytes
    big_vc_before = big_vc.clone()
    num_blocks = kc.shape[0]
    msg = refused_twice(b.md, torch.ops.kvgraph.unified_attention, q, k, v, [kc, big_vc],
                        torch.empty_like(q), b.scale, -1)
    assert "with one num_blocks (a block id must address the same slots in each)" in msg, msg
    assert msg.endswith(f"got leading dims {[(num_blocks, 4), (2 * num_blocks, 4)]}"), msg
    check_caches(b, expected=b.before_caches)  # the key cache
    assert_bitwise_equal(big_vc, big_vc_before, "the value cache passed")


def slot_mapping_mismatch(num_tokens: int, num_slots: int) -> str:
    """The BatchError message (a regex) for inputs of `num_tokens` and a longer/shorter batch."""
    return re.escape(f"the batch has {num_tokens} tokens but its slot_mapping has {num_slots};")


def test_slot_mapping_length_mismatch():
    b = small_batch()
    q, k, v = b.inputs
    short = dataclasses.replace(b.md, slot_mapping=b.md.slot_mapping[:-1])
    with kvgraph.set_forward_context(short):
        with pytest.raises(BatchError, match=slot_mapping_mismatch(b.num_tokens,
                                                                   b.num_tokens - 1)):
            torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), torch.empty_like(q),
                                                b.scale, -1)
    check_caches(b, expected=b.before_caches)
    m = random_mla_batch("mixed", 4)
    long = dataclasses.replace(m.md, slot_mapping=torch.cat([m.md.slot_mapping, m.md.slot_mapping]))
    with kvgraph.set_forward_context(long):
        with pytest.raises(BatchError, match=slot_mapping_mismatch(m.num_tokens,
                                                                   2 * m.num_tokens)):
            torch.ops.kvgraph.unified_mla_attention(*m.inputs, list(m.caches),
                                                    torch.empty_like(m.inputs[0]), m.scale)
    check_caches(m, expected=m.before_caches)
    md, q, k, v, _ = encoder_batch()
    with kvgraph.set_forward_context(dataclasses.replace(md, slot_mapping=md.slot_mapping[:2])):
        with pytest.raises(BatchError, match=slot_mapping_mismatch(q.shape[0], 2)):
            torch.ops.kvgraph.encoder_attention(q, k, v, torch.empty_like(q), 0.3)


def test_layer_without_cache_raises_kv_cache_error():
    b = small_batch()
    num_heads, num_kv_heads = HEAD_CONFIGS["gqa"]
    layer = kvgraph.Attention(num_heads, D, b.scale, num_kv_heads, LAYER)
    T = b.num_tokens
    with kvgraph.set_forward_context(b.md):
        with pytest.raises(KVCacheError) as info:
            layer(*(t.reshape(T, -1) for t in b.inputs))
    assert LAYER in str(info.value) and "bind_kv_cache" in str(info.value)
    m = random_mla_batch("decode", 4)
    mla = kvgraph.MLAAttention(H, LORA, ROPE, 0.1, "model.layers.3.mla")
    with kvgraph.set_forward_context(m.md):
        with pytest.raises(KVCacheError, match="model.layers.3.mla"):
            mla(*m.inputs)
