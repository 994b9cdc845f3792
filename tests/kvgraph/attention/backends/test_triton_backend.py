"""The Triton backend's kernels against dense float64 attention (Triton's interpreter on CPU).

Under `TRITON_INTERPRET=1` (set by conftest.py without a GPU) the kernels run on CPU tensors;
shapes stay small because the interpreter is slow. On a GPU the same tests compile the kernels.
"""

import pytest
import torch

pytest.importorskip("triton")

from kvgraph.attention.backends import get_attention_backend  # noqa: E402
from tests.support.attention_reference import (  # noqa: E402
    HEAD_CONFIGS, KINDS, assert_bitwise_equal, assert_close, check_caches, encoder_batch,
    random_attention_batch, random_mla_batch, ref_encoder_window, with_padding,
)
from tests.support.scenario import GENERATION, assert_backend_generates_like_torch_native  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PLAN = GENERATION[:5]  # prefill, chunked prefill, mixed and decode steps: enough, and quick


def run_triton(batch, window=None, md=None, inputs=None):
    backend = get_attention_backend("triton", DEVICE)
    q, k, v = inputs or batch.inputs
    out = torch.full_like(q, float("nan"))
    backend.forward(q, k, v, list(batch.caches), out, md or batch.md, batch.scale, window)
    return out


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_unified_attention_matches_dense_reference(kind, block_size):
    batch = random_attention_batch(kind, block_size, "gqa", dtype=torch.float32)
    assert_close(run_triton(batch), batch.ref, torch.float32)
    check_caches(batch)  # the new keys and values at exactly their slots, nothing else


@pytest.mark.parametrize("heads", list(HEAD_CONFIGS))
def test_every_head_ratio(heads):
    batch = random_attention_batch("mixed", 4, heads, dtype=torch.float32)
    assert_close(run_triton(batch), batch.ref, torch.float32)
    check_caches(batch)


@pytest.mark.parametrize("window", [1, 5])
def test_sliding_window(window):
    batch = random_attention_batch("chunked", 4, "mqa", dtype=torch.float32, window=window)
    assert_close(run_triton(batch, window), batch.ref, torch.float32)


@pytest.mark.parametrize("heads, window", [("mha", None), ("mqa", 7), ("gqa", None)])
def test_long_queries_span_several_query_blocks(heads, window):
    """A program holds up to 64 rows (tokens x heads of a KV group): longer prefills and
    chunks are cut into blocks, and each block's rows see exactly their own keys."""
    from random import Random

    from tests.support.attention_reference import attention_batch, make_chunks

    shapes = [(0, 70), (5, 1), (13, 37), (0, 1)]  # 70 and 37 tokens: several blocks each
    chunks, num_blocks = make_chunks(shapes, 4, Random(3))
    num_heads, num_kv_heads = HEAD_CONFIGS[heads]
    batch = attention_batch(chunks, num_blocks, 4, num_heads, num_kv_heads, dtype=torch.float32,
                            seed=3, window=window)
    assert_close(run_triton(batch, window), batch.ref, torch.float32)
    check_caches(batch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cache_dtypes(dtype):
    batch = random_attention_batch("mixed", 4, "gqa", dtype=dtype)
    out = run_triton(batch)
    assert out.dtype == dtype
    assert_close(out, batch.ref, dtype)
    check_caches(batch)


def test_padding_tokens_write_nothing_and_output_zeros():
    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.float32)
    md, inputs = with_padding(batch, 3)
    out = run_triton(batch, md=md, inputs=inputs)
    real = batch.num_tokens
    assert_close(out[:real], batch.ref, torch.float32)
    assert (out[real:] == 0).all()
    check_caches(batch)


def test_an_all_padding_batch_writes_nothing():
    batch = random_attention_batch("decode", 4, "gqa", dtype=torch.float32)
    md, inputs = with_padding(batch, 4)
    md = md.__class__(**{**md.__dict__, "slot_mapping": torch.full_like(md.slot_mapping, -1)})
    run_triton(batch, md=md, inputs=inputs)
    for got, before in zip(batch.caches, batch.before_caches):
        assert_bitwise_equal(got, before, "cache")


@pytest.mark.parametrize("kind, window", [("decode", None), ("chunked", None), ("mixed", 3)])
def test_split_kv_matches_dense_reference(kind, window):
    """Flash-decoding: each query's keys in 4 ranges (some empty), merged after."""
    from kvgraph.attention.backends.triton import unified_attention, write_rows

    batch = random_attention_batch(kind, 4, "gqa", dtype=torch.float32, window=window)
    q, k, v = batch.inputs
    key_cache, value_cache = batch.caches
    write_rows([key_cache, value_cache], (k, v), batch.md.slot_mapping)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, key_cache, value_cache, out, batch.md, batch.scale, window, num_splits=4)
    assert_close(out, batch.ref, torch.float32)
    check_caches(batch)


