"""oneDNN-packed linear weights: the same results as plain weights, eager and in every graph
kind, still one compile for identical layers, the compile cache across processes' runners, and
plain weights kept where the processor has no oneDNN kernels for the dtype. fp32 weights take
oneDNN's layout here, as where kvgraph's fp32 tile kernel does not run (the tiles' own tests:
test_fp32_linear.py)."""

import logging

import pytest
import torch
from torch import nn

import kvgraph
from kvgraph.cpu import packed_linear
from kvgraph.compilation.counters import compile_counters
from kvgraph.cpu.linear_packing import LinearKernel, LinearPacking, linear_kernel, linear_packing
from kvgraph.cpu.packed_linear import (PackedLinear, can_pack, cpu_vendor, is_packed, linear,
                                       module_linear, pack_linear_weights, pack_weight,
                                       packed_dtypes)
from kvgraph.cpu.small_batch_linear import (SmallBatchLinear, small_batch_dtypes,
                                            use_small_batch_linear)
from tests.support.scenario import BLOCK_SIZE, CAPTURE_SIZES, NUM_BLOCKS, generate, make_model

pytestmark = [pytest.mark.usefixtures("fresh_compile_state"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")]

# oneDNN's bf16 kernels and torch's plain bf16 matmul round their sums in different orders.
BF16 = dict(atol=3e-2, rtol=3e-2)


def onednn_packs(dtype: torch.dtype):
    """Skips a test that packs `dtype` weights on a processor oneDNN has no kernels for."""
    return pytest.mark.skipif(not can_pack(dtype), reason=f"oneDNN cannot pack {dtype} here")


PACKS_BF16 = onednn_packs(torch.bfloat16)


@pytest.fixture(autouse=True)
def fp32_for_onednn(monkeypatch):
    tile_packable = packed_linear.tile_packable
    monkeypatch.setattr(packed_linear, "tile_packable",
                        lambda weight: weight.dtype != torch.float32 and tile_packable(weight))
# Whether fp32 weights are packed by default here (AMD with AVX-512: `packed_dtypes`).
PACKS_FP32 = torch.float32 in packed_dtypes()


def _linear_weights(model: nn.Module) -> list[torch.Tensor]:
    return [m.weight for m in model.modules()
            if isinstance(m, (nn.Linear, PackedLinear, SmallBatchLinear))]


@pytest.mark.parametrize("dtype", [torch.float32] + [
    pytest.param(dtype, marks=onednn_packs(dtype)) for dtype in (torch.bfloat16, torch.float16)])
def test_a_packed_linear_computes_the_plain_one(dtype):
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, dtype=dtype)
    x = torch.randn(5, 3, 48, dtype=dtype)
    packed = PackedLinear(plain)
    assert is_packed(packed.weight) and packed.weight.shape == (80, 48)
    with torch.no_grad():
        want = torch.nn.functional.linear(x.double(), plain.weight.double(), plain.bias.double())
        got = packed(x)
        assert got.shape == (5, 3, 80) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(linear(x, packed.weight, packed.bias), got, atol=0, rtol=0)


@PACKS_BF16
def test_only_the_asked_dtypes_and_plain_linears_are_packed():
    class OwnForward(nn.Linear):
        def forward(self, x):  # reads self.weight with F.linear: packing it would break it
            return super().forward(x) * 2

    class ReadsPacked(nn.Module):
        linear_packing = LinearPacking.READS_THROUGH_LINEAR

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(6, 4, dtype=torch.bfloat16))

        def forward(self, x):
            return module_linear(x, self)

    model = nn.ModuleDict({"plain": nn.Linear(4, 6, dtype=torch.bfloat16),
                           "fp32": nn.Linear(4, 6), "own": OwnForward(4, 6, dtype=torch.bfloat16),
                           "reads": ReadsPacked(), "embed": nn.Embedding(8, 4,
                                                                         dtype=torch.bfloat16)})
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with torch.no_grad():
        want = {name: model[name](x) for name in ("plain", "own", "reads")}
        assert pack_linear_weights(model) == 2 + PACKS_FP32
        assert isinstance(model["plain"], PackedLinear) and is_packed(model["reads"].weight)
        assert is_packed(model["fp32"].weight) == PACKS_FP32 and not is_packed(model["own"].weight)
        assert not is_packed(model["embed"].weight)
        for name, value in want.items():
            torch.testing.assert_close(model[name](x), value, **BF16)
        assert pack_linear_weights(model) == 0  # packed weights are not packed twice


