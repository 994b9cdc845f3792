"""build_attention_metadata / build_model_inputs against slots and offsets computed here, the
builder's errors, and BatchDescriptor as a graph key.

Every expected value is computed in this file from the chunks alone (plain Python ints), never
by calling the code under test.
"""

import dataclasses
import random
import re

import pytest
import torch

import kvgraph
from kvgraph import BatchError


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def random_chunks(rng: random.Random, block_size: int, num_reqs: int, kinds=None):
    """Random chunks (decode, prefill, chunked prefill) over shuffled, disjoint block ids."""
    kinds = kinds or ["decode", "prefill", "chunked"]
    shapes = []
    for _ in range(num_reqs):
        kind = rng.choice(kinds)
        if kind == "decode":
            shapes.append((rng.randint(1, 50), 1))
        elif kind == "prefill":
            shapes.append((0, rng.randint(1, 30)))
        else:
            shapes.append((rng.randint(1, 40), rng.randint(2, 20)))
    needed = [cdiv(nc + n, block_size) for nc, n in shapes]
    pool = list(range(sum(needed) + rng.randint(0, 5)))
    rng.shuffle(pool)
    chunks, at = [], 0
    for (nc, n), k in zip(shapes, needed):
        tokens = [rng.randrange(32000) for _ in range(n)]
        chunks.append(kvgraph.RequestChunk(tokens, nc, pool[at:at + k]))
        at += k
    return chunks


def expected_slots(chunks, block_size):
    return [
        c.block_ids[pos // block_size] * block_size + pos % block_size
        for c in chunks
        for pos in range(c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids))
    ]


def check_metadata(md, chunks, block_size):
    query_lens = [len(c.token_ids) for c in chunks]
    seq_lens = [c.num_computed_tokens + len(c.token_ids) for c in chunks]
    needed = [cdiv(s, block_size) for s in seq_lens]
    num_tokens = sum(query_lens)

    assert md.slot_mapping.dtype == torch.int64
    assert md.slot_mapping.tolist() == expected_slots(chunks, block_size)

    assert md.block_table.dtype == torch.int32
    assert tuple(md.block_table.shape) == (len(chunks), max(needed))
    for r, c in enumerate(chunks):
        row = list(c.block_ids[:needed[r]]) + [0] * (max(needed) - needed[r])
        assert md.block_table[r].tolist() == row, f"block table row {r}"

    assert md.seq_lens.dtype == torch.int32
    assert md.seq_lens.tolist() == seq_lens
    assert md.query_start_loc.dtype == torch.int32
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    assert md.query_start_loc.tolist() == starts

    decode = sum(q for q in query_lens if q == 1)
    assert md.num_decode_tokens == decode
    assert md.num_prefill_tokens == num_tokens - decode
    assert md.uniform_decode == (decode == num_tokens)
    assert md.block_size == block_size
    assert md.num_reqs == len(chunks)
    assert md.num_actual_tokens == num_tokens
    assert md.max_query_len == max(query_lens)
    assert md.max_seq_len == max(seq_lens)
    for t in (md.slot_mapping, md.block_table, md.seq_lens, md.query_start_loc):
        assert t.device.type == "cpu"


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("seed", range(4))
def test_metadata_random_batches(block_size, seed):
    rng = random.Random(1000 * block_size + seed)
    chunks = random_chunks(rng, block_size, rng.randint(1, 6))
    md = kvgraph.build_attention_metadata(chunks, block_size, "cpu")
    check_metadata(md, chunks, block_size)


@pytest.mark.parametrize("kind", ["decode", "prefill", "chunked"])
def test_metadata_single_kind_batches(kind):
    rng = random.Random(kind)
    for block_size in (1, 4, 16):
        chunks = random_chunks(rng, block_size, 4, kinds=[kind])
        md = kvgraph.build_attention_metadata(chunks, block_size, "cpu")
        check_metadata(md, chunks, block_size)
        if kind == "decode":
            assert md.num_prefill_tokens == 0 and md.uniform_decode
            assert md.max_query_len == 1


