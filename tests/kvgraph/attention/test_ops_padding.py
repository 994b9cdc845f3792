"""Padding tokens (slot -1) write nothing and output zeros; stale cache contents never leak."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvgraph
from tests.support.attention_reference import (
    D, HKV, assert_bitwise_equal, assert_close, attention_batch, check_caches, mla_batch, rand,
    random_attention_batch, random_mla_batch, run_mla_op, run_op, with_padding,
)


# --- padding ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_pad", [1, 5])
@pytest.mark.parametrize("kind", ["decode", "mixed", "prefill"])
def test_padding_tokens_write_nothing_and_output_zeros(kind, num_pad):
    b = random_attention_batch(kind, 4, "gqa")
    md, inputs = with_padding(b, num_pad)
    out = run_op(b, md=md, inputs=inputs)
    T = b.ref.shape[0]
    assert_close(out[:T], b.ref, torch.float64)
    assert torch.isfinite(out[T:]).all()
    assert (out[T:] == 0).all()
    check_caches(b)


@pytest.mark.parametrize("num_pad", [1, 3])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_mla_padding_tokens_write_nothing_and_output_zeros(kind, num_pad):
    b = random_mla_batch(kind, 4)
    md, inputs = with_padding(b, num_pad)
    out = run_mla_op(b, md=md, inputs=inputs)
    T = b.ref.shape[0]
    assert_close(out[:T], b.ref, torch.float64)
    assert (out[T:] == 0).all()
    check_caches(b)


def test_padding_after_real_slots_that_collide():
    """slot_mapping [5, 6, -1, -1]: padding must not land on (or corrupt) the real slots 5, 6."""
    chunks = [kvgraph.RequestChunk([1, 2], 1, [1])]  # positions 1, 2 in block 1 -> slots 5, 6
    b = attention_batch(chunks, 3, 4, seed=5)
    md, inputs = with_padding(b, 2)
    assert md.slot_mapping.tolist() == [5, 6, -1, -1]
    out = run_op(b, md=md, inputs=inputs)
    assert_close(out[:2], b.ref, torch.float64)
    assert (out[2:] == 0).all()
    check_caches(b)
    flat_k = b.caches[0].view(-1, HKV, D)
    assert_bitwise_equal(flat_k[5], b.inputs[1][0], "slot 5")
    assert_bitwise_equal(flat_k[6], b.inputs[1][1], "slot 6")


def test_padding_with_slot_zero_real():
    """A real token at slot 0 followed by padding (slot 0 is the fallback target of some
    implementations); the real key must land there, padding must not overwrite it."""
    chunks = [kvgraph.RequestChunk([1], 0, [0]), kvgraph.RequestChunk([2], 2, [1])]
    b = attention_batch(chunks, 2, 4, seed=6)
    md, inputs = with_padding(b, 3)
    assert md.slot_mapping.tolist() == [0, 6, -1, -1, -1]
    out = run_op(b, md=md, inputs=inputs)
    assert_close(out[:2], b.ref, torch.float64)
    assert (out[2:] == 0).all()
    check_caches(b)


@pytest.mark.parametrize("op", ["attention", "mla"])
def test_all_slots_padding_leaves_cache_unchanged(op):
    if op == "attention":
        b = random_attention_batch("mixed", 4, "gqa")
    else:
        b = random_mla_batch("mixed", 4)
    md = dataclasses.replace(b.md, slot_mapping=torch.full_like(b.md.slot_mapping, -1))
    out = run_op(b, md=md) if op == "attention" else run_mla_op(b, md=md)
    assert torch.isfinite(out).all()
    check_caches(b, expected=b.before_caches)


@pytest.mark.parametrize("op", ["attention", "mla"])
def test_batch_of_only_padding_tokens(op):
    """Metadata describing zero real tokens (as a dummy/capture batch would): every output row
    is zero and the cache is bit-for-bit unchanged."""
    chunks = [kvgraph.RequestChunk([1], 3, [2]), kvgraph.RequestChunk([1], 0, [0])]
    make = attention_batch if op == "attention" else mla_batch
    b = make(chunks, 3, 4, seed=8)
    T = 4
    md = kvgraph.AttentionMetadata(
        slot_mapping=torch.full((T,), -1, dtype=torch.int64),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        seq_lens=torch.zeros(1, dtype=torch.int32),
        query_start_loc=torch.zeros(2, dtype=torch.int32),
        block_size=4, num_actual_tokens=0, num_reqs=1, num_decode_tokens=0,
        num_prefill_tokens=0, max_query_len=1, max_seq_len=4,
    )
    gen = torch.Generator().manual_seed(3)
    inputs = [rand(gen, T, *t.shape[1:]) for t in b.inputs]
    out = (run_op if op == "attention" else run_mla_op)(b, md=md, inputs=inputs)
    assert (out == 0).all()
    check_caches(b, expected=b.before_caches)


def test_stale_nonfinite_cache_contents_do_not_leak():
    """Slots past a request's sequence hold stale data from earlier requests; even when that is
    inf/NaN (an fp16 overflow in some earlier request), the output depends only on positions
    <= the query's own."""
    chunks = [kvgraph.RequestChunk([1], 5, [3, 1])]  # positions 0..5; block 1 offsets 2, 3 unused
    b = attention_batch(chunks, 4, 4, seed=12)
    b.caches[1][1, 3] = float("nan")
    b.caches[0][1, 3] = float("inf")
    out = run_op(b)
    assert_close(out, b.ref, torch.float64)
