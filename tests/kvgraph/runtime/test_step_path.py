"""One step path: the attention backend plans each step once and is told about every capture and
replay; compile runs before capture and its errors raise there; one model serves one live
runner; a runner's counts are its own."""

from __future__ import annotations

import collections
import gc
import os
import sys
import weakref

import pytest
import torch

import kvgraph
from kvgraph import CompilationConfig
from kvgraph.attention.backends import GraphSupport, register_attention_backend
from kvgraph.attention.backends.torch_native import TorchNativeBackend
from kvgraph.compilation.counters import compile_counters
from kvgraph.runtime.graphs import graph_key
from tests.support.scenario import (
    BLOCK_SIZE, CAPTURE_SIZES, NUM_BLOCKS, TOLERANCE, generate, make_model, make_runner,
)

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


class RecordingBackend(TorchNativeBackend):
    """Torch-native kernels that record every plan, hook and op call, in order."""

    name = "test_recording"
    graph_support = GraphSupport.ALWAYS
    calls: list[tuple] = []

    def plan(self, metadata, descriptor):
        plan = super().plan(metadata, descriptor)
        self.calls.append(("plan", descriptor, id(plan)))
        return plan

    def before_capture(self, mode, descriptor, metadata):
        self.calls.append(("before_capture", mode, descriptor, id(metadata.plan)))

    def after_capture(self, mode, descriptor, metadata):
        self.calls.append(("after_capture", mode, descriptor, id(metadata.plan)))
        return ("captured", mode, descriptor)

    def before_replay(self, mode, descriptor, metadata, captured):
        assert captured == ("captured", mode, descriptor)  # what after_capture returned for it
        self.calls.append(("before_replay", mode, descriptor, id(metadata.plan)))

    def forward(self, query, key, value, kv_cache, out, metadata, *args, **kwargs):
        self.calls.append(("forward", id(self.step_plan(metadata))))
        super().forward(query, key, value, kv_cache, out, metadata, *args, **kwargs)


register_attention_backend(RecordingBackend)


# Prefill (10 tokens), mixed (3), decode (2 and 1 requests) and a step above every capture size.
_BLOCKS = ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15])
STEPS = [
    [kvgraph.RequestChunk([1] * 7, 0, _BLOCKS[0]), kvgraph.RequestChunk([2] * 3, 0, _BLOCKS[1])],
    [kvgraph.RequestChunk([3], 7, _BLOCKS[0]), kvgraph.RequestChunk([4, 5], 3, _BLOCKS[1])],
    [kvgraph.RequestChunk([6], 8, _BLOCKS[0]), kvgraph.RequestChunk([7], 5, _BLOCKS[1])],
    [kvgraph.RequestChunk([8], 9, _BLOCKS[0])],
    [kvgraph.RequestChunk([9] * 17, 10, _BLOCKS[0])],
]


def recorded(runner, action):
    """The backend calls `action(runner)` makes, and the dispatch key it counted (if one)."""
    RecordingBackend.calls.clear()
    before = collections.Counter(runner.stats()["hits"])
    action(runner)
    counted = collections.Counter(runner.stats()["hits"]) - before
    return list(RecordingBackend.calls), counted


@pytest.mark.parametrize("mode", ["eager", "none", "piecewise", "full", "full_decode_only",
                                  "full_and_piecewise"])
def test_each_hook_runs_once_per_step_capture_and_replay_with_the_step_s_descriptor(mode):
    runner = make_runner("llama", mode, attn_backend=RecordingBackend.name)
    num_layers = len(runner.model.model.layers)
    calls, _ = recorded(runner, lambda r: r.capture())
    keys = runner._dispatcher.descriptors_to_capture() if runner.config.graph_mode.has_graphs \
        else []
    # compile: one planned step, no hooks; then per descriptor: plan, before, after.
    assert [c[0] for c in calls if c[0] != "forward"] == (
        (["plan"] if mode != "eager" else [])
        + ["plan", "before_capture", "after_capture"] * len(keys))
    captures = [c for c in calls if c[0] in ("before_capture", "after_capture")]
    assert [(c[1], c[2]) for c in captures] == [key for key in keys for _ in range(2)]
    plans = [c for c in calls if c[0] == "plan"]
    for before, after, plan in zip(captures[::2], captures[1::2], plans[-len(keys) or None:]):
        assert before[3] == after[3] == plan[2], "the hooks see the plan of the captured step"

    replays = 0
    for chunks in STEPS:
        calls, counted = recorded(runner, lambda r: r.execute(chunks))
        ((key, count),) = counted.items()
        assert count == 1
        (plan,) = [c for c in calls if c[0] == "plan"]
        assert key.endswith(f":{plan[1]}"), (key, plan)
        replay = [c for c in calls if c[0] == "before_replay"]
        if key.startswith(("none:", "eager:")):
            assert replay == []
        else:
            assert [graph_key(c[1], c[2]) for c in replay] == [key], "one replay hook a step"
            assert replay[0][3] == plan[2]
            replays += 1
        forwards = [c for c in calls if c[0] == "forward"]
        assert len(forwards) == num_layers and {c[1] for c in forwards} == {plan[2]}, \
            "every layer reads the one plan of its step"
    assert replays > 0 or not runner.config.graph_mode.has_graphs


