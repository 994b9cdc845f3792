"""The small-batch linear (`kvgraph_cpu::small_batch_linear`, SmallBatchLinear), fp32 and bf16:
the float64 product for every row count, ragged shapes and strided inputs; each row the same
bits whatever batch it came in; F.linear past its rows (bf16 widened to fp32); which linears
take it (bf16 only where oneDNN cannot pack it); and models whose linears run it generating
what plain ones do, in graphs, with eager and inductor pieces."""

import pytest
import torch
from torch import nn

import kvgraph
from kvgraph.cpu import packed_linear
from kvgraph.cpu.linear_packing import LinearKernel, LinearPacking, linear_kernel
from kvgraph.cpu.small_batch_linear import (SmallBatchLinear, small_batch_dtypes,
                                        small_batch_kernel_loaded, small_batch_max_rows,
                                        use_small_batch_linear)
from tests.support.attention_reference import OpRecorder
from tests.support.scenario import BLOCK_SIZE, CAPTURE_SIZES, NUM_BLOCKS, generate, make_model
from tests.support.measured import assert_measured

pytestmark = pytest.mark.skipif(not small_batch_kernel_loaded(),
                                reason="kvgraph's CPU kernels cannot be built here")

# fp32 sums of up to 1408 products in another order than float64's.
FP32 = dict(atol=2e-4, rtol=1e-4)
# Tiles of 2 or 4 rows (AVX2: 2 up to 8 rows, 4 past them) and every remainder of either; past
# 16 (AVX-512) or 48 (AVX2) rows F.linear: 17, 40, 47 and 48 run either, 49 and 70 F.linear.
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 13, 16, 17, 40, 47, 48, 49, 70]


def small_batch_linear(x, weight, bias=None):
    return torch.ops.kvgraph_cpu.small_batch_linear(x, weight, bias)


