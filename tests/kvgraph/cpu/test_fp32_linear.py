"""kvgraph's fp32 tile kernel (`kvgraph_cpu::fp32_linear`, fp32_linear.cpp) and the fp32 tile
layout `pack_weight` gives fp32 weights where the processor has AVX-512: the float64 product
over every row count the loop splits differently (6 rows at a time, 48 an item, 512 inputs a
chunk, passes of 64 outputs and a last partial one), bias, strided and 3-D inputs, the layout
itself, clear errors, which weights take it, and a packed model in graphs against the plain
one."""

import pytest
import torch
from torch import nn

from kvgraph.cpu.linear_packing import LinearKernel, LinearPacking, linear_kernel
from kvgraph.cpu.packed_linear import (PackedLinear, is_packed, linear, module_linear,
                                       pack_linear_weights, pack_weight)
from kvgraph.cpu.tile_weights import from_tiles, fp32_tiles_usable, is_tile_packed, to_tiles
from tests.support.scenario import BLOCK_SIZE, CAPTURE_SIZES, NUM_BLOCKS, generate, make_model
from tests.support.measured import assert_measured

pytestmark = pytest.mark.skipif(
    not fp32_tiles_usable(), reason="no AVX-512 here, or kvgraph's CPU kernels cannot be built")

ROWS = [1, 2, 5, 6, 7, 12, 16, 23, 24, 25, 47, 48, 49, 100]


def _close_to_float64(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      bias: torch.Tensor | None) -> None:
    want = nn.functional.linear(x.double(), weight.double(),
                                None if bias is None else bias.double())
    # fp32 sums of `in` products: each rounding relative 2^-24, the errors grow with the count.
    scale = want.abs().amax().item()
    torch.testing.assert_close(got.double(), want, atol=scale * x.shape[-1] * 2 ** -22,
                               rtol=2 ** -18)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features, in_features", [(16, 1), (48, 37), (80, 300),
                                                       (768, 512), (64, 1408)])