@pytest.mark.parametrize("floats, used, splits", [(100_000, True, 16), (10, False, 2)])
def test_split_kv_works_in_the_runner_s_workspace_or_allocates(floats, used, splits):
    """Partial results go to the metadata's workspace when it is large enough (nothing is
    allocated per step, and graphs can hold it), else to buffers of their own. Forced splits
    are planned once: a second layer reuses launch and buffers, and still matches."""
    import dataclasses

    from kvgraph.attention.backends.triton import unified_attention, write_rows

    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.float32)
    q, k, v = batch.inputs
    write_rows(list(batch.caches), (k, v), batch.md.slot_mapping)
    workspace = torch.full((floats,), float("nan"))
    md = dataclasses.replace(batch.md, workspace=workspace)
    for _layer in range(2):
        out = torch.full_like(q, float("nan"))
        unified_attention(q, *batch.caches, out, md, batch.scale, None, num_splits=splits)
        assert_close(out, batch.ref, torch.float32)
    assert bool(torch.isfinite(workspace).any()) is used
    (launch,) = md.plan.launches
    assert launch.splits == splits == launch.grid[2]
    assert (launch.partial.data_ptr() == workspace.data_ptr()) is used


def test_split_kv_gives_padding_tokens_zeros():
    from kvgraph.attention.backends.triton import unified_attention

    batch = random_attention_batch("decode", 4, "gqa", dtype=torch.float32)
    md, inputs = with_padding(batch, 2)
    q = inputs[0]
    out = torch.full_like(q, float("nan"))
    unified_attention(q, *batch.caches, out, md, batch.scale, None, num_splits=2)
    assert (out[batch.num_tokens:] == 0).all() and torch.isfinite(out).all()


@pytest.mark.parametrize("kind", ["decode", "mixed", "chunked"])
def test_mla_matches_dense_reference(kind):
    batch = random_mla_batch(kind, 4, dtype=torch.float32)
    q_latent, q_pe, kv_c, k_pe = batch.inputs
    out = torch.full_like(q_latent, float("nan"))
    get_attention_backend("triton", DEVICE).forward_mla(
        q_latent, q_pe, kv_c, k_pe, list(batch.caches), out, batch.md, batch.scale)
    assert_close(out, batch.ref, torch.float32)
    check_caches(batch)


def test_mla_over_head_blocks_query_blocks_splits_and_padding():
    """18 heads (two head blocks, one partial), prefills over several query blocks, 4 key
    splits, and padding tokens, which come out as zeros."""
    from random import Random

    from kvgraph.attention.backends.triton.mla import mla_attention
    from tests.support.attention_reference import make_chunks, mla_batch

    chunks, num_blocks = make_chunks([(0, 9), (6, 1), (3, 7), (0, 1)], 4, Random(5))
    batch = mla_batch(chunks, num_blocks, 4, num_heads=18, dtype=torch.float32, seed=5)
    md, inputs = with_padding(batch, 3)
    q_latent, q_pe, kv_c, k_pe = inputs
    backend = get_attention_backend("triton", DEVICE)
    for splits in (None, 4):
        caches = [c.clone() for c in batch.caches]
        out = torch.full_like(q_latent, float("nan"))
        backend.forward_mla(q_latent, q_pe, kv_c, k_pe, caches, out, md, batch.scale)
        if splits:  # the write is done: attend again over the written caches with splits
            out = torch.full_like(q_latent, float("nan"))
            mla_attention(q_latent, q_pe, *caches, out, md, batch.scale, num_splits=splits)
        assert_close(out[:batch.num_tokens], batch.ref, torch.float32)
        assert (out[batch.num_tokens:] == 0).all()


def test_the_layers_of_a_step_share_one_launch_and_a_new_step_plans_again():
    """The first layer call sizes the launch; the next layer of that geometry reuses the very
    object (memoised), one of another geometry gets its own, and a new step's metadata (here a
    copy, which carries the old plan in its field) is planned again."""
    import dataclasses

    from kvgraph.attention.backends.triton import unified_attention

    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.float32)
    md = batch.md
    assert_close(run_triton(batch, md=md), batch.ref, torch.float32)  # layer 0
    plan = md.plan
    (launch,) = plan.launches
    assert_close(run_triton(batch, md=md), batch.ref, torch.float32)  # layer 1
    assert md.plan is plan and plan.launches[0] is launch and len(plan.launches) == 1
    # A layer with half the heads (KV head 0's group, same group size): a second launch.
    q = batch.inputs[0][:, :3]
    out = torch.full_like(q, float("nan"))
    unified_attention(q, *(c[:, :, :1].contiguous() for c in batch.caches), out, md,
                      batch.scale, None)
    assert_close(out, batch.ref[:, :3], torch.float32)
    assert md.plan is plan and len(plan.launches) == 2 and plan.launches[0] is launch
    next_step = dataclasses.replace(md)
    assert_close(run_triton(batch, md=next_step), batch.ref, torch.float32)
    assert next_step.plan is not plan and next_step.plan.launches[0] is not launch


