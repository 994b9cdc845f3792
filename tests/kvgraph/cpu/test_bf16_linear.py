"""kvgraph's bf16 tile kernel (`kvgraph_cpu::bf16_linear`, bf16_linear.cpp) and the tile layout
`pack_weight` gives bf16 weights where the processor has AVX512-BF16: the float64 product for
every path (dot products up to 4 rows, one AMX row tile up to 16, 32-row blocks past it, chunks
past 256; without AMX dot products for all: 6 rows at a time, 48 an item, 512 pairs of inputs a
chunk), bias, strided and 3-D inputs, the layout itself, clear errors, and which weights take
it."""

import pytest
import torch
from torch import nn

from kvgraph.cpu.packed_linear import (PackedLinear, can_pack, is_packed, linear, pack_linear_weights,
                                   pack_weight)
from kvgraph.cpu.tile_weights import bf16_tiles_usable, is_tile_packed
from tests.support.scenario import make_model
from tests.support.measured import assert_measured

pytestmark = pytest.mark.skipif(
    not bf16_tiles_usable(), reason="no AVX512-BF16 here, or kvgraph's CPU kernels cannot be built")

ROWS = [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 23, 24, 25, 31, 32, 33, 47, 48, 49, 100, 300]


def _close_to_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> None:
    want = nn.functional.linear(x.double(), weight.double(),
                                None if bias is None else bias.double())
    # Products of bf16 values are exact in fp32; the sums' order and the output's rounding to
    # bf16 (relative 2^-8) are what differ from float64.
    scale = want.abs().amax().item()
    torch.testing.assert_close(got.double(), want, atol=scale * 2 ** -7, rtol=2 ** -7)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (48, 64), (768, 512),
                                                       (80, 1408)])
def test_the_float64_product_on_every_path(rows, out_features, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    weight = torch.randn(out_features, in_features, dtype=torch.bfloat16) / in_features ** 0.5
    bias = torch.randn(out_features, dtype=torch.bfloat16)
    packed = pack_weight(weight)
    assert is_tile_packed(packed)
    for b in (None, bias):
        got = torch.ops.kvgraph_cpu.bf16_linear(x, packed, b)
        assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
        _close_to_float64(got, x, weight, b)


def test_the_layout_holds_sixteen_outputs_pairs_of_inputs_per_row():
    weight = torch.arange(32 * 64, dtype=torch.float32).reshape(32, 64).to(torch.bfloat16)
    packed = pack_weight(weight)
    assert packed.shape == (2, 32, 16, 2) and packed.is_contiguous()
    for b, p, j, t in [(0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 5, 1), (1, 7, 3, 0), (1, 31, 15, 1)]:
        assert packed[b, p, j, t] == weight[16 * b + j, 2 * p + t]


@pytest.mark.parametrize("rows", [3, 20])
def test_strided_rows_and_leading_dims_are_read_as_they_are(rows):
    torch.manual_seed(0)
    weight = torch.randn(32, 64, dtype=torch.bfloat16) / 8
    packed = pack_weight(weight)
    wide = torch.randn(rows, 100, dtype=torch.bfloat16)
    sliced = wide[:, 20:84]  # a row stride of 100, as a slice of a fused projection has
    assert not sliced.is_contiguous()
    _close_to_float64(linear(sliced, packed), sliced, weight, None)
    x = torch.randn(2, rows, 64, dtype=torch.bfloat16)
    got = linear(x, packed)
    assert got.shape == (2, rows, 32)
    _close_to_float64(got, x, weight, None)


def test_bad_inputs_are_refused_with_what_was_expected():
    packed = pack_weight(torch.randn(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"expected bf16 x \[\.\.\., 64\], got Float"):
        torch.ops.kvgraph_cpu.bf16_linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match=r"expected bf16 x \[\.\.\., 64\], got BFloat16 \[2, 48\]"):
        torch.ops.kvgraph_cpu.bf16_linear(torch.randn(2, 48, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match=r"expected a packed bf16 weight"):
        torch.ops.kvgraph_cpu.bf16_linear(torch.randn(2, 64, dtype=torch.bfloat16),
                                          torch.randn(32, 64, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match=r"expected a bias \[32\], got \[31\]"):
        torch.ops.kvgraph_cpu.bf16_linear(torch.randn(2, 64, dtype=torch.bfloat16), packed,
                                          torch.randn(31, dtype=torch.bfloat16))


def test_only_bf16_weights_of_whole_tiles_take_the_layout():
    """[16 n, 32 k] bf16 weights take the tile layout; others keep oneDNN's (fp16, or a shape
    the tiles do not cover), and both compute the same linear through `PackedLinear`."""
    torch.manual_seed(0)
    for dtype, out_features, in_features, tiles in [(torch.bfloat16, 48, 64, True),
                                                     (torch.bfloat16, 40, 64, False),
                                                     (torch.bfloat16, 48, 40, False),
                                                     (torch.float16, 48, 64, False)]:
        if not can_pack(dtype):  # fp16 wants AVX-512-FP16, which a Zen 4 has not
            continue
        plain = nn.Linear(in_features, out_features, dtype=dtype)
        module = PackedLinear(plain)
        assert is_packed(module.weight) and is_tile_packed(module.weight) == tiles
        assert ("bf16 tiles" in repr(module)) == tiles
        x = torch.randn(6, in_features, dtype=dtype)
        with torch.no_grad():
            _close_to_float64(module(x), x, plain.weight, plain.bias)


def test_a_bf16_model_packs_every_linear_into_tiles():
    model = make_model("llama").to(torch.bfloat16)
    packed = pack_linear_weights(model)
    linears = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert packed == len(linears) > 0 and all(is_tile_packed(m.weight) for m in linears)


def test_the_benchmark_times_both_layouts(tmp_path):
    from examples.benchmarks import tile_linear
    payload = tile_linear.main(["--preset", "tiny", "--rows", "1", "20", "--rounds", "1",
                                "--json", str(tmp_path / "bf16.json")])
    assert [row["rows"] for row in payload["results"]] == [1, 20]
    assert_measured(ms for row in payload["results"] for ms in row["ms"].values())
    assert (tmp_path / "bf16.json").exists()
