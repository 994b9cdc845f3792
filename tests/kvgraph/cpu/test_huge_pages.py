"""CPU weights in huge-page memory: the same values and ties, the pages really huge where Linux
gives them, untouched where it does not, and a model so moved captured and replayed with the
tokens of one that was not."""

import argparse

import pytest
import torch
from torch import nn

import kvgraph
from kvgraph.compilation.counters import compile_counters
from kvgraph.cpu.huge_pages import (ALIGNMENT, HUGE_PAGE, huge_page_tensors, thp_unavailable_reason,
                                use_huge_pages)
from tests.support.scenario import BLOCK_SIZE, CAPTURE_SIZES, NUM_BLOCKS, generate, make_model
from tests.support.measured import assert_measured

THP = pytest.mark.skipif(thp_unavailable_reason() is not None,
                         reason=f"no transparent huge pages: {thp_unavailable_reason()}")


class TiedLM(nn.Module):
    """An embedding whose matrix the output layer shares, a bias-free and a biased linear."""

    def __init__(self, vocab: int = 64, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(self.proj(self.embed(ids))))


def _huge_page_kib(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@THP
def test_moved_weights_keep_values_ties_and_grad_flags_in_one_aligned_mapping():
    torch.manual_seed(0)
    model = TiedLM()
    model.norm.weight.requires_grad_(False)
    ids = torch.randint(64, (5,))
    want = model(ids).detach()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    moved = use_huge_pages(model)

    params = dict(model.named_parameters())
    assert moved.parameters == len(params) == len(before) and moved.reason is None
    assert model.lm_head.weight is model.embed.weight  # still one parameter
    for name, p in params.items():
        assert isinstance(p, nn.Parameter) and p.is_contiguous()
        assert torch.equal(p, before[name]), name
        assert p.data_ptr() % ALIGNMENT == 0, name
    assert not model.norm.weight.requires_grad and model.proj.weight.requires_grad
    first = min(p.data_ptr() for p in params.values())
    last = max(p.data_ptr() + p.numel() * p.element_size() for p in params.values())
    assert first % HUGE_PAGE == 0 and last - first <= moved.nbytes  # one arena, in order
    assert torch.equal(model(ids), want)


@THP
def test_attributes_a_loader_set_on_a_parameter_come_along():
    model = TiedLM()
    model.proj.weight.shard_dim = 0
    use_huge_pages(model)
    assert model.proj.weight.shard_dim == 0


@THP
def test_a_mapping_that_fails_moves_nothing_and_says_why(monkeypatch, caplog):
    from kvgraph.cpu import huge_pages

    def no_memory(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", no_memory)
    model = TiedLM()
    params = list(model.parameters())
    with caplog.at_level("WARNING", logger="kvgraph.cpu.huge_pages"):
        moved = use_huge_pages(model)
    assert moved.parameters == 0 and "Cannot allocate memory" in moved.reason
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert "4 KiB pages" in caplog.text


@THP
def test_the_mapping_is_backed_by_huge_pages():
    model = nn.Linear(1024, 2048, bias=False)  # 8 MiB: whole 2 MiB pages
    use_huge_pages(model)
    assert _huge_page_kib(model.weight.data_ptr()) >= HUGE_PAGE // 1024


def test_huge_page_tensors_are_zeroed_aligned_and_of_the_asked_layouts():
    layouts = [((3, 5), torch.float32), ((0,), torch.bfloat16), ((7,), torch.int64),
               ((2, 3), torch.float16)]
    tensors = huge_page_tensors(layouts)
    for t, (shape, dtype) in zip(tensors, layouts):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGNMENT == 0 and not t.any()
    tensors[0].fill_(1)
    assert not tensors[2].any() and not tensors[3].any()  # no overlap


def test_without_transparent_huge_pages_nothing_moves_and_the_reason_is_logged(tmp_path, caplog):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    model = TiedLM()
    params = list(model.parameters())
    with caplog.at_level("INFO", logger="kvgraph.cpu.huge_pages"):
        moved = use_huge_pages(model, setting)
    assert moved.parameters == 0 and "never" in moved.reason
    assert all(a is b for a, b in zip(model.parameters(), params))
    assert "4 KiB pages" in caplog.text and "never" in caplog.text
    missing = use_huge_pages(model, tmp_path / "absent")
    assert missing.parameters == 0 and "cannot read" in missing.reason


@THP
@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN")
def test_weights_in_an_opaque_packed_layout_stay_where_they_are():
    model = TiedLM()
    model.proj.weight = nn.Parameter(model.proj.weight.detach().to_mkldnn(), requires_grad=False)
    packed = model.proj.weight
    moved = use_huge_pages(model)
    assert model.proj.weight is packed and moved.parameters == len(list(model.parameters())) - 1


@THP
@pytest.mark.usefixtures("fresh_compile_state")
@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_a_moved_model_is_captured_and_replayed_with_the_plain_models_tokens(mode):
    """The CPU graph checks its inputs' addresses on replay, so weights moved after capture
    would fail; moved before, identical layers still compile once."""
    runs = []
    for huge in (False, True):
        compile_counters.reset()
        torch._dynamo.reset()
        model = make_model("llama", num_layers=3)
        if huge:
            assert use_huge_pages(model).parameters == len(list(model.parameters()))
        config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager",
                                           capture_sizes=CAPTURE_SIZES, check_graph_inputs=True)
        runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS,
                                     block_size=BLOCK_SIZE, max_num_tokens=32, max_num_seqs=8)
        assert runner.capture()["graphs"] > 0
        runs.append((generate(runner, runner.vocab_size), compile_counters.snapshot()))
        runner.close()
    ((plain_logits, plain_tokens), plain), ((logits, tokens), moved) = runs
    assert tokens == plain_tokens
    for got, want in zip(logits, plain_logits):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert moved["unique_pieces"] == plain["unique_pieces"]