def test_a_weight_that_is_not_a_2d_cpu_matrix_is_refused():
    with pytest.raises(ValueError, match=r"expected a 2-D CPU weight, got \(2, 3, 4\)"):
        pack_weight(torch.randn(2, 3, 4))


def _runner(model, mode, piece_compiler="eager", **config):
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler=piece_compiler,
                                       capture_sizes=CAPTURE_SIZES, check_graph_inputs=True,
                                       **config)
    return kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                               max_num_tokens=32, max_num_seqs=8)


def _bf16_model(kind: str, packed: bool, num_layers: int | None = None) -> nn.Module:
    model = make_model(kind, num_layers).to(torch.bfloat16)
    if packed:
        plain = [m for m in model.modules() if linear_packing(m) is LinearPacking.PLAIN]
        assert pack_linear_weights(model) == len(_linear_weights(model)) - len(plain) > 0
    return model


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_packed_fp32_models_run_in_graphs_as_plain_ones_do(mode):
    """fp32 weights packed for oneDNN (the default on AMD processors with AVX-512), captured and
    replayed: the plain model's tokens, its logits to fp32's rounding."""
    plain = _runner(make_model("llama"), "eager")
    want_logits, want_tokens = generate(plain, plain.vocab_size)
    model = make_model("llama")
    assert pack_linear_weights(model, dtypes=(torch.float32,)) == len(_linear_weights(model))
    runner = _runner(model, mode)
    assert runner.capture()["graphs"] > 0
    logits, tokens = generate(runner, runner.vocab_size)
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@PACKS_BF16
@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_packed_models_run_in_graphs_as_plain_ones_do(kind, mode):
    """The packed weights are graph inputs with no memory torch can point at: captured and
    replayed (the CPU graph checks every other input's address) with the plain model's tokens."""
    plain = _runner(_bf16_model(kind, packed=False), "eager")
    want_logits, want_tokens = generate(plain, plain.vocab_size)
    runner = _runner(_bf16_model(kind, packed=True), mode)
    assert runner.capture()["graphs"] > 0
    logits, tokens = generate(runner, runner.vocab_size)
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(logits, want_logits)):
        torch.testing.assert_close(got.float(), want.float(), **BF16, msg=f"step {step}")
    assert any(key.startswith(mode.split("_")[0]) for key in runner.stats()["hits"])


@PACKS_BF16
@pytest.mark.slow  # inductor
def test_identical_layers_still_compile_once_and_the_cache_loads(compile_cache_dir):
    runs = []
    for packed in (False, True, True):  # the second packed runner loads from the cache
        compile_counters.reset()
        torch._dynamo.reset()
        # Four layers: the pieces between layers 0-1, 1-2 and 2-3 are identical.
        runner = _runner(_bf16_model("llama", packed, num_layers=4), "piecewise", "inductor",
                         compile_sizes=(4,), cache_dir=compile_cache_dir)
        runner.capture()
        runs.append((compile_counters.snapshot(), generate(runner, runner.vocab_size)))
        runner.close()
    (plain, _), (cold, (cold_logits, cold_tokens)), (warm, (warm_logits, warm_tokens)) = runs
    assert cold["unique_pieces"] == plain["unique_pieces"] < cold["pieces"]
    assert warm["cache_hits"] > 0 and warm["builds"] == 0
    assert warm_tokens == cold_tokens
    for got, want in zip(warm_logits, cold_logits):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("flags, dtype, packed", [
    ([], "bfloat16", can_pack(torch.bfloat16)), (["--no-pack-weights"], "bfloat16", False),
    ([], "float32", PACKS_FP32),
    (["--no-pack-weights"], "float32", False)])
