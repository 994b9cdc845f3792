"""The kvgraph torch.compile backend: eager parity, one trace, caches as graph inputs, registration."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import kvgraph
from kvgraph import CompilationConfig, GraphMode
from kvgraph.attention.backends import get_attention_backend
from kvgraph.compilation.backend import KVGraphBackend
from kvgraph.compilation.counters import compile_counters
from kvgraph.forward_context import get_forward_context
from kvgraph.runtime.graphs import GraphSet
from kvgraph.runtime.platforms import get_platform
from tests.support.scenario import SCHEDULE, bind_fresh_caches, dynamo_capture, make_model, run_schedule

EAGER_PIECES = CompilationConfig(piece_compiler="eager", compile_sizes=(1, 4))
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def assert_same_run(kind, config, wrap=None, schedule=SCHEDULE, **tolerance):
    """Eager and compiled runs of the schedule: same logits, same cache contents.

    `wrap(compiled)` is the forward the compiled run goes through (default: `compiled`).
    """
    eager_model, graph_model = make_model(kind), make_model(kind)
    eager_caches, graph_caches = bind_fresh_caches(eager_model), bind_fresh_caches(graph_model)
    expected = run_schedule(eager_model, eager_model, schedule)
    compiled = kvgraph.compile_model(graph_model, config)
    got = run_schedule(wrap(compiled) if wrap else compiled, graph_model, schedule)
    for step, (a, b) in enumerate(zip(expected, got)):
        torch.testing.assert_close(b, a, **(tolerance or TOLERANCE), msg=f"step {step}")
    for name in eager_caches:
        for a, b in zip(eager_caches[name], graph_caches[name]):
            torch.testing.assert_close(b, a, **(tolerance or TOLERANCE), msg=name)
    return graph_model


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_compiled_matches_eager_with_eager_pieces(kind):
    assert_same_run(kind, EAGER_PIECES)
    assert compile_counters.dynamo_graphs == 1


def step_runtime_mode(graph_mode: GraphMode, uniform_decode: bool) -> GraphMode:
    """What a runner runs a step as: full graphs (all steps in `full`, uniform decode in the
    other modes with full graphs), else piecewise graphs where the mode has them, else none."""
    if graph_mode is GraphMode.FULL or (graph_mode.has_full_graphs and uniform_decode):
        return GraphMode.FULL
    return GraphMode.PIECEWISE if graph_mode.has_piecewise_graphs else GraphMode.NONE


class GraphSteps:
    """A forward that runs each step through the compiled model's graphs, as a runner would:
    the first step of each (runtime mode, descriptor) inside the GraphSet's capture phase (a
    capture's outputs are poisoned, not results), then every step replayed outside it."""

    def __init__(self, compiled, graph_mode: GraphMode):
        self.compiled, self.graph_mode = compiled, graph_mode
        self.graphs = GraphSet(get_platform("cpu"),
                               get_attention_backend(None, torch.device("cpu")))
        self.keys: set = set()  # (runtime mode, descriptor) captured so far
        self.modes: list[GraphMode] = []  # each step's runtime mode

    def __call__(self, input_ids, positions):
        metadata = get_forward_context().attn_metadata
        uniform_decode = metadata.max_query_len == 1
        mode = step_runtime_mode(self.graph_mode, uniform_decode)
        num_reqs = metadata.query_start_loc.shape[0] - 1 if mode is GraphMode.FULL else None
        descriptor = kvgraph.BatchDescriptor(input_ids.shape[0], num_reqs, uniform_decode)
        self.modes.append(mode)
        def forward():
            return self.compiled(input_ids, positions)

        with kvgraph.set_forward_context(metadata, descriptor, runtime_mode=mode,
                                         graphs=self.graphs):
            if mode is GraphMode.NONE:
                return forward()
            if (mode, descriptor) not in self.keys:
                self.keys.add((mode, descriptor))
                with self.graphs.capture_phase():
                    captured = self.graphs.capture(mode, descriptor, metadata, forward)
                poisoned = bool(torch.isnan(captured).all())
                assert poisoned, f"{mode} {descriptor} was not captured"
            return self.graphs.replay(mode, descriptor, metadata, forward)


# SCHEDULE, then steps of other requests with the shapes of earlier ones (13 tokens in two
# requests, 2 and 1 decode tokens): graphs captured on one step replay another's data.
REPLAY_SCHEDULE = SCHEDULE + [[(2, 6), (3, 7)], [(1, 1), (3, 1)], [(0, 1)]]


