"""unified_mla_attention and the MLAAttention layer against the float64 MLA reference."""

from __future__ import annotations

import pytest
import torch

import kvgraph
from tests.support.attention_reference import (
    BLOCK_SIZES, H, KINDS, LAYER, LORA, ROPE, assert_close, check_caches,
    check_inputs_unchanged, random_mla_batch, ref_mla, run_mla_op,
)


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
