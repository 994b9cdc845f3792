"""Speculative verify steps as batch descriptors: the key, the host batch's query length, the
dispatcher's keys, padding and counts, and which backends hold them in full graphs."""

from __future__ import annotations

import logging

import pytest

import kvgraph
from kvgraph import BatchDescriptor, CompilationConfig, GraphMode
from kvgraph.attention.backends import GraphSupport, StepLengths
from kvgraph.attention.backends.base import AttentionBackend
from kvgraph.attention.batch import host_batch
from kvgraph.errors import BatchError
from kvgraph.runtime.dispatcher import Dispatcher, resolve_graph_mode, verify_query_len

Q = 3  # 1 + K with K = 2 draft tokens
SIZES = (3, 6, 9, 18)  # CompilationConfig(capture_sizes=(1, 2, 4, 8, 16), K=2).capture_size_list


def chunk(n: int, computed: int = 4, num_logits: int = 1, block: int = 0):
    return kvgraph.RequestChunk(list(range(1, n + 1)), computed, [block, block + 1, block + 2],
                                num_logits)


def batch(*query_lens: int):
    return host_batch([chunk(n, block=3 * i) for i, n in enumerate(query_lens)], 4)


# --- BatchDescriptor --------------------------------------------------------------------------


def test_a_decode_key_reads_as_before_and_a_verify_key_names_its_query_length():
    assert repr(BatchDescriptor(4, 4, True)) == \
        "BatchDescriptor(num_tokens=4, num_reqs=4, uniform_decode=True)"
    assert str(BatchDescriptor(8)) == \
        "BatchDescriptor(num_tokens=8, num_reqs=None, uniform_decode=False)"
    verify = BatchDescriptor(9, 3, True, query_len=3)
    assert repr(verify) == \
        "BatchDescriptor(num_tokens=9, num_reqs=3, uniform_decode=True, query_len=3)"
    assert verify != BatchDescriptor(9, 9, True)
    assert len({verify, BatchDescriptor(9, 3, True, 3)}) == 1
    assert BatchDescriptor(4, 4, True).query_len == 1


@pytest.mark.parametrize("args, match", [
    ((9, 3, True, 0), "query_len must be >= 1"),
    ((9, 3, False, 3), "above 1 only for a uniform batch"),
    ((9, None, False, 3), "above 1 only for a uniform batch"),
    ((12, 3, True, 3), "num_tokens == num_reqs \\* query_len"),
    ((4, 2, True), "num_tokens == num_reqs \\* query_len"),
])
def test_a_descriptor_that_is_not_a_uniform_shape_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        BatchDescriptor(*args)


# --- the host batch ---------------------------------------------------------------------------


def test_the_host_batch_knows_a_uniform_batch_s_query_length():
    assert batch(3, 3, 3).uniform_query_len == 3
    assert batch(1, 1).uniform_query_len == 1 and batch(1, 1).uniform_decode
    assert batch(3, 1).uniform_query_len is None and not batch(3, 3).uniform_decode


def test_num_logits_picks_each_chunk_s_last_rows_in_chunk_order():
    chunks = [chunk(3, num_logits=2), chunk(1, block=3), chunk(4, num_logits=4, block=6)]
    assert host_batch(chunks, 4).logits_indices.tolist() == [1, 2, 3, 4, 5, 6, 7]
    assert batch(3, 1, 2).logits_indices.tolist() == [2, 3, 5]


@pytest.mark.parametrize("num_logits, match", [
    (0, r"chunk 1: num_logits must lie in \[1, len\(token_ids\)=3\]"),
    (4, r"chunk 1: num_logits must lie in \[1, len\(token_ids\)=3\]"),
    (True, "chunk 1: num_logits must be an int"),
    (1.0, "chunk 1: num_logits must be an int"),
])
def test_num_logits_outside_the_chunk_is_refused_naming_the_chunk(num_logits, match):
    with pytest.raises(BatchError, match=match):
        host_batch([chunk(2), chunk(3, num_logits=num_logits, block=3)], 4)


# --- the dispatcher ---------------------------------------------------------------------------


def dispatcher(mode=GraphMode.FULL_AND_PIECEWISE, verify_len=Q, has_graphs=None):
    return Dispatcher(mode, SIZES, 8, has_graphs or (lambda mode, descriptor: True), verify_len)


def test_verify_steps_are_keyed_padded_and_counted_like_decode_steps():
    d = dispatcher()
    assert d.dispatch(batch(3, 3)) == (GraphMode.FULL, BatchDescriptor(6, 2, True, Q))
    # Four requests pad to the next verify size: six requests of Q tokens.
    assert d.dispatch(batch(3, 3, 3, 3)) == (GraphMode.FULL, BatchDescriptor(18, 6, True, Q))
    # A step where no request has drafts is a decode step, on the decode keys.
    assert d.dispatch(batch(1, 1)) == (GraphMode.FULL, BatchDescriptor(3, 3, True))
    # Uniform with another query length, or mixed: a mixed batch.
    assert d.dispatch(batch(2, 2)) == (GraphMode.PIECEWISE, BatchDescriptor(6))
    assert d.dispatch(batch(3, 1)) == (GraphMode.PIECEWISE, BatchDescriptor(6))
    # More requests than any verify key holds: the capture sizes, then no graphs.
    assert d.dispatch(batch(*[3] * 7)) == (GraphMode.NONE, BatchDescriptor(21))
    report = d.report()
    assert report["hits"] == {
        "full:BatchDescriptor(num_tokens=6, num_reqs=2, uniform_decode=True, query_len=3)": 1,
        "full:BatchDescriptor(num_tokens=18, num_reqs=6, uniform_decode=True, query_len=3)": 1,
        "full:BatchDescriptor(num_tokens=3, num_reqs=3, uniform_decode=True)": 1,
        "piecewise:BatchDescriptor(num_tokens=6, num_reqs=None, uniform_decode=False)": 2,
        "none:BatchDescriptor(num_tokens=21, num_reqs=None, uniform_decode=False)": 1,
    }
    assert (report["padded_tokens"], report["fallbacks"]) == (6 + 1 + 2 + 2, 1)