def test_the_float64_product_for_every_split(rows, out_features, in_features):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features)
    weight = torch.randn(out_features, in_features) / in_features ** 0.5
    bias = torch.randn(out_features)
    packed = pack_weight(weight)
    assert is_tile_packed(packed) and packed.shape == (out_features // 16, in_features, 16)
    for b in (None, bias):
        got = torch.ops.kvgraph_cpu.fp32_linear(x, packed, b)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        _close_to_float64(got, x, weight, b)


def test_a_row_has_the_same_bits_alone_and_in_a_batch():
    """Each output's sum runs in one order whatever the batch, so a request's logits do not
    depend on what it is batched with."""
    torch.manual_seed(0)
    weight, x = torch.randn(96, 200), torch.randn(30, 200)
    packed = pack_weight(weight)
    batch = torch.ops.kvgraph_cpu.fp32_linear(x, packed, None)
    for row in (0, 5, 6, 29):
        alone = torch.ops.kvgraph_cpu.fp32_linear(x[row:row + 1], packed, None)
        assert torch.equal(alone[0], batch[row])


def test_the_layout_holds_sixteen_outputs_of_one_input_per_row():
    weight = torch.arange(32 * 24, dtype=torch.float32).reshape(32, 24)
    packed = pack_weight(weight)
    assert packed.shape == (2, 24, 16) and packed.is_contiguous()
    for b, k, j in [(0, 0, 0), (0, 0, 5), (0, 7, 15), (1, 0, 3), (1, 23, 15)]:
        assert packed[b, k, j] == weight[16 * b + j, k]
    assert torch.equal(from_tiles(packed), weight) and torch.equal(to_tiles(weight), packed)


@pytest.mark.parametrize("rows", [3, 30])
def test_strided_rows_and_leading_dims_are_read_as_they_are(rows):
    torch.manual_seed(0)
    weight = torch.randn(32, 64) / 8
    packed = pack_weight(weight)
    sliced = torch.randn(rows, 100)[:, 20:84]  # a row stride of 100, as a fused projection's
    assert not sliced.is_contiguous()
    _close_to_float64(linear(sliced, packed), sliced, weight, None)
    x = torch.randn(2, rows, 64)
    got = linear(x, packed)
    assert got.shape == (2, rows, 32)
    _close_to_float64(got, x, weight, None)
    assert linear(torch.empty(0, 64), packed).shape == (0, 32)


def test_bad_inputs_are_refused_with_what_was_expected():
    packed = pack_weight(torch.randn(32, 64))
    with pytest.raises(RuntimeError, match=r"expected fp32 x \[\.\.\., 64\], got BFloat16"):
        torch.ops.kvgraph_cpu.fp32_linear(torch.randn(2, 64, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match=r"expected fp32 x \[\.\.\., 64\], got Float \[2, 48\]"):
        torch.ops.kvgraph_cpu.fp32_linear(torch.randn(2, 48), packed, None)
    with pytest.raises(RuntimeError, match=r"expected a packed fp32 weight \[N / 16, K, 16\], "
                                           r"got Float \[32, 64\]"):
        torch.ops.kvgraph_cpu.fp32_linear(torch.randn(2, 64), torch.randn(32, 64), None)
    with pytest.raises(RuntimeError, match=r"expected a bias \[32\], got \[31\]"):
        torch.ops.kvgraph_cpu.fp32_linear(torch.randn(2, 64), packed, torch.randn(31))


def test_only_fp32_weights_of_whole_column_blocks_take_the_layout():
    """[16 n, k] fp32 weights take the tile layout; another shape keeps oneDNN's, and both
    compute the same linear through `PackedLinear`."""
    torch.manual_seed(0)
    for out_features, in_features, tiles in [(48, 20, True), (40, 64, False)]:
        plain = nn.Linear(in_features, out_features)
        module = PackedLinear(plain)
        assert is_packed(module.weight) and is_tile_packed(module.weight) == tiles
        assert ("fp32 tiles" in repr(module)) == tiles
        x = torch.randn(6, in_features)
        with torch.no_grad():
            _close_to_float64(module(x), x, plain.weight, plain.bias)


def test_a_module_reading_tiles_through_linear_records_the_tile_kernel():
    class ReadsPacked(nn.Module):
        linear_packing = LinearPacking.READS_THROUGH_LINEAR

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(48, 32))

    module = ReadsPacked()
    plain = module.weight.detach().clone()
    assert pack_linear_weights(nn.Sequential(module), dtypes=(torch.float32,)) == 1
    assert is_tile_packed(module.weight) and linear_kernel(module) is LinearKernel.TILES
    x = torch.randn(3, 32)
    _close_to_float64(module_linear(x, module), x, plain, None)


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_tile_packed_fp32_model_runs_in_graphs_as_the_plain_one_does(mode):
    """Tile-packed weights are ordinary tensors, graph inputs: captured and replayed (the CPU
    graph checks every input's address) with the plain eager model's tokens."""
    import kvgraph

    def runner(model, graph_mode):
        config = kvgraph.CompilationConfig(graph_mode=graph_mode, piece_compiler="eager",
                                           capture_sizes=CAPTURE_SIZES, check_graph_inputs=True)
        return kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                   max_num_tokens=32, max_num_seqs=8)

    plain = runner(make_model("llama"), "eager")
    want_logits, want_tokens = generate(plain, plain.vocab_size)
    model = make_model("llama")
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert pack_linear_weights(model, dtypes=(torch.float32,)) == len(linears)
    assert all(is_tile_packed(m.weight) for m in model.modules() if isinstance(m, PackedLinear))
    packed = runner(model, mode)
    assert packed.capture()["graphs"] > 0
    logits, tokens = generate(packed, packed.vocab_size)
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


def test_the_benchmark_times_both_layouts(tmp_path):
    from examples.benchmarks import tile_linear
    payload = tile_linear.main(["--dtype", "float32", "--preset", "tiny", "--rows", "1", "30",
                                "--rounds", "1", "--json", str(tmp_path / "fp32.json")])
    assert [row["rows"] for row in payload["results"]] == [1, 30]
    assert_measured(ms for row in payload["results"] for ms in row["ms"].values())
    assert (tmp_path / "fp32.json").exists()