def assert_float64_product(got, x, weight, bias):
    want = nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    if got.dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, **FP32)
    else:  # bf16 products are exact in fp32; the sums' order and the output's rounding are not
        scale = want.abs().amax().item()
        torch.testing.assert_close(got.double(), want, atol=scale * 2**-7, rtol=2**-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("out_features, in_features",  # passes of 3 or 4 outputs, ragged
                         [(1, 1), (3, 17), (5, 24), (130, 512), (7, 1408)])
def test_the_float64_product_for_every_row_count_and_ragged_shape(rows, out_features,
                                                                  in_features, dtype):
    torch.manual_seed(rows)
    x = torch.randn(rows, in_features, dtype=dtype)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    bias = torch.randn(out_features, dtype=dtype)
    for b in (None, bias):
        got = small_batch_linear(x, weight, b)
        assert got.dtype == dtype
        assert_float64_product(got, x, weight, b)


def test_strided_rows_and_leading_dims_are_read_as_they_are():
    torch.manual_seed(0)
    weight, bias = torch.randn(12, 40), torch.randn(12)
    wide = torch.randn(6, 100)
    rows = wide[:, 30:70]  # a row stride of 100, as a slice of a fused projection has
    assert not rows.is_contiguous()
    torch.testing.assert_close(small_batch_linear(rows, weight, bias),
                               nn.functional.linear(rows, weight, bias), **FP32)
    x = torch.randn(2, 3, 40)
    got = small_batch_linear(x, weight, bias)
    assert got.shape == (2, 3, 12)
    torch.testing.assert_close(got, nn.functional.linear(x, weight, bias), **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_in_any_batch(dtype):
    """Each output is one dot product summed in one order, whatever else is in the batch: a
    request's tokens do not depend on its neighbours in a decode step."""
    torch.manual_seed(0)
    x, weight = torch.randn(16, 512, dtype=dtype), torch.randn(96, 512, dtype=dtype)
    batch = small_batch_linear(x, weight)
    for i in range(16):
        assert torch.equal(small_batch_linear(x[i:i + 1], weight), batch[i:i + 1])
    for rows in (slice(3, 9), slice(2, 12)):  # tiles of other shapes on AVX2 (up to 8 rows, more)
        assert torch.equal(small_batch_linear(x[rows], weight), batch[rows])


def test_batches_past_its_rows_run_f_linear_and_no_build_claims_more_than_measured():
    max_rows = small_batch_max_rows()
    # AVX-512, AVX2 (what docs/performance.md's measurements support), or built without AVX2 and FMA
    assert max_rows in (16, 48, 0)
    torch.manual_seed(0)
    x, weight = torch.randn(max_rows + 1, 64), torch.randn(24, 64)
    assert torch.equal(small_batch_linear(x, weight), nn.functional.linear(x, weight))
    bf16 = x.bfloat16(), weight.bfloat16()  # widened to fp32 for MKL, the result rounded back
    want = nn.functional.linear(bf16[0].float(), bf16[1].float()).bfloat16()
    assert torch.equal(small_batch_linear(*bf16), want)


def test_other_dtypes_and_shapes_that_disagree():
    weight = torch.randn(8, 16, dtype=torch.float16)
    x = torch.randn(2, 16, dtype=torch.float16)
    assert torch.equal(small_batch_linear(x, weight), nn.functional.linear(x, weight))
    with pytest.raises(RuntimeError, match=r"x \[..., in\] and weight \[out, in\] disagree"):
        small_batch_linear(torch.randn(2, 15), torch.randn(8, 16))


@pytest.mark.parametrize("bf16_packs", [True, False])
def test_only_plain_fp32_and_unpackable_bf16_linears_change_their_weights_the_same_tensors(
        bf16_packs, monkeypatch):
    """bf16 linears take the kernel only where oneDNN cannot pack bf16 (an AVX2-only CPU):
    elsewhere they are packed for oneDNN or AMX instead."""
    monkeypatch.setitem(packed_linear._ONEDNN_DTYPE_CHECKS, torch.bfloat16, lambda: bf16_packs)
    assert small_batch_dtypes() == ((torch.float32,) if bf16_packs
                                    else (torch.float32, torch.bfloat16))

    class OwnForward(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    keeps = nn.Linear(4, 6)
    keeps.linear_packing = LinearPacking.PLAIN
    model = nn.ModuleDict({"fp32": nn.Linear(4, 6), "bf16": nn.Linear(4, 6, dtype=torch.bfloat16),
                           "fp16": nn.Linear(4, 6, dtype=torch.float16),
                           "own": OwnForward(4, 6), "keeps": keeps})
    weights = {name: model[name].weight for name in ("fp32", "bf16")}
    x = torch.randn(3, 4)
    with torch.no_grad():
        want = {name: model[name](x.to(weights[name].dtype)) for name in weights}
        assert use_small_batch_linear(model) == (1 if bf16_packs else 2)
        assert isinstance(model["fp32"], SmallBatchLinear)
        assert isinstance(model["bf16"], SmallBatchLinear) != bf16_packs
        assert all(model[name].weight is weight for name, weight in weights.items())
        assert type(model["own"]) is OwnForward and type(model["keeps"]) is nn.Linear
        assert type(model["fp16"]) is nn.Linear
        torch.testing.assert_close(model["fp32"](x), want["fp32"], **FP32)
        torch.testing.assert_close(model["bf16"](x.bfloat16()), want["bf16"], atol=2e-2,
                                   rtol=2e-2)
    assert use_small_batch_linear(model) == 0  # nothing left to change


def test_a_module_reading_its_weight_through_linear_is_told_to_run_it():
    """The tensor-parallel row-parallel linear reads its weight through `linear()`: it gets
    the kernel recorded (`linear_kernel`, fp32 here) and the kernel runs its rows; an fp16 one
    keeps F.linear."""
    from examples.models.tensor_parallel import RowParallelLinear
    from kvgraph.distributed import TensorParallelGroup

    tp = TensorParallelGroup(None, 0, 1)
    model = nn.ModuleDict({"fp32": RowParallelLinear(16, 8, bias=False, tp=tp),
                           "fp16": RowParallelLinear(16, 8, tp=tp, dtype=torch.float16)})
    assert use_small_batch_linear(model) == 1
    assert linear_kernel(model["fp32"]) is LinearKernel.SMALL_BATCH
    assert linear_kernel(model["fp16"]) is LinearKernel.TORCH
    x = torch.randn(3, 16)
    with torch.no_grad(), OpRecorder() as ops:
        got = model["fp32"](x)
    assert "kvgraph_cpu.small_batch_linear.default" in ops.ops
    assert torch.equal(got, small_batch_linear(x, model["fp32"].weight))
    torch.testing.assert_close(got, nn.functional.linear(x, model["fp32"].weight), **FP32)


def _runner(model, mode, piece_compiler="eager", **config):
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler=piece_compiler,
                                       capture_sizes=CAPTURE_SIZES, check_graph_inputs=True,
                                       **config)
    return kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                               max_num_tokens=32, max_num_seqs=8)


def _model(kind, small_batch, num_layers=None):
    model = make_model(kind, num_layers)
    if small_batch:
        assert use_small_batch_linear(model) > 0
    return model


def _assert_generates_like(runner, plain):
    want_logits, want_tokens = generate(plain, plain.vocab_size)
    logits, tokens = generate(runner, runner.vocab_size)
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        torch.testing.assert_close(got, want, **FP32, msg=f"step {step}")


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_models_run_in_graphs_as_plain_ones_do(kind, mode):
    runner = _runner(_model(kind, small_batch=True), mode)
    assert runner.capture()["graphs"] > 0
    _assert_generates_like(runner, _runner(_model(kind, small_batch=False), "eager"))


def test_a_bf16_model_whose_linears_run_it_generates_what_the_plain_one_does(monkeypatch):
    monkeypatch.setitem(packed_linear._ONEDNN_DTYPE_CHECKS, torch.bfloat16, lambda: False)
    plain = _runner(make_model("llama").to(torch.bfloat16), "eager")
    model = make_model("llama").to(torch.bfloat16)
    assert use_small_batch_linear(model) > 0
    runner = _runner(model, "full_and_piecewise")
    assert runner.capture()["graphs"] > 0
    want_logits, want_tokens = generate(plain, plain.vocab_size)
    logits, tokens = generate(runner, runner.vocab_size)
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2,
                                   msg=f"step {step}")


