"""kvgraph's attention ops and layers against a dense float64 reference written here.

Each batch is built from random request chunks over shuffled block ids. The test writes every
request's cached prefix into the paged cache itself (slot = block_ids[pos // bs] * bs + pos % bs),
keeps the full key/value sequences, and computes the expected output token by token with plain
softmax attention. After each op the whole cache is compared bit for bit with what it must hold:
the new keys/values at exactly their slots, everything else untouched.
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvgraph
from kvgraph import ForwardContextError, KVCacheError

H, HKV, D = 4, 2, 8  # default heads / kv heads / head size
LORA, ROPE = 16, 4  # MLA latent and rope dims
HEAD_CONFIGS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
KINDS = ("decode", "prefill", "mixed", "chunked")
BLOCK_SIZES = (1, 4, 16)
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}
INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
LAYER = "model.layers.0.self_attn.attn"


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --- the reference ----------------------------------------------------------------------------


def ref_attention(q, k, v, num_computed, scale, window=None):
    """q [n, H, D] at positions num_computed.., k/v [S, Hkv, *] the full sequence (float64)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    rows = []
    for j in range(q.shape[0]):
        pos = num_computed + j
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,khd->hk", q[j], k[lo:pos + 1]) * scale
        rows.append(torch.einsum("hk,khd->hd", scores.softmax(-1), v[lo:pos + 1]))
    return torch.stack(rows)


def ref_mla(q_latent, q_pe, kv_c, k_pe, num_computed, scale):
    """q_latent [n, H, L], q_pe [n, H, R], kv_c [S, L], k_pe [S, R] -> [n, H, L] (float64)."""
    rows = []
    for j in range(q_latent.shape[0]):
        pos = num_computed + j
        scores = (q_latent[j] @ kv_c[:pos + 1].T + q_pe[j] @ k_pe[:pos + 1].T) * scale  # [H, K]
        rows.append(scores.softmax(-1) @ kv_c[:pos + 1])
    return torch.stack(rows)