@pytest.mark.parametrize("graph_mode", list(GraphMode))
def test_every_graph_mode_captures_replays_and_matches_eager(graph_mode):
    """Each mode's graphs, captured and replayed through a GraphSet: the run equals eager, and
    exactly the graphs the mode has were captured (one per wrapper and descriptor) and replayed
    (once per wrapper and step)."""
    runs = []

    def wrap(compiled):
        runs.append(GraphSteps(compiled, graph_mode))
        return runs[0]

    model = assert_same_run("llama", EAGER_PIECES.replace(graph_mode=graph_mode), wrap=wrap,
                            schedule=REPLAY_SCHEDULE)
    (run,) = runs
    wrappers = {GraphMode.NONE: 0, GraphMode.FULL: 1,
                GraphMode.PIECEWISE: len(model.model.layers) + 1}  # one per compute piece
    expected_modes = {
        GraphMode.EAGER: {GraphMode.NONE}, GraphMode.NONE: {GraphMode.NONE},
        GraphMode.PIECEWISE: {GraphMode.PIECEWISE}, GraphMode.FULL: {GraphMode.FULL},
        GraphMode.FULL_DECODE_ONLY: {GraphMode.FULL, GraphMode.NONE},
        GraphMode.FULL_AND_PIECEWISE: {GraphMode.FULL, GraphMode.PIECEWISE},
    }[graph_mode]
    assert len(run.modes) == len(REPLAY_SCHEDULE)
    assert set(run.modes) == expected_modes  # the schedule has decode and non-decode steps
    snapshot = run.graphs.snapshot()
    assert snapshot["captures"] == sum(wrappers[mode] for mode, _ in run.keys)
    assert snapshot["replays"] == sum(wrappers[mode] for mode in run.modes)
    if graph_mode.has_full_graphs or graph_mode.has_piecewise_graphs:
        assert snapshot["captures"] > 0 and snapshot["replays"] > snapshot["captures"]
    else:
        assert snapshot["captures"] == snapshot["replays"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_compiled_matches_eager_with_inductor(kind, inductor_config):
    assert_same_run(kind, inductor_config, atol=1e-4, rtol=1e-4)
    assert compile_counters.builds + compile_counters.cache_hits > 0


def test_one_trace_serves_every_size_from_one_up():
    model = make_model("llama")
    bind_fresh_caches(model)
    compiled = kvgraph.compile_model(model, EAGER_PIECES)
    run_schedule(compiled, model, [[(0, 3)]])
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in [1, 2, 5, 4, 17, 1]:
            run_schedule(compiled, model, [[(0, n)]], seed=n)
    assert compile_counters.dynamo_graphs == 1


def test_kv_caches_are_graph_inputs_that_reach_the_op_directly():
    model = make_model("llama")
    caches = bind_fresh_caches(model)
    input_ids, positions = torch.tensor([1, 2, 3]), torch.arange(3)
    chunk = kvgraph.RequestChunk([1, 2, 3], 0, [0])
    with torch.no_grad(), kvgraph.set_forward_context(kvgraph.build_attention_metadata([chunk], 4)):
        gm = dynamo_capture(model, input_ids, positions, unbacked=(input_ids, positions)).gm
    # Dynamo names each placeholder after its source, `L['self']....kv_cache[0]` included.
    placeholders = {n: n.name for n in gm.graph.nodes if n.op == "placeholder"}
    attention_calls = [n for n in gm.graph.nodes if passes_op_name(n) == "kvgraph::unified_attention"]
    assert len(attention_calls) == len(caches)
    for call, (name, cache) in zip(attention_calls, caches.items()):
        cache_args = call.args[3]
        assert all(arg in placeholders for arg in cache_args), "a cache is not a graph input"
        sources = [placeholders[arg] for arg in cache_args]
        assert [s.endswith(f"attn_kv_cache_{i}_") for i, s in enumerate(sources)] == [True, True]
        layer = kvgraph.kv_cache.binding.layer_index(name)
        assert all(f"layers_modules_{layer}_" in s for s in sources), (name, sources)
        assert all(arg.meta["example_value"].shape == t.shape for arg, t in zip(cache_args, cache))
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"], "constants baked into the graph"


def passes_op_name(node):
    from passes import op_name
    return op_name(node.target) if node.op == "call_function" else None


def test_rebinding_caches_of_the_same_shapes_needs_no_retrace():
    model = make_model("llama")
    first = bind_fresh_caches(model)
    compiled = kvgraph.compile_model(model, EAGER_PIECES)
    run_schedule(compiled, model, [[(0, 5)]])
    snapshot = {name: [t.clone() for t in cache] for name, cache in first.items()}
    second = bind_fresh_caches(model)
    with torch.compiler.set_stance("fail_on_recompile"):
        run_schedule(compiled, model, [[(0, 5)]])
    for name in first:
        assert all(torch.equal(a, b) for a, b in zip(first[name], snapshot[name])), "old cache written"
        assert all(t.abs().sum() > 0 for t in second[name]), "new cache not written"
    assert compile_counters.dynamo_graphs == 1


def test_identical_layers_compile_once():
    unique = {}
    for layers in (2, 8):
        compile_counters.reset()
        torch._dynamo.reset()
        model = make_model("llama", num_layers=layers)
        bind_fresh_caches(model)
        run_schedule(kvgraph.compile_model(model, EAGER_PIECES), model, [[(0, 3)]])
        assert compile_counters.pieces == layers + 1
        unique[layers] = compile_counters.unique_pieces
    assert unique[2] == unique[8] == 3  # first, middle (shared by every layer), last


def test_static_token_dimension_is_warned_about(caplog):
    model = make_model("llama")
    bind_fresh_caches(model)
    compiled = torch.compile(model, backend=KVGraphBackend(EAGER_PIECES))
    with caplog.at_level("WARNING", logger="kvgraph.compilation.backend"):
        run_schedule(compiled, model, [[(0, 3)]])
    assert "mark_token_dims" in caplog.text


def test_bad_options_name_the_valid_ones():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model, backend="kvgraph", options={"graph_mod": "full"})
    with pytest.raises(BackendCompilerFailed) as info:  # Dynamo's wrapper of a backend's error
        compiled(torch.ones(2, 2))
    error = info.value.inner_exception
    assert type(error) is kvgraph.errors.ConfigError
    assert re.fullmatch(r"unknown kvgraph option\(s\) \['graph_mod'\]; valid: \[.*'graph_mode'.*\]",
                        str(error)), str(error)
    compiled = torch.compile(model, backend="kvgraph", options={"graph_mode": "fast"})
    with pytest.raises(BackendCompilerFailed) as info:
        compiled(torch.ones(2, 2))
    error = info.value.inner_exception
    assert type(error) is kvgraph.errors.ConfigError
    assert str(error) == f"unknown graph_mode 'fast'; valid: {[mode.value for mode in GraphMode]}"


