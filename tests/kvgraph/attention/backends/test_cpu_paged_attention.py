"""The C++ CPU paged-attention backend (`cpu_paged`) against dense float64 attention.

The kernels are built once per machine into kvgraph's cache dir (KVGRAPH_CACHE_DIR, else the
user's), so a test run pays for at most one cold build (~20 s on 2 cores) and later runs none.
"""

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from random import Random

import pytest
import torch

import kvgraph
from kvgraph.attention.backends import get_attention_backend
from kvgraph.attention.backends.base import GraphSupport
from kvgraph.attention.backends.cpu_paged import CPUPagedBackend
from tests.support.attention_reference import (
    HEAD_CONFIGS, KINDS, assert_bitwise_equal, assert_close, attention_batch, check_caches,
    encoder_batch, make_chunks, mla_batch, random_attention_batch, random_mla_batch, ref_encoder,
    request_shapes, with_padding,
)
from tests.support.scenario import GENERATION, assert_backend_generates_like_torch_native
from tests.support.measured import assert_measured

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def backend():
    backend = get_attention_backend("cpu_paged", CPU)
    assert backend.fallback_reason is None, backend.fallback_reason
    return backend


def run(backend, batch, window=None, md=None, inputs=None):
    q, k, v = inputs or batch.inputs
    out = torch.full_like(q, float("nan"))
    backend.forward(q, k, v, list(batch.caches), out, md or batch.md, batch.scale, window)
    return out


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_attention_matches_dense_reference(backend, kind, block_size):
    batch = random_attention_batch(kind, block_size, "gqa", dtype=torch.float32)
    assert_close(run(backend, batch), batch.ref, torch.float32)
    check_caches(batch)  # the new keys and values at exactly their slots, nothing else


@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
def test_every_head_ratio(backend, heads):
    batch = random_attention_batch("mixed", 4, heads, dtype=torch.float32)
    assert_close(run(backend, batch), batch.ref, torch.float32)
    check_caches(batch)


@pytest.mark.parametrize("kind", ["chunked", "mixed"])
@pytest.mark.parametrize("window", [1, 5])
def test_sliding_window(backend, kind, window):
    batch = random_attention_batch(kind, 4, "mqa", dtype=torch.float32, window=window)
    assert_close(run(backend, batch, window), batch.ref, torch.float32)


@pytest.mark.parametrize("heads, window", [("mha", None), ("mqa", 7), ("gqa", None)])
def test_long_queries_span_several_work_items(backend, heads, window):
    """A work item holds 16 query tokens: longer prefills and chunks are cut into several, and
    each sees exactly its own keys."""
    chunks, num_blocks = make_chunks([(0, 70), (5, 1), (13, 37), (0, 1)], 4, Random(3))
    num_heads, num_kv_heads = HEAD_CONFIGS[heads]
    batch = attention_batch(chunks, num_blocks, 4, num_heads, num_kv_heads, dtype=torch.float32,
                            seed=3, window=window)
    assert_close(run(backend, batch, window), batch.ref, torch.float32)
    check_caches(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_over_every_tile_width(backend, dtype):
    """Keys are scored 64 a tile, the last tile rounded up to 16 with zeros: contexts on and
    around every width (and over several tiles) see exactly their own keys."""
    lengths = [1, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 127, 128, 130]
    chunks, num_blocks = make_chunks([(n - 1, 1) for n in lengths], 16, Random(5))
    batch = attention_batch(chunks, num_blocks, 16, 8, 2, head_size=64, dtype=dtype, seed=5)
    assert_close(run(backend, batch), batch.ref, dtype)
    check_caches(batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_half_precision_caches(backend, dtype, kind):
    batch = random_attention_batch(kind, 4, "gqa", dtype=dtype, head_size=64)
    out = run(backend, batch)
    assert out.dtype == dtype
    assert_close(out, batch.ref, dtype)
    check_caches(batch)


def test_a_float32_model_over_a_bfloat16_cache(backend):
    """The runner may keep the cache in another dtype than the model: rows are converted on
    write, and attention reads the bf16 cache with fp32 queries."""
    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.bfloat16)
    q, k, v = (t.float() for t in batch.inputs)
    out = run(backend, batch, inputs=[q, k, v])
    assert out.dtype == torch.float32
    assert_close(out, batch.ref, torch.bfloat16)
    check_caches(batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kind", [((16, 1), "decode"), ((16, 1), "mixed"),
                                        ((1, 1), "prefill"), ((8, 2), "chunked")])