@pytest.mark.slow  # inductor
def test_inductor_compiles_around_it_for_any_row_count(fresh_compile_state):
    """Inductor traces the op through its fake (shape only) and calls it from its code: one
    compile with a dynamic row count serves a decode step's rows and a prefill's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.SiLU(), nn.Linear(96, 32))
    inputs = [torch.randn(rows, 64) for rows in (1, 7, 40)]
    with torch.no_grad():
        want = [model(x) for x in inputs]  # plain linears, eager
        assert use_small_batch_linear(model) == 2
        compiled = torch.compile(model, backend="inductor", dynamic=True)
        for x, expected in zip(inputs, want):
            torch.testing.assert_close(compiled(x), expected, **FP32)


def test_the_benchmark_times_both_kernels(tmp_path):
    from examples.benchmarks import small_batch_linear as benchmark
    payload = benchmark.main(["--preset", "tiny", "--rows", "1", "20", "--rounds", "1",
                              "--json", str(tmp_path / "sbl.json")])
    assert [row["rows"] for row in payload["results"]] == [1, 20]
    assert_measured(ms for row in payload["results"] for ms in row["ms"].values())
    assert (tmp_path / "sbl.json").exists()


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_the_benchmark_times_onednns_packed_linear_beside_them(tmp_path):
    from examples.benchmarks import small_batch_linear as benchmark
    payload = benchmark.main(["--preset", "tiny", "--rows", "2", "--rounds", "1", "--onednn",
                              "--json", str(tmp_path / "sbl.json")])
    (row,) = payload["results"]
    assert_measured([row["ms"]["oneDNN"], row["onednn_ratio"]])
    w = torch.randn(48, 32)
    x = torch.randn(2, 32)
    torch.testing.assert_close(benchmark.onednn_matmul([w])(x, w), x @ w.T, atol=1e-5, rtol=1e-5)


def test_the_benchmark_times_another_version_of_the_kernel_beside_it(tmp_path):
    from examples.benchmarks import small_batch_linear as benchmark
    # The shipped source under another op namespace: the same kernel, so the same results.
    payload = benchmark.main(["--preset", "tiny", "--rows", "3", "--rounds", "1",
                              "--against", str(benchmark.KERNEL_SOURCE),
                              "--json", str(tmp_path / "sbl.json")])
    (row,) = payload["results"]
    assert_measured([row["ms"]["against"], row["ratio_to_against"]])
    x, w = torch.randn(3, 24), torch.randn(5, 24)
    torch.testing.assert_close(torch.ops.kvgraph_cpu_against.small_batch_linear(x, w, None),
                               torch.ops.kvgraph_cpu.small_batch_linear(x, w, None),
                               rtol=0, atol=0)


def test_the_benchmark_names_a_revision_it_cannot_find():
    from examples.benchmarks import small_batch_linear as benchmark
    with pytest.raises(SystemExit, match="not a file, nor a git revision"):
        benchmark.against_source("no-such-revision-kvgraph")
