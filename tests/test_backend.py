"""The kvgraph torch.compile backend: eager parity, one trace, caches as graph inputs, registration."""

import os
import subprocess
import sys

import pytest
import torch

import kvgraph
from kvgraph import CompilationConfig
from tests.scenario import bind_fresh_caches, make_model, run_schedule

EAGER_PIECES = CompilationConfig(piece_compiler="eager", compile_sizes=(1, 4))
TOLERANCE = dict(atol=1e-5, rtol=1e-5)


pytestmark = pytest.mark.usefixtures("fresh_compile_state")


class CapturingBackend(kvgraph.KVGraphBackend):
    """The real backend, keeping the Dynamo graph it was given for inspection."""

    graphs: list

    def __call__(self, gm, example_inputs, **kwargs):
        self.graphs = getattr(self, "graphs", []) + [gm]
        return super().__call__(gm, example_inputs, **kwargs)


def assert_same_run(kind, config, **tolerance):
    """Eager and compiled runs of the schedule: same logits, same cache contents."""
    eager_model, graph_model = make_model(kind), make_model(kind)
    eager_caches, graph_caches = bind_fresh_caches(eager_model), bind_fresh_caches(graph_model)
    expected = run_schedule(eager_model, eager_model)
    compiled = kvgraph.compile_model(graph_model, config)
    got = run_schedule(compiled, graph_model)
    for step, (a, b) in enumerate(zip(expected, got)):
        torch.testing.assert_close(b, a, **(tolerance or TOLERANCE), msg=f"step {step}")
    for name in eager_caches:
        for a, b in zip(eager_caches[name], graph_caches[name]):
            torch.testing.assert_close(b, a, **(tolerance or TOLERANCE), msg=name)


@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_compiled_matches_eager_with_eager_pieces(kind):
    assert_same_run(kind, EAGER_PIECES)
    assert kvgraph.compile_counters.dynamo_graphs == 1


@pytest.mark.parametrize("graph_mode", ["full", "none", "full_and_piecewise"])
def test_every_graph_mode_compiles_to_the_same_result(graph_mode):
    assert_same_run("llama", EAGER_PIECES.replace(graph_mode=graph_mode))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "deepseek_mla"])
def test_compiled_matches_eager_with_inductor(kind, inductor_config):
    assert_same_run(kind, inductor_config, atol=1e-4, rtol=1e-4)
    assert kvgraph.compile_counters.builds + kvgraph.compile_counters.cache_hits > 0


def test_one_trace_serves_every_size_from_one_up():
    model = make_model("llama")
    bind_fresh_caches(model)
    compiled = kvgraph.compile_model(model, EAGER_PIECES)
    run_schedule(compiled, model, [[(0, 3)]])
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in [1, 2, 5, 4, 17, 1]:
            run_schedule(compiled, model, [[(0, n)]], seed=n)
    assert kvgraph.compile_counters.dynamo_graphs == 1


def test_kv_caches_are_graph_inputs_that_reach_the_op_directly():
    model = make_model("llama")
    caches = bind_fresh_caches(model)
    backend = CapturingBackend(EAGER_PIECES)
    compiled = torch.compile(model, backend=backend)
    input_ids, positions = torch.tensor([1, 2, 3]), torch.arange(3)
    kvgraph.mark_token_dims(input_ids, positions)
    chunk = kvgraph.RequestChunk([1, 2, 3], 0, [0])
    with torch.no_grad(), kvgraph.set_forward_context(kvgraph.build_attention_metadata([chunk], 4)):
        compiled(input_ids, positions)
    (gm,) = backend.graphs
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
    assert kvgraph.compile_counters.dynamo_graphs == 1


def test_identical_layers_compile_once():
    unique = {}
    for layers in (2, 8):
        kvgraph.compile_counters.reset()
        torch._dynamo.reset()
        model = make_model("llama", num_layers=layers)
        bind_fresh_caches(model)
        run_schedule(kvgraph.compile_model(model, EAGER_PIECES), model, [[(0, 3)]])
        assert kvgraph.compile_counters.pieces == layers + 1
        unique[layers] = kvgraph.compile_counters.unique_pieces
    assert unique[2] == unique[8] == 3  # first, middle (shared by every layer), last


def test_static_token_dimension_is_warned_about(caplog):
    model = make_model("llama")
    bind_fresh_caches(model)
    compiled = torch.compile(model, backend=kvgraph.KVGraphBackend(EAGER_PIECES))
    with caplog.at_level("WARNING", logger="kvgraph.compilation.backend"):
        run_schedule(compiled, model, [[(0, 3)]])
    assert "mark_token_dims" in caplog.text


def test_bad_options_name_the_valid_ones():
    model = torch.nn.Linear(2, 2)
    compiled = torch.compile(model, backend="kvgraph", options={"graph_mod": "full"})
    with pytest.raises(Exception, match=r"unknown kvgraph option\(s\) \['graph_mod'\]; valid: .*graph_mode"):
        compiled(torch.ones(2, 2))
    compiled = torch.compile(model, backend="kvgraph", options={"graph_mode": "fast"})
    with pytest.raises(Exception, match="unknown graph_mode 'fast'; valid: .*piecewise"):
        compiled(torch.ones(2, 2))


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


def test_debug_dump_writes_every_stage_with_an_index(tmp_path):
    model = make_model("llama")
    bind_fresh_caches(model)
    config = EAGER_PIECES.replace(debug_dump_path=str(tmp_path))
    run_schedule(kvgraph.compile_model(model, config), model, [[(0, 3)]])
    index = (tmp_path / "index.md").read_text().splitlines()
    names = [line.split("/")[1].split("]")[0] for line in index]
    stages = [name.split("-", 1)[1].rsplit(".", 1)[0] for name in names]
    pieces = 2 * len(model.model.layers) + 1  # compute pieces and attention pieces
    assert stages[:4] == ["config", "dynamo", "pass-noop_elimination", "split"]
    assert len([s for s in stages if s.startswith("piece-")]) == pieces
    assert stages[-1] == "counters"
    dynamo = (tmp_path / "compile-000" / names[1]).read_text()
    calls = [line for line in dynamo.splitlines()
             if "torch.ops.kvgraph.unified_attention" in line and not line.strip().startswith("#")]
    assert len(calls) == len(model.model.layers)


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
    assert kvgraph.compile_counters.dynamo_graphs == traces