def ref_encoder(q, k, v, scale):
    """Bidirectional attention within one request's tokens: q [n, H, D], k/v [n, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


# --- batches ----------------------------------------------------------------------------------


def request_shapes(kind: str, rng: random.Random) -> list[tuple[int, int]]:
    """(num_computed_tokens, num_new_tokens) per request."""
    if kind == "decode":
        return [(rng.randint(1, 40), 1) for _ in range(rng.randint(2, 4))]
    if kind == "prefill":
        return [(0, rng.randint(2, 18)) for _ in range(rng.randint(1, 3))]
    if kind == "chunked":
        return [(rng.randint(1, 30), rng.randint(2, 12)) for _ in range(rng.randint(1, 3))]
    assert kind == "mixed"
    shapes = [(0, rng.randint(2, 15)), (rng.randint(1, 30), 1), (rng.randint(1, 25),
              rng.randint(2, 10)), (rng.randint(1, 20), 1), (0, 1)]
    rng.shuffle(shapes)
    return shapes


def make_chunks(shapes, block_size: int, rng: random.Random):
    """Chunks over shuffled, disjoint block ids; some blocks stay unused."""
    needed = [cdiv(nc + n, block_size) for nc, n in shapes]
    num_blocks = sum(needed) + rng.randint(1, 4)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    chunks, at = [], 0
    for (nc, n), k in zip(shapes, needed):
        chunks.append(kvgraph.RequestChunk([rng.randrange(1000) for _ in range(n)], nc,
                                           ids[at:at + k]))
        at += k
    return chunks, num_blocks


def block_and_offset(chunk, pos: int, block_size: int) -> tuple[int, int]:
    return chunk.block_ids[pos // block_size], pos % block_size


def rand(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def garbage(gen, shape, dtype):
    """Finite junk for a fresh cache, with some signed zeros (a rewrite through arithmetic
    would turn -0.0 into 0.0, which a bit-for-bit comparison sees)."""
    t = rand(gen, *shape, dtype=dtype)
    t.view(-1)[::5] = -0.0
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.dtype])


def assert_bitwise_equal(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    differ = bits(got) != bits(expected)
    assert not differ.any(), (
        f"{what}: {int(differ.sum())} elements differ, first at {differ.nonzero()[:4].tolist()}"
    )


def assert_close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.double(), expected, **TOL[dtype])


class OpRecorder(TorchDispatchMode):
    """Records every op; kvgraph ops (and other non-aten ops) are re-run under the mode so the
    aten ops their implementations call are recorded too."""

    CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.bool_indexing = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func))
        if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_put,
                                   torch.ops.aten.index_put_):
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype == torch.bool for i in indices):
                self.bool_indexing = True  # a data-dependent shape: nonzero, i.e. a host sync
        if func.namespace not in ("aten", "prim", "prims"):
            with self:
                return func.redispatch(self.CPU, *args, **kwargs)
        return func(*args, **kwargs)


@dataclasses.dataclass
class Batch:
    """One step: inputs, the caches (prefixes written), and what the op must produce."""

    chunks: list
    md: kvgraph.AttentionMetadata
    block_size: int
    dtype: torch.dtype
    scale: float
    inputs: list  # q, k, v  /  q_latent, q_pe, kv_c, k_pe  (flat over tokens)
    caches: list
    expected_caches: list  # bit-exact contents after the op
    before_caches: list  # contents before the op
    ref: torch.Tensor  # float64 expected output [T, H, Dv]

    @property
    def num_tokens(self) -> int:
        return self.inputs[0].shape[0]


def attention_batch(chunks, num_blocks, block_size, num_heads=H, num_kv_heads=HKV, head_size=D,
                    dtype=torch.float64, seed=0, window=None) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    scale = 0.5 / head_size ** 0.5 + 0.1
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache, value_cache = garbage(gen, shape, dtype), garbage(gen, shape, dtype)
    qs, ks, vs, refs, new_slots = [], [], [], [], []
    for c in chunks:
        nc, seq = c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids)
        keys = rand(gen, seq, num_kv_heads, head_size, dtype=dtype)
        values = rand(gen, seq, num_kv_heads, head_size, dtype=dtype)
        query = rand(gen, seq - nc, num_heads, head_size, dtype=dtype)
        for pos in range(nc):  # the cached prefix, written by the test
            b, o = block_and_offset(c, pos, block_size)
            key_cache[b, o], value_cache[b, o] = keys[pos], values[pos]
        new_slots += [(block_and_offset(c, pos, block_size), keys[pos], values[pos])
                      for pos in range(nc, seq)]
        qs.append(query)
        ks.append(keys[nc:])
        vs.append(values[nc:])
        refs.append(ref_attention(query.double(), keys.double(), values.double(), nc, scale,
                                  window))
    before = [key_cache.clone(), value_cache.clone()]
    expected = [key_cache.clone(), value_cache.clone()]
    for (b, o), key, value in new_slots:
        expected[0][b, o], expected[1][b, o] = key, value
    md = kvgraph.build_attention_metadata(chunks, block_size, "cpu")
    inputs = [torch.cat(qs), torch.cat(ks), torch.cat(vs)]
    return Batch(chunks, md, block_size, dtype, scale, inputs, [key_cache, value_cache], expected,
                 before, torch.cat(refs))


def mla_batch(chunks, num_blocks, block_size, num_heads=H, dtype=torch.float64, seed=0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    scale = 0.23
    kv_c_cache = garbage(gen, (num_blocks, block_size, LORA), dtype)
    k_pe_cache = garbage(gen, (num_blocks, block_size, ROPE), dtype)
    q_lat, q_pe, kv_c_new, k_pe_new, refs, new_slots = [], [], [], [], [], []
    for c in chunks:
        nc, seq = c.num_computed_tokens, c.num_computed_tokens + len(c.token_ids)
        kv_c, k_pe = rand(gen, seq, LORA, dtype=dtype), rand(gen, seq, ROPE, dtype=dtype)
        ql = rand(gen, seq - nc, num_heads, LORA, dtype=dtype)
        qp = rand(gen, seq - nc, num_heads, ROPE, dtype=dtype)
        for pos in range(nc):
            b, o = block_and_offset(c, pos, block_size)
            kv_c_cache[b, o], k_pe_cache[b, o] = kv_c[pos], k_pe[pos]
        new_slots += [(block_and_offset(c, pos, block_size), kv_c[pos], k_pe[pos])
                      for pos in range(nc, seq)]
        q_lat.append(ql)
        q_pe.append(qp)
        kv_c_new.append(kv_c[nc:])
        k_pe_new.append(k_pe[nc:])
        refs.append(ref_mla(ql.double(), qp.double(), kv_c.double(), k_pe.double(), nc, scale))
    before = [kv_c_cache.clone(), k_pe_cache.clone()]
    expected = [kv_c_cache.clone(), k_pe_cache.clone()]
    for (b, o), a, r in new_slots:
        expected[0][b, o], expected[1][b, o] = a, r
    md = kvgraph.build_attention_metadata(chunks, block_size, "cpu")
    inputs = [torch.cat(q_lat), torch.cat(q_pe), torch.cat(kv_c_new), torch.cat(k_pe_new)]
    return Batch(chunks, md, block_size, dtype, scale, inputs, [kv_c_cache, k_pe_cache], expected,
                 before, torch.cat(refs))


def random_attention_batch(kind, block_size, heads="gqa", dtype=torch.float64, window=None,
                           head_size=D) -> Batch:
    seed = seed_of("attn", kind, block_size, heads, str(dtype), window)
    rng = random.Random(seed)
    chunks, num_blocks = make_chunks(request_shapes(kind, rng), block_size, rng)
    num_heads, num_kv_heads = HEAD_CONFIGS[heads]
    return attention_batch(chunks, num_blocks, block_size, num_heads, num_kv_heads, head_size,
                           dtype, seed, window)


def random_mla_batch(kind, block_size, dtype=torch.float64) -> Batch:
    seed = seed_of("mla", kind, block_size, str(dtype))
    rng = random.Random(seed)
    chunks, num_blocks = make_chunks(request_shapes(kind, rng), block_size, rng)
    return mla_batch(chunks, num_blocks, block_size, dtype=dtype, seed=seed)


def run_op(b: Batch, window=None, md=None, inputs=None) -> torch.Tensor:
    q, k, v = inputs or b.inputs
    out = torch.full_like(q, float("nan"))
    with kvgraph.set_forward_context(md or b.md):
        result = torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), out, b.scale,
                                                     -1 if window is None else window)
    assert result is None
    return out


def run_mla_op(b: Batch, md=None, inputs=None) -> torch.Tensor:
    q_latent, q_pe, kv_c, k_pe = inputs or b.inputs
    out = torch.full_like(q_latent, float("nan"))
    with kvgraph.set_forward_context(md or b.md):
        result = torch.ops.kvgraph.unified_mla_attention(q_latent, q_pe, kv_c, k_pe, list(b.caches),
                                                         out, b.scale)
    assert result is None
    return out


def check_caches(b: Batch, expected=None) -> None:
    for i, (got, want) in enumerate(zip(b.caches, expected or b.expected_caches)):
        assert_bitwise_equal(got, want, f"cache tensor {i}")


def check_inputs_unchanged(b: Batch, originals) -> None:
    for i, (got, want) in enumerate(zip(b.inputs, originals)):
        assert_bitwise_equal(got, want, f"input {i}")


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


# --- MLA ----------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_unified_mla_attention_matches_reference(kind, block_size):
    b = random_mla_batch(kind, block_size)
    originals = [t.clone() for t in b.inputs]
    out = run_mla_op(b)
    assert_close(out, b.ref, torch.float64)
    check_caches(b)
    check_inputs_unchanged(b, originals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unified_mla_attention_low_precision(dtype):
    b = random_mla_batch("mixed", 4, dtype)
    out = run_mla_op(b)
    assert out.dtype == dtype
    assert_close(out, b.ref, dtype)
    check_caches(b)


@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
def test_mla_layer_matches_reference(kind):
    b = random_mla_batch(kind, 4)
    layer = kvgraph.MLAAttention(H, LORA, ROPE, b.scale, LAYER)
    assert layer.kv_cache_spec(4, torch.float64) == kvgraph.MLASpec(4, LORA, ROPE, torch.float64)
    kvgraph.bind_kv_cache({LAYER: layer}, {LAYER: tuple(b.caches)})
    with kvgraph.set_forward_context(b.md):
        out = layer(*b.inputs)
    assert out.shape == b.ref.shape
    assert_close(out, b.ref, torch.float64)
    check_caches(b)


def test_mla_rope_part_matters():
    """The reference's k_pe term is not negligible, so a backend dropping it would fail."""
    b = random_mla_batch("prefill", 4)
    q_latent, q_pe, kv_c, k_pe = b.inputs
    zero_pe = ref_mla(q_latent.double(), torch.zeros_like(q_pe), kv_c.double(),
                      torch.zeros_like(k_pe), 0, b.scale)
    n0 = len(b.chunks[0].token_ids)
    assert not torch.allclose(zero_pe[:n0], b.ref[:n0], atol=1e-3)