def test_hand_built_metadata_is_planned_by_its_first_op_call():
    from kvgraph.attention.backends.triton.launch import LaunchPlan
    from kvgraph.attention.backends.triton.mla import mla_attention

    batch = random_mla_batch("mixed", 4, dtype=torch.float32)
    assert batch.md.plan is None
    q_latent, q_pe, kv_c, k_pe = batch.inputs
    backend = get_attention_backend("triton", DEVICE)
    out = torch.full_like(q_latent, float("nan"))
    backend.forward_mla(q_latent, q_pe, kv_c, k_pe, list(batch.caches), out, batch.md,
                        batch.scale)
    assert_close(out, batch.ref, torch.float32)
    plan = batch.md.plan
    assert isinstance(plan, LaunchPlan) and plan.backend is backend and plan.descriptor is None
    out = torch.full_like(q_latent, float("nan"))
    mla_attention(q_latent, q_pe, *batch.caches, out, batch.md, batch.scale)  # no plan given
    assert_close(out, batch.ref, torch.float32)
    assert batch.md.plan is plan and len(plan.launches) == 1


@pytest.mark.parametrize("kind", ["decode", "mixed"])
def test_a_full_graph_freezes_the_query_length_and_keeps_the_sequence_length(kind):
    """Only `max_query_len` is read on the host (it sizes query blocks): frozen at the most a
    replay meets. Sequence lengths are read on the device: the batch's own `max_seq_len` stays,
    and the kernels given the frozen lengths still match the reference."""
    import dataclasses

    from kvgraph.attention.backends.base import StepLengths
    from kvgraph.forward_context import BatchDescriptor

    batch = random_attention_batch(kind, 4, "gqa", dtype=torch.float32)
    md = batch.md
    descriptor = BatchDescriptor(md.num_actual_tokens, md.num_reqs, md.uniform_decode)
    lengths = StepLengths(md.max_query_len, md.max_seq_len)
    frozen = get_attention_backend("triton", DEVICE).frozen_lengths(
        descriptor, lengths, max_model_len=md.max_seq_len + 1000)
    longest_query = 1 if kind == "decode" else md.num_actual_tokens
    assert frozen == StepLengths(longest_query, md.max_seq_len)
    frozen_md = dataclasses.replace(md, max_query_len=frozen.max_query_len)
    assert_close(run_triton(batch, md=frozen_md), batch.ref, torch.float32)


def test_keys_are_split_only_until_a_gpu_is_full():
    """On a GPU, a grid of fewer than FULL_GRID programs gets more splits the smaller it is (a
    power of two, at most MAX_SPLITS); a full grid, and the interpreter, get one."""
    from kvgraph.attention.backends.triton.launch import FULL_GRID, MAX_SPLITS, num_kv_splits

    cuda = torch.device("cuda")
    splits = [num_kv_splits(programs, cuda) for programs in range(1, FULL_GRID + 1)]
    assert splits[0] == MAX_SPLITS and splits[-1] == 1
    assert all(n & (n - 1) == 0 for n in splits) and splits == sorted(splits, reverse=True)
    assert num_kv_splits(1, torch.device("cpu")) == 1


@pytest.mark.parametrize("window", [None, 2])
def test_encoder_attention_matches_dense_reference(window):
    md, q, k, v, _ = encoder_batch(num_heads=4, num_kv_heads=2)
    q, k, v = (t.float() for t in (q, k, v))
    out = torch.full_like(q, float("nan"))
    get_attention_backend("triton", DEVICE).forward_encoder(q, k, v, out, md, 0.3, window)
    starts = md.query_start_loc.tolist()
    expected = torch.cat([ref_encoder_window(q[lo:hi].double(), k[lo:hi].double(),
                                             v[lo:hi].double(), 0.3, window or 10**9)
                          for lo, hi in zip(starts, starts[1:])])
    assert_close(out, expected, torch.float32)


def test_asking_for_triton_on_the_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    from kvgraph.attention.backends import triton as triton_backend

    monkeypatch.setattr(triton_backend.TritonBackend, "device_types", ("cuda",))
    with pytest.raises(ValueError, match="'triton' runs on cuda, not on cpu"):
        get_attention_backend("triton", torch.device("cpu"))


@pytest.mark.usefixtures("fresh_compile_state")
@pytest.mark.parametrize("kind, mode", [
    ("llama", "eager"), ("llama", "piecewise"), ("llama", "full"),
    ("deepseek_mla", "full_and_piecewise"),
    # The other modes that add a path (full_decode_only and MLA's piecewise are parts of
    # full_and_piecewise); slow only because the interpreter runs each capture's kernels.
    *[pytest.param("llama", mode, marks=pytest.mark.slow)
      for mode in ("none", "full_and_piecewise")],
    pytest.param("deepseek_mla", "full", marks=pytest.mark.slow),
])
def test_the_runner_with_triton_generates_what_torch_native_does(kind, mode):
    assert_backend_generates_like_torch_native(kind, mode, "triton", PLAN, DEVICE)