def test_both_decode_and_verify_keys_are_captured_largest_first():
    keys = dispatcher().descriptors_to_capture()
    full = [d for mode, d in keys if mode is GraphMode.FULL]
    assert full == [BatchDescriptor(18, 6, True, Q), BatchDescriptor(9, 3, True, Q),
                    BatchDescriptor(6, 6, True), BatchDescriptor(6, 2, True, Q),
                    BatchDescriptor(3, 3, True), BatchDescriptor(3, 1, True, Q)]
    assert [d.num_tokens for _, d in keys] == sorted((d.num_tokens for _, d in keys),
                                                     reverse=True)
    assert [d for mode, d in keys if mode is GraphMode.PIECEWISE] == \
        [BatchDescriptor(s) for s in reversed(SIZES)]


def test_full_decode_only_runs_verify_steps_in_full_graphs_and_mixed_ones_without():
    d = dispatcher(GraphMode.FULL_DECODE_ONLY)
    assert d.dispatch(batch(3, 3, 3)) == (GraphMode.FULL, BatchDescriptor(9, 3, True, Q))
    assert d.dispatch(batch(3, 1)) == (GraphMode.NONE, BatchDescriptor(4))
    assert all(d.uniform_decode for _, d in d.descriptors_to_capture())


def test_a_verify_key_without_graphs_falls_back_to_its_size_s_piecewise_graphs():
    d = dispatcher(has_graphs=lambda mode, descriptor: descriptor.query_len == 1)
    assert d.dispatch(batch(3, 3)) == (GraphMode.PIECEWISE, BatchDescriptor(6))


def test_without_verify_graphs_verify_steps_run_as_mixed_batches():
    d = dispatcher(verify_len=1)
    assert d.verify_sizes == ()
    assert d.dispatch(batch(3, 3)) == (GraphMode.PIECEWISE, BatchDescriptor(6))
    assert d.dispatch(batch(1, 1)) == (GraphMode.FULL, BatchDescriptor(3, 3, True))
    assert all(d.query_len == 1 for _, d in d.descriptors_to_capture())


# --- what each backend runs in full graphs -----------------------------------------------------


def test_graph_support_says_which_uniform_query_lengths_full_graphs_hold():
    runs = {support: (support.runs_uniform(1), support.runs_uniform(Q))
            for support in GraphSupport}
    assert runs == {GraphSupport.ALWAYS: (True, True), GraphSupport.UNIFORM_BATCH: (True, True),
                    GraphSupport.UNIFORM_DECODE: (True, False),
                    GraphSupport.NEVER: (False, False)}


def backend_classes():
    from kvgraph.attention.backends.ascend import AscendBackend
    from kvgraph.attention.backends.cpu_paged import CPUPagedBackend
    from kvgraph.attention.backends.torch_native import TorchNativeBackend

    classes = [TorchNativeBackend, CPUPagedBackend, AscendBackend]
    try:
        from kvgraph.attention.backends.triton import TritonBackend
    except ImportError:  # no Triton installed: nothing to declare
        return classes
    return [*classes, TritonBackend]


def test_every_backend_declares_that_it_runs_verify_steps_in_full_graphs():
    declared = {cls.name: cls.graph_support for cls in backend_classes()}
    assert declared.pop("torch_native") is GraphSupport.UNIFORM_BATCH
    assert set(declared.values()) == {GraphSupport.ALWAYS}, declared


def test_a_uniform_descriptor_freezes_its_own_query_length():
    backend = AttentionBackend()
    own = StepLengths(3, 10)
    assert backend.frozen_lengths(BatchDescriptor(9, 3, True, 3), own, 64) == (3, 64)
    assert backend.frozen_lengths(BatchDescriptor(3, 3, True), own, 64) == (1, 64)
    assert backend.frozen_lengths(BatchDescriptor(9), own, 64) == (9, 64)


def test_a_uniform_decode_backend_keeps_decode_graphs_and_runs_verify_steps_outside(caplog):
    config = CompilationConfig(num_speculative_tokens=2, cache_dir="/tmp/kvgraph-test-cache")
    assert verify_query_len(config, GraphSupport.UNIFORM_DECODE) == 1
    assert verify_query_len(config, GraphSupport.UNIFORM_BATCH) == Q
    assert verify_query_len(config, GraphSupport.ALWAYS) == Q
    with caplog.at_level(logging.WARNING, "kvgraph.runtime.dispatcher"):
        mode = resolve_graph_mode(GraphMode.FULL_DECODE_ONLY, GraphSupport.UNIFORM_DECODE, "b",
                                  True, Q)
    assert mode is GraphMode.FULL_DECODE_ONLY
    assert "speculative steps (3 tokens a request) run without graphs" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, "kvgraph.runtime.dispatcher"):
        mode = resolve_graph_mode(GraphMode.FULL, GraphSupport.UNIFORM_BATCH, "b", True, Q)
    assert mode is GraphMode.FULL_AND_PIECEWISE and "speculative steps" not in caplog.text
    assert resolve_graph_mode(GraphMode.FULL_AND_PIECEWISE, GraphSupport.UNIFORM_BATCH, "b",
                              True, Q) is GraphMode.FULL_AND_PIECEWISE