# --- padding ------------------------------------------------------------------------------


def with_padding(b: Batch, num_pad: int, seed: int = 99):
    """Metadata and inputs with `num_pad` padding tokens (slot -1, junk values) appended."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.cat([b.md.slot_mapping, torch.full((num_pad,), -1, dtype=torch.int64)])
    md = dataclasses.replace(b.md, slot_mapping=slots)
    inputs = [torch.cat([t, rand(gen, num_pad, *t.shape[1:], dtype=t.dtype) * 5]) for t in b.inputs]
    return md, inputs


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


# --- encoder-only -----------------------------------------------------------------------------


def encoder_batch(seed=21, num_heads=H, num_kv_heads=HKV):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lens = [rng.randint(1, 9) for _ in range(3)] + [1]
    chunks = [kvgraph.RequestChunk(list(range(n)), 0, [0] * cdiv(n, 4)) for n in lens]
    chunks.append(kvgraph.RequestChunk([1, 2, 3], 2, [0, 0]))  # attends within its 3 new tokens
    md = kvgraph.build_attention_metadata(chunks, 4, "cpu")
    qs, ks, vs, refs = [], [], [], []
    for c in chunks:
        n = len(c.token_ids)
        q = rand(gen, n, num_heads, D)
        k, v = rand(gen, n, num_kv_heads, D), rand(gen, n, num_kv_heads, D)
        qs.append(q)
        ks.append(k)
        vs.append(v)
        refs.append(ref_encoder(q, k, v, 0.3))
    return md, torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(refs)


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
        kvgraph.get_forward_context()
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


def test_forward_context_without_metadata():
    b = small_batch()
    q, k, v = b.inputs
    with kvgraph.set_forward_context(None):
        with pytest.raises((ValueError, ForwardContextError), match="attn_metadata"):
            torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), torch.empty_like(q), 0.1,
                                                -1)


def _shape_error(b, q, k, v, caches, out, bad):
    with kvgraph.set_forward_context(b.md):
        with pytest.raises(ValueError) as info:
            torch.ops.kvgraph.unified_attention(q, k, v, caches, out, b.scale, -1)
    msg = str(info.value)
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
        with kvgraph.set_forward_context(b.md):
            with pytest.raises(ValueError) as info:
                torch.ops.kvgraph.unified_mla_attention(*args, b.scale)
        msg = str(info.value)
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
        with kvgraph.set_forward_context(md):
            with pytest.raises(ValueError) as info:
                torch.ops.kvgraph.encoder_attention(*args, 0.3)
        msg = str(info.value)
        assert "expected" in msg and "got" in msg and str(bad) in msg, (name, msg)


def test_unified_attention_rejects_heads_not_multiple_of_kv_heads():
    b = random_attention_batch("decode", 4, "gqa")  # q has 6 heads, k/v 2
    q, k, v = b.inputs
    q5 = q[:, :5].contiguous()
    with kvgraph.set_forward_context(b.md):
        with pytest.raises(ValueError, match="expected"):
            torch.ops.kvgraph.unified_attention(q5, k, v, list(b.caches), torch.empty_like(q5),
                                                b.scale, -1)
    check_caches(b, expected=b.before_caches)


def test_unified_attention_rejects_cache_block_size_mismatch():
    b = random_attention_batch("decode", 4, "gqa")
    q, k, v = b.inputs
    # the same bytes viewed as blocks of 2: rows match, [num_blocks, block_size] does not
    caches = [c.view(-1, 2, *c.shape[2:]) for c in b.caches]
    with kvgraph.set_forward_context(b.md):
        with pytest.raises(ValueError, match="block_size|expected"):
            torch.ops.kvgraph.unified_attention(q, k, v, caches, torch.empty_like(q), b.scale, -1)
    check_caches(b, expected=b.before_caches)


def test_unified_attention_rejects_mismatched_cache_pair():
    b = random_attention_batch("decode", 4, "gqa")
    q, k, v = b.inputs
    kc, vc = b.caches
    big_vc = torch.cat([vc, vc])  # twice the blocks: a block id no longer addresses the same bytes
    with kvgraph.set_forward_context(b.md):
        with pytest.raises(ValueError, match="expected"):
            torch.ops.kvgraph.unified_attention(q, k, v, [kc, big_vc], torch.empty_like(q),
                                                b.scale, -1)


def test_slot_mapping_length_mismatch():
    b = small_batch()
    q, k, v = b.inputs
    short = dataclasses.replace(b.md, slot_mapping=b.md.slot_mapping[:-1])
    with kvgraph.set_forward_context(short):
        with pytest.raises(ValueError, match="slot_mapping") as info:
            torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), torch.empty_like(q),
                                                b.scale, -1)
    assert str(b.num_tokens) in str(info.value) and str(b.num_tokens - 1) in str(info.value)
    check_caches(b, expected=b.before_caches)
    m = random_mla_batch("mixed", 4)
    long = dataclasses.replace(m.md, slot_mapping=torch.cat([m.md.slot_mapping, m.md.slot_mapping]))
    with kvgraph.set_forward_context(long):
        with pytest.raises(ValueError, match="slot_mapping"):
            torch.ops.kvgraph.unified_mla_attention(*m.inputs, list(m.caches),
                                                    torch.empty_like(m.inputs[0]), m.scale)
    check_caches(m, expected=m.before_caches)
    md, q, k, v, _ = encoder_batch()
    with kvgraph.set_forward_context(dataclasses.replace(md, slot_mapping=md.slot_mapping[:2])):
        with pytest.raises(ValueError, match="slot_mapping"):
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


# --- no host sync on the decode path ----------------------------------------------------------

SYNC_OPS = {
    "aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero",
    "aten.masked_select", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
    "aten.repeat_interleave.Tensor", "aten.equal", "aten.allclose",
}


def host_syncs(rec: OpRecorder) -> list[str]:
    found = [op for op in rec.ops if op.rsplit(".", 1)[0] in SYNC_OPS or op in SYNC_OPS]
    return found + (["boolean-mask indexing"] if rec.bool_indexing else [])


def on_meta(t):
    return t.to("meta")


def meta_metadata(md):
    return dataclasses.replace(md, slot_mapping=on_meta(md.slot_mapping),
                               block_table=on_meta(md.block_table), seq_lens=on_meta(md.seq_lens),
                               query_start_loc=on_meta(md.query_start_loc))


@torch.library.custom_op("kvgraph_test::host_sync_probe", mutates_args=())
def _host_sync_probe(x: torch.Tensor) -> torch.Tensor:
    return x * float(x.sum())  # a host sync inside an op implementation


@_host_sync_probe.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("kvgraph_test::tolist_probe", mutates_args=())
def _tolist_probe(x: torch.Tensor) -> torch.Tensor:
    return x + len([v for v in x.tolist() if v])  # a host read the dispatcher never sees


@_tolist_probe.register_fake
def _(x):
    return torch.empty_like(x)


def test_host_sync_detectors_work():
    """Positive controls: both detectors used below catch a sync inside an op's implementation."""
    x = torch.randn(4)
    with OpRecorder() as rec:
        torch.ops.kvgraph_test.host_sync_probe(x)
    assert {"aten.item.default", "aten._local_scalar_dense.default"} & set(host_syncs(rec))
    with OpRecorder() as rec:
        x[x > 0]
    assert host_syncs(rec)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.ops.kvgraph_test.tolist_probe.default.redispatch(OpRecorder.CPU, on_meta(x))