def test_a_failed_capture_calls_no_after_capture_hook(allow_capture_failures):
    class FailsToCapture(RecordingBackend):
        name = "test_recording_fails"

        def forward(self, query, *args, **kwargs):
            if kvgraph.forward_context.get_forward_context().graphs.capturing:
                raise RuntimeError("cannot record (test backend)")
            super().forward(query, *args, **kwargs)

    register_attention_backend(FailsToCapture)
    runner = make_runner("llama", "full_decode_only", attn_backend=FailsToCapture.name)
    calls, _ = recorded(runner, lambda r: r.capture())
    assert [c[0] for c in calls if "capture" in c[0]] == ["before_capture"] * 4
    assert runner.stats()["graphs"]["captures"] == 0


# --- compile, then capture ---------------------------------------------------------------------


def test_a_refused_compile_cache_raises_from_compile_not_once_per_descriptor(tmp_path, caplog):
    inductor_dir = tmp_path / "inductor"
    inductor_dir.mkdir(mode=0o700)
    config = CompilationConfig(graph_mode="piecewise", piece_compiler="inductor",
                               cache_dir=str(tmp_path), capture_sizes=CAPTURE_SIZES)
    runner = kvgraph.ModelRunner(make_model("llama"), config, num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK_SIZE, max_num_seqs=8)
    inductor_dir.chmod(0o777)  # after the config was checked: found only when compiling
    with pytest.raises(kvgraph.CompileError, match="chmod go-w") as info:
        runner.capture()
    assert "ConfigError" in str(info.value) and str(inductor_dir) in str(info.value)
    assert runner.stats()["graphs"]["captures"] == 0
    assert not [r for r in caplog.records if "capturing" in r.getMessage()], "no capture ran"
    with pytest.raises(kvgraph.CompileError):
        runner.execute([kvgraph.RequestChunk([1, 2], 0, [0])])


@pytest.mark.slow
def test_on_compile_error_raise_stops_compile_before_any_capture(tmp_path):
    config = CompilationConfig(graph_mode="piecewise", piece_compiler="inductor",
                               cache_dir=str(tmp_path), on_compile_error="raise",
                               capture_sizes=CAPTURE_SIZES)
    runner = kvgraph.ModelRunner(make_model("llama"), config, num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK_SIZE, max_num_seqs=8)
    with torch._inductor.config.patch({"cpp.cxx": ("/nonexistent/c++",)}):
        with pytest.raises(kvgraph.CompileError, match="C\\+\\+ compiler"):
            runner.capture()
    assert runner.stats()["graphs"]["captures"] == 0


def test_compile_traces_once_outside_capture_and_capture_then_only_captures():
    runner = make_runner("llama", "full_and_piecewise")
    counts = runner.compile()
    assert counts["dynamo_graphs"] == 1 and counts["pieces"] == len(runner.model.model.layers) + 1
    assert runner.stats()["graphs"]["captures"] == 0 and runner.stats()["hits"] == {}
    runner.capture()
    assert runner.stats()["compile"] == counts, "capture compiled nothing more"


# --- one model, one runner -----------------------------------------------------------------