def test_dot_and_transposed_scoring_both_match(backend, dtype, heads, kind):
    """An item with up to 8 rows (tokens x query heads of a KV head) scores one dot product per
    key, one with more transposes the key tile: a group of 16 decodes through the transpose,
    single-head prefill tokens through dot products on the causal diagonal."""
    rng = Random(f"paths-{heads}-{kind}")
    chunks, num_blocks = make_chunks(request_shapes(kind, rng), 4, rng)
    batch = attention_batch(chunks, num_blocks, 4, *heads, 64, dtype, 7)
    assert_close(run(backend, batch), batch.ref, dtype)


def test_a_query_in_a_third_dtype_goes_through_float32(backend):
    """fp16 queries over a bf16 cache: neither fp32 nor the cache's dtype, so converted."""
    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.bfloat16)
    q, k, v = (t.to(torch.float16) for t in batch.inputs)
    out = run(backend, batch, inputs=[q, k, v])
    assert out.dtype == torch.float16
    assert_close(out, batch.ref, torch.bfloat16)


def test_strided_inputs_from_a_fused_projection(backend):
    """q, k and v as views of one fused qkv row (what a model's split gives): read in place."""
    batch = random_attention_batch("chunked", 4, "gqa", dtype=torch.float32)
    q, k, v = batch.inputs
    fused = torch.cat([t.flatten(1) for t in (q, k, v)], dim=1)
    sizes = [t[0].numel() for t in (q, k, v)]
    views = [part.view(t.shape) for part, t in zip(fused.split(sizes, dim=1), (q, k, v))]
    assert not views[1].is_contiguous()
    assert_close(run(backend, batch, inputs=views), batch.ref, torch.float32)
    check_caches(batch)


def test_padding_tokens_write_nothing_and_output_zeros(backend):
    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.float32)
    md, inputs = with_padding(batch, 3)
    out = run(backend, batch, md=md, inputs=inputs)
    assert_close(out[:batch.num_tokens], batch.ref, torch.float32)
    assert (out[batch.num_tokens:] == 0).all()
    check_caches(batch)


def test_padded_requests_without_keys_output_zeros(backend):
    """The runner pads requests too: seq_len 0 and one padding token each."""
    batch = random_attention_batch("decode", 4, "gqa", dtype=torch.float32)
    md, inputs = with_padding(batch, 2)
    r, t = md.num_reqs, batch.num_tokens
    md = dataclasses.replace(
        md, seq_lens=torch.cat([md.seq_lens, torch.zeros(2, dtype=torch.int32)]),
        query_start_loc=torch.cat([md.query_start_loc,
                                   torch.tensor([t + 1, t + 2], dtype=torch.int32)]),
        block_table=torch.cat([md.block_table, md.block_table[:2] * 0]))
    assert md.seq_lens.shape[0] == r + 2
    out = run(backend, batch, md=md, inputs=inputs)
    assert_close(out[:t], batch.ref, torch.float32)
    assert (out[t:] == 0).all()
    check_caches(batch)


def test_an_all_padding_batch_writes_nothing(backend):
    batch = random_attention_batch("decode", 4, "gqa", dtype=torch.float32)
    md, inputs = with_padding(batch, 4)
    md = dataclasses.replace(md, slot_mapping=torch.full_like(md.slot_mapping, -1))
    run(backend, batch, md=md, inputs=inputs)
    for got, before in zip(batch.caches, batch.before_caches):
        assert_bitwise_equal(got, before, "cache")