@pytest.mark.parametrize("block_size", [1, 16])
def test_decode_path_makes_no_host_sync(block_size):
    b = random_attention_batch("decode", block_size, "gqa")
    assert b.md.uniform_decode
    q, k, v = b.inputs
    out = torch.empty_like(q)
    with kvgraph.set_forward_context(b.md), OpRecorder() as rec:
        torch.ops.kvgraph.unified_attention(q, k, v, list(b.caches), out, b.scale, -1)
    assert "kvgraph.unified_attention.default" in rec.ops and len(rec.ops) > 5
    assert host_syncs(rec) == [], host_syncs(rec)
    assert_close(out, b.ref, torch.float64)

    # The same step on the meta device: any read of tensor data (.item(), .tolist(), bool(),
    # a boolean mask) raises there, including reads the dispatcher does not see.
    caches = [torch.empty_like(c, device="meta") for c in b.caches]
    with kvgraph.set_forward_context(meta_metadata(b.md)):
        torch.ops.kvgraph.unified_attention.default.redispatch(
            OpRecorder.CPU, on_meta(q), on_meta(k), on_meta(v), caches, on_meta(out), b.scale, -1)


def test_decode_path_makes_no_host_sync_with_window_and_layer():
    b = random_attention_batch("decode", 4, "mqa", window=3)
    num_heads, num_kv_heads = HEAD_CONFIGS["mqa"]
    layer = kvgraph.Attention(num_heads, D, b.scale, num_kv_heads, LAYER, sliding_window=3)
    kvgraph.bind_kv_cache({LAYER: layer}, {LAYER: tuple(b.caches)})
    T = b.num_tokens
    with kvgraph.set_forward_context(b.md), OpRecorder() as rec:
        out = layer(*(t.reshape(T, -1) for t in b.inputs))
    assert host_syncs(rec) == [], host_syncs(rec)
    assert_close(out.view(b.ref.shape), b.ref, torch.float64)