def test_mode_reaches_the_config(monkeypatch):
    seen = []
    monkeypatch.setattr(kvgraph.compilation.backend.KVGraphBackend, "__call__",
                        lambda self, gm, inputs: seen.append(self.config) or gm)
    torch.compile(torch.nn.Linear(2, 2), backend="kvgraph", mode="max-autotune")(torch.ones(2, 2))
    assert seen[0].mode == "max-autotune" and seen[0].inductor_options == {"max_autotune": True}


FRESH_PROCESS = """
import sys, torch
assert "kvgraph" not in sys.modules
compiled = torch.compile(lambda x: torch.sin(x) * 2, backend="kvgraph",
                         options={"piece_compiler": "eager"})
x = torch.randn(5)
torch.testing.assert_close(compiled(x), torch.sin(x) * 2)
print("ok", "kvgraph" in sys.modules)
"""


def test_backend_is_found_in_a_fresh_process_without_importing_kvgraph():
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": ""}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "True"]


def test_kvgraph_environment_variables_configure_the_backend(monkeypatch, tmp_path):
    monkeypatch.setenv("KVGRAPH_DEBUG_DUMP", str(tmp_path))
    monkeypatch.setenv("KVGRAPH_PIECE_COMPILER", "eager")
    compiled = torch.compile(lambda x: torch.cos(x) + 1, backend="kvgraph")
    torch.testing.assert_close(compiled(torch.ones(3)), torch.cos(torch.ones(3)) + 1)
    assert (tmp_path / "index.md").exists()


@pytest.mark.parametrize("check_guards, traces", [(False, 1), (True, 2)])
def test_guards_are_skipped_unless_asked_for(check_guards, traces):
    """Without guards a cache of another shape is not noticed (the runner never rebinds to
    one); with `check_guards` Dynamo re-checks every call and traces again."""
    model = make_model("llama")
    bind_fresh_caches(model)
    compiled = kvgraph.compile_model(model, EAGER_PIECES.replace(check_guards=check_guards))
    run_schedule(compiled, model, [[(0, 3)]])
    bind_fresh_caches(model, num_blocks=128)
    run_schedule(compiled, model, [[(0, 3)]])
    assert compile_counters.dynamo_graphs == traces