def test_the_engine_packs_the_processors_packed_dtypes_on_the_cpu_unless_told_not_to(flags, dtype,
                                                                                    packed):
    import argparse

    from examples.engine import add_engine_args, build_engine
    from examples.models import MODELS

    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--preset", "tiny", "--graph-mode", "piecewise", "--max-model-len", "64",
         "--dtype", dtype, *flags])
    engine, _ = build_engine(args, MODELS)
    try:
        weights = _linear_weights(engine.runner.model)
        assert weights and all(is_packed(w) == packed for w in weights)
        # fp32 linears (and bf16 ones oneDNN cannot pack) keep their weights and run the
        # small-batch kernel, unless told not to.
        small = [m for m in engine.runner.model.modules() if isinstance(m, SmallBatchLinear)]
        assert bool(small) == ("--no-pack-weights" not in flags and not packed
                               and getattr(torch, dtype) in small_batch_dtypes())
    finally:
        engine.runner.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_can_pack_says_what_onednn_does_on_this_processor(dtype):
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(32, 64, dtype=dtype), 16)
    except RuntimeError:
        packs = False
    else:
        packs = True
    assert can_pack(dtype) == packs


def test_a_dtype_onednn_cannot_pack_stays_plain_and_says_so_once(monkeypatch, caplog):
    """As on an AVX2-only processor (AMD Zen 3): bf16 weights are left plain, the model's
    outputs unchanged, one warning naming how many; asked directly, pack_weight refuses."""
    monkeypatch.setitem(packed_linear._ONEDNN_DTYPE_CHECKS, torch.bfloat16, lambda: False)
    monkeypatch.setattr(packed_linear, "tile_packable", lambda weight: False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48, dtype=torch.bfloat16),
                          nn.Linear(48, 16, dtype=torch.bfloat16), nn.Linear(16, 8))
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        want = model[1](model[0](x))
        with caplog.at_level(logging.INFO, logger="kvgraph"):
            assert pack_linear_weights(model, dtypes=(torch.bfloat16, torch.float32)) == 1
        assert not any(is_packed(m.weight) for m in model[:2]) and is_packed(model[2].weight)
        torch.testing.assert_close(model[1](model[0](x)), want, atol=0, rtol=0)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "oneDNN cannot pack 2 bfloat16 weights on this processor" in warning
    assert "torch's CPU capability" in warning and "AVX-512" in warning
    with pytest.raises(ValueError, match=r"oneDNN cannot pack bfloat16 weights on this processor"):
        pack_weight(model[0].weight)


@pytest.mark.parametrize("vendor, capability, fp32", [
    ("AuthenticAMD", "AVX512", True), ("AuthenticAMD", "AVX2", False),
    ("GenuineIntel", "AVX512", False), ("", "AVX512", False)])