def test_mla_decode_path_makes_no_host_sync():
    b = random_mla_batch("decode", 4)
    out = torch.empty_like(b.inputs[0])
    with kvgraph.set_forward_context(b.md), OpRecorder() as rec:
        torch.ops.kvgraph.unified_mla_attention(*b.inputs, list(b.caches), out, b.scale)
    assert host_syncs(rec) == [], host_syncs(rec)
    assert_close(out, b.ref, torch.float64)
    caches = [torch.empty_like(c, device="meta") for c in b.caches]
    with kvgraph.set_forward_context(meta_metadata(b.md)):
        torch.ops.kvgraph.unified_mla_attention.default.redispatch(
            OpRecorder.CPU, *(on_meta(t) for t in b.inputs), caches, on_meta(out), b.scale)


# --- opcheck ------------------------------------------------------------------------------


def assert_opcheck(op, args, md):
    with kvgraph.set_forward_context(md):
        result = torch.library.opcheck(op, args)
    assert result and all(v == "SUCCESS" for v in result.values()), result


@pytest.mark.parametrize("window", [-1, 3])
def test_opcheck_unified_attention(window):
    b = random_attention_batch("mixed", 4, "gqa")
    q, k, v = b.inputs
    assert_opcheck(torch.ops.kvgraph.unified_attention.default,
                   (q, k, v, list(b.caches), torch.empty_like(q), b.scale, window), b.md)


