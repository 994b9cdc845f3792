"""Dense float64 references for kvgraph's attention ops, the batches they run on, and checks.

Not a test module: the attention tests (tests/kvgraph/attention/) import it.

Each batch is built from random request chunks over shuffled block ids. The builder writes every
request's cached prefix into the paged cache itself (slot = block_ids[pos // bs] * bs + pos %
bs), keeps the full key/value sequences, and computes the expected output token by token with
plain softmax attention. After each op the whole cache is compared bit for bit with what it must
hold: the new keys/values at exactly their slots, everything else untouched (`check_caches`).
"""

from __future__ import annotations

import dataclasses
import random
import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvgraph

H, HKV, D = 4, 2, 8  # default heads / kv heads / head size
LORA, ROPE = 16, 4  # MLA latent and rope dims
HEAD_CONFIGS = {"mha": (4, 4), "gqa": (6, 2), "mqa": (4, 1)}
KINDS = ("decode", "prefill", "mixed", "chunked")
BLOCK_SIZES = (1, 4, 16)
TOL = {
    torch.float64: dict(rtol=1e-10, atol=1e-10),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
}
INT_VIEW = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
            torch.bfloat16: torch.int16}
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


def ref_encoder_window(q, k, v, scale, window):
    """Bidirectional attention within one request, token i seeing j when |i - j| < window."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    positions = torch.arange(q.shape[0])
    visible = (positions[:, None] - positions[None, :]).abs() < window
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
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


# --- padding and encoder batches --------------------------------------------------------------


def with_padding(b: Batch, num_pad: int, seed: int = 99):
    """Metadata and inputs with `num_pad` padding tokens (slot -1, junk values) appended."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.cat([b.md.slot_mapping, torch.full((num_pad,), -1, dtype=torch.int64)])
    md = dataclasses.replace(b.md, slot_mapping=slots)
    inputs = [torch.cat([t, rand(gen, num_pad, *t.shape[1:], dtype=t.dtype) * 5]) for t in b.inputs]
    return md, inputs


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