def test_fp32_is_packed_by_default_on_amd_processors_with_avx512_only(
        monkeypatch, tmp_path, vendor, capability, fp32):
    """oneDNN's packed fp32 linear measured fastest at every batch size on a Zen 4 and slowest at
    a decode step's rows on a Xeon (docs/performance.md, "Packed weights"): the default follows the vendor."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu avx2\n"
                       if vendor else "processor\t: 0\n")
    assert cpu_vendor(cpuinfo) == vendor
    monkeypatch.setattr(packed_linear, "CPUINFO", cpuinfo)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    packed_dtypes.cache_clear()
    try:
        assert (torch.float32 in packed_dtypes()) == fp32
        assert {torch.bfloat16, torch.float16} <= set(packed_dtypes())
        model = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 16))
        x = torch.randn(5, 32)
        with torch.no_grad():
            want = model(x)
            assert pack_linear_weights(model) == (2 if fp32 else 0)
            torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    finally:
        packed_dtypes.cache_clear()


def test_a_missing_cpuinfo_names_no_vendor(tmp_path):
    assert cpu_vendor(tmp_path / "absent") == ""


def test_a_module_reading_its_weight_through_linear_says_it_is_packed_for_compilers():
    """A compiler traces with fake tensors, which do not keep oneDNN's layout: a module packed
    for oneDNN has the kernel recorded (`linear_kernel`) and passes it to `linear()`, which then
    calls the packed op on the fake weight too (reading the layout instead, it took F.linear: an
    mm over an mkldnn tensor at run time, found in two-rank serving on a Zen 4)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class ReadsPacked(nn.Module):
        linear_packing = LinearPacking.READS_THROUGH_LINEAR

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(48, 32))

    module = ReadsPacked()
    assert pack_linear_weights(nn.Sequential(module), dtypes=(torch.float32,)) == 1
    assert linear_kernel(module) is LinearKernel.ONEDNN and is_packed(module.weight)

    class Ops(TorchDispatchMode):
        """The ops called, by name (not tests.support.attention_reference's OpRecorder: it reruns
        kvgraph's ops on their CPU kernels, which fake tensors have no data for)."""

        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode() as mode:
        weight, x = mode.from_tensor(module.weight), torch.empty(3, 32)
        # What a compiler sees: torch 2.11-2.13's fake is strided (2.14's keeps the layout).
        with Ops() as ops:
            out = linear(x, weight, kernel=linear_kernel(module))
    assert out.shape == (3, 48)
    assert not any("mm" in name for name in ops.names), ops.names


def test_a_module_declaring_it_reads_through_linear_is_packed_in_place():
    """A module of its own declaring READS_THROUGH_LINEAR keeps its class, its weight packed and
    the kernel recorded; `module_linear` then computes F.linear's result (float64-checked)."""
    class ReadsPacked(nn.Module):
        linear_packing = LinearPacking.READS_THROUGH_LINEAR

        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(48, 32))
            self.bias = nn.Parameter(torch.randn(48))

        def forward(self, x):
            return module_linear(x, self, self.bias)

    torch.manual_seed(0)
    module = ReadsPacked()
    plain = module.weight.detach().clone()
    model = nn.Sequential(module)
    assert pack_linear_weights(model, dtypes=(torch.float32,)) == 1
    assert model[0] is module and is_packed(module.weight)
    assert linear_kernel(module) is LinearKernel.ONEDNN  # fp32 tiles are off in this file
    x = torch.randn(5, 32)
    with torch.no_grad():
        want = nn.functional.linear(x.double(), plain.double(), module.bias.double())
        torch.testing.assert_close(module(x).double(), want, atol=1e-5, rtol=1e-5)


def test_a_linear_declared_plain_is_left_alone_by_both_transforms():
    def model():
        kept = nn.Linear(32, 48)
        kept.linear_packing = LinearPacking.PLAIN
        return nn.ModuleDict({"kept": kept, "swapped": nn.Linear(32, 48)})

    packed, small = model(), model()
    weights = {id(m): m["kept"].weight for m in (packed, small)}
    assert pack_linear_weights(packed, dtypes=(torch.float32,)) == 1
    assert isinstance(packed["swapped"], PackedLinear)
    use_small_batch_linear(small)  # 0 where the CPU kernels cannot be built
    for m in (packed, small):
        assert type(m["kept"]) is nn.Linear and m["kept"].weight is weights[id(m)]
        assert not is_packed(m["kept"].weight) and not hasattr(m["kept"], "linear_kernel")


@pytest.mark.parametrize("transform", [pack_linear_weights, use_small_batch_linear])
def test_an_unknown_declaration_is_refused_before_anything_changes(transform):
    wrong = nn.Linear(32, 48)
    wrong.linear_packing = "plain"  # a string, not a LinearPacking
    model = nn.ModuleDict({"first": nn.Linear(32, 48), "wrong": wrong})
    with pytest.raises(TypeError, match=r"wrong \(Linear\)\.linear_packing: expected a "
                                        r"LinearPacking \(LINEAR, READS_THROUGH_LINEAR, PLAIN\), "
                                        r"got 'plain'"):
        transform(model)
    assert type(model["first"]) is nn.Linear and not is_packed(model["first"].weight)