@THP
@pytest.mark.slow  # inductor
@pytest.mark.usefixtures("fresh_compile_state")
def test_inductor_pieces_built_for_unmoved_weights_load_for_moved_ones(compile_cache_dir):
    """Moved weights are views at other offsets of one mapping: the compile cache's keys and
    inductor's code must not depend on that, or each layer would build anew."""
    runs = []
    for huge in (False, True):
        compile_counters.reset()
        torch._dynamo.reset()
        model = make_model("llama", num_layers=4)  # layers 0-1, 1-2, 2-3: identical pieces
        if huge:
            use_huge_pages(model)
        config = kvgraph.CompilationConfig(graph_mode="piecewise", piece_compiler="inductor",
                                           compile_sizes=(4,), cache_dir=compile_cache_dir)
        runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS,
                                     block_size=BLOCK_SIZE, max_num_tokens=32, max_num_seqs=8)
        runner.capture()
        runs.append((generate(runner, runner.vocab_size), compile_counters.snapshot()))
        runner.close()
    ((plain_logits, plain_tokens), plain), ((logits, tokens), moved) = runs
    assert moved["unique_pieces"] == plain["unique_pieces"] < moved["pieces"]
    assert moved["builds"] == 0 and moved["cache_hits"] > 0
    assert tokens == plain_tokens
    for got, want in zip(logits, plain_logits):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@THP
@pytest.mark.parametrize("flags, huge", [([], True), (["--no-huge-pages"], False)])
def test_the_engine_moves_cpu_weights_unless_told_not_to(flags, huge):
    from examples.engine import add_engine_args, build_engine
    from examples.models import MODELS

    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--preset", "tiny", "--graph-mode", "piecewise", "--piece-compiler", "eager",
         "--max-model-len", "64", *flags])
    engine, _ = build_engine(args, MODELS)
    try:
        # oneDNN's packed weights (fp32 ones too on AMD processors with AVX-512) stay put.
        movable = [p for p in engine.runner.model.parameters() if p.layout == torch.strided]
        assert len(movable) > 1
        storages = {p.untyped_storage().data_ptr() for p in movable}
        assert (len(storages) == 1) == huge  # one arena, or each parameter's own
    finally:
        engine.runner.close()


@THP
def test_the_benchmark_times_both_kinds_of_page(tmp_path):
    from examples.benchmarks import huge_pages

    payload = huge_pages.main([
        "--preset", "tiny", "--max-model-len", "128", "--batch-sizes", "2", "--rounds", "1",
        "--decode-base", "2", "--decode-steps", "2", "--piece-compiler", "eager",
        "--json", str(tmp_path / "huge.json")])
    for table in (payload["reading_ms"], payload["engine_ms"]):
        assert set(table) == {"4k", "huge"} and table["4k"].keys() == table["huge"].keys()
        assert_measured(ms for row in table.values() for ms in row.values())
    assert {"sum", "decode b=2 (ms)", "prefill 16x64 (ms)"} <= (payload["reading_ms"]["4k"].keys()
                                                      | payload["engine_ms"]["4k"].keys())
    assert payload["weights_mib"] > 0 and (tmp_path / "huge.json").exists()


def test_the_benchmark_reads_packed_weights_as_plain_ones():
    from examples.benchmarks.huge_pages import plain_weight
    from kvgraph.cpu.packed_linear import pack_weight
    from kvgraph.cpu.tile_weights import bf16_tiles_usable

    weight = torch.randn(48, 64)
    assert plain_weight(weight) is weight
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
        assert torch.equal(plain_weight(packed), weight)
    if bf16_tiles_usable():
        bf16 = weight.to(torch.bfloat16)
        assert torch.equal(plain_weight(pack_weight(bf16)), bf16)
