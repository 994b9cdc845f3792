"""What capturing the ops in device graphs needs: no host sync on the decode path (checked by
recording every op, and by running on the meta device), and torch.library.opcheck."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvgraph
from tests.support.attention_reference import (
    D, HEAD_CONFIGS, LAYER, OpRecorder, assert_close, encoder_batch, random_attention_batch,
    random_mla_batch, with_padding,
)


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