def test_metadata_hand_checked_example():
    """A small batch whose every value is written out by hand."""
    chunks = [
        kvgraph.RequestChunk([11, 12, 13], 0, [7]),  # positions 0..2 in block 7
        kvgraph.RequestChunk([21], 5, [2, 9]),  # position 5 -> block 9 offset 1
        kvgraph.RequestChunk([31, 32], 3, [4, 0]),  # positions 3, 4 -> block 4 off 3, block 0 off 0
    ]
    md = kvgraph.build_attention_metadata(chunks, 4, "cpu")
    assert md.slot_mapping.tolist() == [28, 29, 30, 37, 19, 0]
    assert md.block_table.tolist() == [[7, 0], [2, 9], [4, 0]]
    assert md.seq_lens.tolist() == [3, 6, 5]
    assert md.query_start_loc.tolist() == [0, 3, 4, 6]
    assert (md.num_decode_tokens, md.num_prefill_tokens) == (1, 5)
    assert (md.max_query_len, md.max_seq_len, md.num_reqs, md.num_actual_tokens) == (3, 6, 3, 6)
    ids, pos = kvgraph.build_model_inputs(chunks, "cpu")
    assert ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert pos.tolist() == [0, 1, 2, 5, 3, 4]


def test_one_token_chunks_count_as_decode_tokens():
    """Decode tokens are those of requests adding exactly one token, a first step included."""
    chunks = [
        kvgraph.RequestChunk([5], 0, [0]),  # a one-token prompt: adds exactly one token
        kvgraph.RequestChunk([6], 9, [1, 2, 3]),
        kvgraph.RequestChunk([7, 8], 0, [4]),
        kvgraph.RequestChunk([9, 10], 6, [5, 6]),
    ]
    md = kvgraph.build_attention_metadata(chunks, 4, "cpu")
    assert (md.num_decode_tokens, md.num_prefill_tokens) == (2, 4)
    assert not md.uniform_decode
    md = kvgraph.build_attention_metadata(chunks[:2], 4, "cpu")
    assert (md.num_decode_tokens, md.num_prefill_tokens) == (2, 0)
    assert md.uniform_decode and md.max_query_len == 1


def test_metadata_extra_block_ids_do_not_change_slots():
    """A block table longer than the sequence needs (blocks reserved ahead) is accepted."""
    chunks = [kvgraph.RequestChunk([1, 2], 1, [5, 3, 8, 6]), kvgraph.RequestChunk([3], 0, [1, 2])]
    md = kvgraph.build_attention_metadata(chunks, 2, "cpu")
    assert md.slot_mapping.tolist() == [11, 6, 2]
    assert md.block_table[0, :2].tolist() == [5, 3]
    assert md.block_table[1, 0].item() == 1
    assert md.seq_lens.tolist() == [3, 1]