def test_opcheck_unified_attention_with_padding():
    b = random_attention_batch("decode", 4, "gqa")
    md, (q, k, v) = with_padding(b, 3)
    assert_opcheck(torch.ops.kvgraph.unified_attention.default,
                   (q, k, v, list(b.caches), torch.empty_like(q), b.scale, -1), md)


def test_opcheck_unified_mla_attention():
    b = random_mla_batch("mixed", 4)
    assert_opcheck(torch.ops.kvgraph.unified_mla_attention.default,
                   (*b.inputs, list(b.caches), torch.empty_like(b.inputs[0]), b.scale), b.md)


def test_opcheck_encoder_attention():
    md, q, k, v, _ = encoder_batch()
    assert_opcheck(torch.ops.kvgraph.encoder_attention.default,
                   (q, k, v, torch.empty_like(q), 0.3), md)


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
        assert kvgraph.get_forward_context() is outer
        with kvgraph.set_forward_context(inner_b.md, d_inner) as inner:
            ctx = kvgraph.get_forward_context()
            assert ctx is inner and ctx.attn_metadata is inner_b.md
            assert ctx.batch_descriptor == d_inner
            assert_close(call(inner_b), inner_b.ref, torch.float64)
            with pytest.raises(ValueError, match="slot_mapping"):  # the outer batch's inputs
                call(outer_b)
        ctx = kvgraph.get_forward_context()
        assert ctx is outer and ctx.attn_metadata is outer_b.md and ctx.batch_descriptor == d_outer

        # restored after an exception, raised by user code or by the op itself
        with pytest.raises(RuntimeError, match="boom"):
            with kvgraph.set_forward_context(inner_b.md):
                raise RuntimeError("boom")
        assert kvgraph.get_forward_context() is outer
        with pytest.raises(ValueError, match="slot_mapping"):
            with kvgraph.set_forward_context(inner_b.md):
                call(outer_b)
        assert kvgraph.get_forward_context() is outer

        assert_close(call(outer_b), outer_b.ref, torch.float64)
    check_caches(outer_b)
    check_caches(inner_b)
    with pytest.raises(ForwardContextError):
        kvgraph.get_forward_context()