def test_a_second_runner_on_a_model_another_live_runner_holds_is_refused():
    model = make_model("llama")

    def runner():
        return kvgraph.ModelRunner(model, CompilationConfig(graph_mode="eager"),
                                   num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8)

    first = runner()
    caches = {name: tuple(cache) for name, cache in first.kv_caches.items()}
    with pytest.raises(kvgraph.RunnerError, match="another live ModelRunner"):
        runner()
    layers = kvgraph.attention_layers(model)
    assert all(layers[name].kv_cache is cache for name, cache in caches.items()), \
        "the refused runner must not touch the first one's bindings"
    first.close()
    second = runner()  # closed: the model is free
    del second
    third = runner()  # dropped: free too
    expected = make_runner("llama", "eager")
    chunks = [kvgraph.RequestChunk([3, 1, 4], 0, [2])]
    torch.testing.assert_close(third.execute(chunks), expected.execute(chunks), **TOLERANCE)


# --- the runner's public face ---------------------------------------------------------------


def test_limits_vocab_and_a_step_prepared_without_running():
    runner = make_runner("llama", "piecewise")
    assert runner.limits == kvgraph.runtime.step.StepLimits(32, 8, NUM_BLOCKS * BLOCK_SIZE,
                                                            NUM_BLOCKS, BLOCK_SIZE)
    assert runner.vocab_size == runner.model.config.vocab_size
    runner.capture()
    cache = [t.clone() for t in next(iter(runner.kv_caches.values()))]
    step = runner.prepare_step([kvgraph.RequestChunk([1, 2, 3], 0, [5])])
    assert step.plan.descriptor == kvgraph.BatchDescriptor(4)
    assert step.input_ids.tolist() == [1, 2, 3, 0] and step.metadata.plan is not None
    assert all(torch.equal(a, b) for a, b in zip(cache, next(iter(runner.kv_caches.values()))))


def test_max_num_tokens_comes_from_the_runner_or_the_config_and_never_disagrees():
    model = make_model("llama")
    common = dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_num_seqs=8)
    with pytest.raises(kvgraph.ConfigError, match="runner was given 64 but its config says 32"):
        kvgraph.ModelRunner(model, CompilationConfig(graph_mode="eager", max_num_tokens=32),
                            max_num_tokens=64, **common)
    runner = kvgraph.ModelRunner(model, CompilationConfig(graph_mode="eager", max_num_tokens=32),
                                 **common)
    assert runner.limits.max_num_tokens == runner.config.max_num_tokens == 32
    runner.close()
    runner = kvgraph.ModelRunner(model, CompilationConfig(graph_mode="eager"), **common)
    assert runner.limits.max_num_tokens == 512


def test_stats_count_only_this_runner_s_compile():
    first, second = make_runner("llama", "piecewise"), make_runner("deepseek_mla", "piecewise")
    first.compile()
    second.compile()
    assert first.stats()["compile"]["dynamo_graphs"] == second.stats()["compile"]["dynamo_graphs"]
    assert first.stats()["compile"]["dynamo_graphs"] == 1
    assert compile_counters.dynamo_graphs == 2, "the process's totals count both"
    assert (first.stats()["compile"]["pieces"] + second.stats()["compile"]["pieces"]
            == compile_counters.pieces)


# --- what a dropped runner leaves behind -----------------------------------------------------


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def compiled_functions_in_module_globals() -> int:
    return sum(1 for module in list(sys.modules.values())
               for name in list(getattr(module, "__dict__", None) or ())
               if isinstance(name, str) and name.startswith("__compiled_fn"))


def live_graph_modules() -> int:
    # type(), not isinstance(): a dead weak proxy among the objects raises on isinstance.
    return sum(issubclass(type(o), torch.fx.GraphModule) for o in gc.get_objects())


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_runners_built_captured_run_and_dropped_eight_times_leave_nothing_behind():
    """Each runner's compiled code, graphs and caches go with it. What torch itself keeps per
    compile (fx's generated source for tracebacks, Dynamo's compile metrics and guard
    managers) is ~0.5 MiB; a runner used to keep ~1.5-4 MiB and every compiled graph."""
    rss = []
    gc.collect()
    graph_modules = live_graph_modules()
    for _ in range(8):
        runner = make_runner("llama", "full_and_piecewise")
        runner.capture()
        generate(runner, runner.vocab_size)
        pieces = weakref.ref(runner._forward)
        del runner
        gc.collect()
        assert pieces() is None, "a dropped runner's compiled model is still alive"
        assert compiled_functions_in_module_globals() == 0
        assert live_graph_modules() <= graph_modules, "a dropped runner's pieces are alive"
        rss.append(resident_bytes())
    growth = rss[-1] - rss[1]  # the first runners warm up torch's own caches
    assert growth < 6 * 2**20, f"resident memory grew {growth / 2**20:.1f} MiB over 6 runners"