def test_a_block_id_past_the_cache_is_a_clear_error(backend):
    batch = random_attention_batch("decode", 4, "gqa", dtype=torch.float32)
    num_blocks = batch.caches[0].shape[0]
    table = batch.md.block_table.clone()
    table[0, 0] = num_blocks
    md = dataclasses.replace(batch.md, block_table=table)
    with pytest.raises(RuntimeError, match=f"reads block {num_blocks} of a cache with "
                                           f"{num_blocks} blocks"):
        run(backend, batch, md=md)


def test_stale_nan_past_a_sequence_is_never_read(backend):
    """Rows past each request's end (a freed block's leftovers) may hold NaN: never summed."""
    batch = random_attention_batch("decode", 4, "gqa", dtype=torch.float32)
    used = set()
    for chunk in batch.chunks:
        for pos in range(chunk.seq_len):
            used.add((chunk.block_ids[pos // 4], pos % 4))
    for cache in batch.caches:
        for block in range(cache.shape[0]):
            for slot in range(4):
                if (block, slot) not in used:
                    cache[block, slot] = float("nan")
    out = run(backend, batch)
    assert_close(out, batch.ref, torch.float32)


@pytest.mark.parametrize("kind", ["decode", "mixed", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_matches_dense_reference(backend, kind, dtype):
    batch = random_mla_batch(kind, 4, dtype=dtype)
    q_latent, q_pe, kv_c, k_pe = batch.inputs
    out = torch.full_like(q_latent, float("nan"))
    backend.forward_mla(q_latent, q_pe, kv_c, k_pe, list(batch.caches), out, batch.md,
                        batch.scale)
    assert_close(out, batch.ref, dtype)
    check_caches(batch)


def test_mla_over_many_heads_long_queries_and_padding(backend):
    chunks, num_blocks = make_chunks([(0, 19), (6, 1), (3, 7), (0, 1)], 4, Random(5))
    batch = mla_batch(chunks, num_blocks, 4, num_heads=18, dtype=torch.float32, seed=5)
    md, inputs = with_padding(batch, 3)
    q_latent, q_pe, kv_c, k_pe = inputs
    out = torch.full_like(q_latent, float("nan"))
    backend.forward_mla(q_latent, q_pe, kv_c, k_pe, list(batch.caches), out, md, batch.scale)
    assert_close(out[:batch.num_tokens], batch.ref, torch.float32)
    assert (out[batch.num_tokens:] == 0).all()
    check_caches(batch)


def test_encoder_attention_runs_torch_native(backend):
    md, q, k, v, _ = encoder_batch(num_heads=4, num_kv_heads=2)
    q, k, v = (t.float() for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    backend.forward_encoder(q, k, v, out, md, 0.3)
    starts = md.query_start_loc.tolist()
    expected = torch.cat([ref_encoder(q[lo:hi].double(), k[lo:hi].double(), v[lo:hi].double(),
                                      0.3) for lo, hi in zip(starts, starts[1:])])
    assert_close(out, expected, torch.float32)


def test_the_ops_route_to_it_through_the_forward_context(backend):
    """`kvgraph::unified_attention` and `unified_mla_attention` with the backend named in the
    forward context (as the runner names it): the op checks shapes, the backend does the rest."""
    batch = random_attention_batch("mixed", 16, "gqa", dtype=torch.float32)
    q, k, v = batch.inputs
    out = torch.full_like(q, float("nan"))
    with kvgraph.set_forward_context(batch.md, attn_backend="cpu_paged"):
        torch.ops.kvgraph.unified_attention(q, k, v, list(batch.caches), out, batch.scale)
    assert_close(out, batch.ref, torch.float32)
    check_caches(batch)
    mla = random_mla_batch("mixed", 4, dtype=torch.float32)
    q_latent, q_pe, kv_c, k_pe = mla.inputs
    out = torch.full_like(q_latent, float("nan"))
    with kvgraph.set_forward_context(mla.md, attn_backend="cpu_paged"):
        torch.ops.kvgraph.unified_mla_attention(q_latent, q_pe, kv_c, k_pe, list(mla.caches),
                                                out, mla.scale)
    assert_close(out, mla.ref, torch.float32)
    check_caches(mla)


def test_kernels_have_fake_implementations(backend):
    """The kernels can sit inside a traced graph: their fakes return nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    batch = random_attention_batch("decode", 4, "gqa", dtype=torch.float32)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(batch.inputs[0].shape)
        torch.ops.kvgraph_cpu.paged_attention(
            q, None, batch.caches[0], None, batch.caches[1], torch.empty(q.shape),
            batch.md.block_table, batch.md.seq_lens, batch.md.query_start_loc, 0.1, -1)


def test_it_captures_any_batch():
    assert CPUPagedBackend.graph_support is GraphSupport.ALWAYS


def test_without_a_compiler_it_logs_why_and_runs_torch_native(monkeypatch, caplog):
    from kvgraph.attention.backends import cpu_paged as cpu
    from kvgraph.cpu.build import KernelBuildError

    def no_compiler():
        raise KernelBuildError("could not build kvgraph's CPU attention kernels: no g++")

    monkeypatch.setattr(cpu, "load_kernels", no_compiler)
    with caplog.at_level(logging.WARNING):
        fallback = CPUPagedBackend()
    assert "no g++" in caplog.text and "torch_native" in caplog.text
    assert fallback.fallback_reason and fallback.graph_support is GraphSupport.UNIFORM_BATCH
    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.float32)
    assert_close(run(fallback, batch), batch.ref, torch.float32)
    check_caches(batch)


def test_a_build_failure_says_what_is_needed(tmp_path, monkeypatch):
    from kvgraph.cpu import build

    def failing_build(root):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(build, "build_and_load", failing_build)
    monkeypatch.setenv("KVGRAPH_CACHE_DIR", str(tmp_path))
    build.load_kernels.cache_clear()
    try:
        with pytest.raises(build.KernelBuildError, match=r"Ninja is required.*C\+\+ compiler"):
            build.load_kernels()
    finally:
        build.load_kernels.cache_clear()


def test_a_second_process_loads_the_built_kernels_without_building(backend):
    """The library lies in kvgraph's cache dir, keyed by source, torch, flags and processor."""
    from kvgraph.cpu.build import load_kernels

    directory = load_kernels()
    library = directory / "kvgraph_cpu_kernels.so"
    built = library.stat().st_mtime_ns
    script = ("import torch; from kvgraph.cpu.build import load_kernels; "
              "print(load_kernels(), torch.ops.kvgraph_cpu.paged_attention)")
    env = {**os.environ, "KVGRAPH_CACHE_DIR": str(directory.parent.parent)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, check=True, timeout=120)
    assert result.stdout.split()[0] == str(directory)
    assert library.stat().st_mtime_ns == built, "the second process rebuilt the library"


@pytest.mark.usefixtures("fresh_compile_state")
@pytest.mark.parametrize("kind, mode", [
    ("llama", "eager"), ("llama", "piecewise"), ("llama", "full"),
    ("deepseek_mla", "full_and_piecewise"),
])
def test_the_runner_generates_what_torch_native_does(backend, kind, mode):
    # prefill, chunked prefill, mixed and decode steps
    assert_backend_generates_like_torch_native(kind, mode, "cpu_paged", GENERATION[:5])


def test_the_benchmark_compares_both_backends(backend, tmp_path):
    from examples.benchmarks import cpu_attention

    threads = torch.get_num_threads()
    try:
        payload = cpu_attention.main(["--smoke", "--json", str(tmp_path / "cpu.json")])
    finally:
        torch.set_num_threads(threads)  # the script runs on one thread
    assert payload["threads"] == 1
    for row in payload["rows"]:
        assert row["max_abs_diff_vs_sdpa"]["cpu_paged"] < (1e-4 if row["dtype"] == "float32"
                                                           else 5e-2), row["case"]
        assert row["ms"].keys() == {"cpu_paged", "torch_native", "sdpa_dense"}
        assert_measured([row["speedup"], *row["ms"].values()])


def test_the_ninja_package_is_found_when_its_bin_dir_is_not_on_path(monkeypatch):
    ninja = pytest.importorskip("ninja")
    from kvgraph.cpu.build import put_ninja_on_path

    monkeypatch.setenv("PATH", "/nonexistent")
    put_ninja_on_path()
    assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