@pytest.mark.parametrize("seed", range(3))
def test_model_inputs_match_metadata_order(seed):
    rng = random.Random(seed)
    block_size = 4
    chunks = random_chunks(rng, block_size, 5)
    input_ids, positions = kvgraph.build_model_inputs(chunks, "cpu")
    assert input_ids.dtype == torch.long and positions.dtype == torch.long
    assert input_ids.tolist() == [t for c in chunks for t in c.token_ids]
    assert positions.tolist() == [
        p for c in chunks
        for p in range(c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids))
    ]
    # Same order as the metadata: each token's slot is its position's slot in its request.
    md = kvgraph.build_attention_metadata(chunks, block_size, "cpu")
    owner = [r for r, c in enumerate(chunks) for _ in c.token_ids]
    for t, (r, p) in enumerate(zip(owner, positions.tolist())):
        c = chunks[r]
        slot = c.block_ids[p // block_size] * block_size + p % block_size
        assert md.slot_mapping[t].item() == slot


# --- errors ---------------------------------------------------------------------------------


def ok_chunk():
    return kvgraph.RequestChunk([1, 2], 2, [0])


def test_error_block_table_too_short():
    chunks = [ok_chunk(), ok_chunk(), kvgraph.RequestChunk([1, 2, 3], 6, [1, 2])]
    with pytest.raises(BatchError) as info:
        kvgraph.build_attention_metadata(chunks, 4, "cpu")
    msg = str(info.value)
    # names the chunk, the sequence length (9), the blocks needed (3) and the blocks given (2)
    numbers = [int(n) for n in re.findall(r"-?\d+", msg)]
    assert "chunk 2" in msg
    assert 9 in numbers and 3 in numbers and numbers.count(2) >= 2, msg


def test_error_block_table_off_by_one():
    """Exactly one block too few is caught (seq_len 5, block_size 4 needs 2 blocks)."""
    with pytest.raises(BatchError, match="chunk 0"):
        kvgraph.build_attention_metadata([kvgraph.RequestChunk([1], 4, [3])], 4, "cpu")
    # and exactly enough is fine
    kvgraph.build_attention_metadata([kvgraph.RequestChunk([1], 3, [3])], 4, "cpu")


def test_error_empty_chunk():
    with pytest.raises(BatchError, match="chunk 1") as info:
        kvgraph.build_attention_metadata([ok_chunk(), kvgraph.RequestChunk([], 3, [0])], 4, "cpu")
    assert "token" in str(info.value)


def test_error_negative_num_computed_tokens():
    with pytest.raises(BatchError, match="chunk 1") as info:
        kvgraph.build_attention_metadata([ok_chunk(), kvgraph.RequestChunk([1], -3, [0])], 4, "cpu")
    assert "num_computed_tokens" in str(info.value) and "-3" in str(info.value)


def test_error_no_chunks():
    with pytest.raises(BatchError, match="at least one"):
        kvgraph.build_attention_metadata([], 4, "cpu")


@pytest.mark.parametrize("block_size", [0, -1])
def test_error_block_size(block_size):
    with pytest.raises(BatchError, match="block_size") as info:
        kvgraph.build_attention_metadata([ok_chunk()], block_size, "cpu")
    assert str(block_size) in str(info.value)


def test_error_negative_block_id():
    chunks = [ok_chunk(), kvgraph.RequestChunk([1, 2], 3, [4, -2])]
    with pytest.raises(BatchError, match="chunk 1") as info:
        kvgraph.build_attention_metadata(chunks, 4, "cpu")
    assert "-2" in str(info.value)


def test_batch_error_is_a_value_error():
    assert issubclass(BatchError, ValueError)


# --- BatchDescriptor --------------------------------------------------------------------------


def test_batch_descriptor_defaults_equality_and_hash():
    d = kvgraph.BatchDescriptor(8)
    assert (d.num_tokens, d.num_reqs, d.uniform_decode) == (8, None, False)
    a = kvgraph.BatchDescriptor(16, 16, True)
    b = kvgraph.BatchDescriptor(num_tokens=16, num_reqs=16, uniform_decode=True)
    assert a == b and hash(a) == hash(b) and a is not b
    assert a != kvgraph.BatchDescriptor(16, 16, False)
    assert a != kvgraph.BatchDescriptor(16, None, True)
    assert a != kvgraph.BatchDescriptor(16, 4, True, query_len=4)
    assert a != kvgraph.BatchDescriptor(32, 32, True)
    graphs = {a: "g1", kvgraph.BatchDescriptor(16): "g2"}
    assert graphs[b] == "g1" and graphs[kvgraph.BatchDescriptor(16, None, False)] == "g2"
    assert len({a, b, kvgraph.BatchDescriptor(16)}) == 2


def test_batch_descriptor_is_frozen():
    d = kvgraph.BatchDescriptor(4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.num_tokens = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.uniform_decode = True
    assert d == kvgraph.BatchDescriptor(4, 2)


@pytest.mark.parametrize("num_tokens", [0, -1])
def test_batch_descriptor_rejects_num_tokens_below_one(num_tokens):
    with pytest.raises(ValueError, match="num_tokens"):
        kvgraph.BatchDescriptor(num_tokens)


@pytest.mark.parametrize("num_reqs", [5, 0, -1])
def test_batch_descriptor_rejects_bad_num_reqs(num_reqs):
    with pytest.raises(ValueError, match="num_reqs"):
        kvgraph.BatchDescriptor(4, num_reqs)


def test_batch_descriptor_accepts_edges():
    assert kvgraph.BatchDescriptor(1, 1, True).num_reqs == 1
    assert kvgraph.BatchDescriptor(4, 4).num_reqs == 4


def test_block_ids_beyond_int32_and_unused_negative_ids_are_rejected():
    with pytest.raises(BatchError, match=r"chunk 0: block ids must lie in \[0, 2147483647\)"):
        kvgraph.build_attention_metadata([kvgraph.RequestChunk([1], 0, [2**31])], 4)
    with pytest.raises(BatchError, match="chunk 1: block ids"):
        kvgraph.build_attention_metadata(
            [kvgraph.RequestChunk([1], 0, [0]), kvgraph.RequestChunk([1], 0, [3, 7, -1])], 4)


def test_block_table_rows_hold_only_the_blocks_a_sequence_uses():
    md = kvgraph.build_attention_metadata(
        [kvgraph.RequestChunk([1] * 9, 0, [5, 6, 7]), kvgraph.RequestChunk([1], 0, [3, 8, 9])], 4)
    assert md.block_table.tolist() == [[5, 6, 7], [3, 0, 0]]
