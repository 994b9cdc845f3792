"""Verify mode: graph steps checked against the model as written while they serve.

References are independent of the verifier: an eager runner's tokens, logits and caches; a
runner without verify on the same schedule; the dispatcher's hits for which descriptors ran;
and, for the broken runs, the piece that holds the perturbed node and the layer it sits in.
"""

from __future__ import annotations

import json
import logging
import time

import pytest
import torch

import kvgraph
from examples.models.llama import LlamaAttention
from kvgraph.runtime import verify, verify_locate
from kvgraph.runtime.platforms import get_platform
from passes import GraphPass, PassManager
from tests.support.scenario import GENERATION, generate, make_runner

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

VERIFY_LOGGER = "kvgraph.runtime.verify"
BROKEN_LAYER = "model.layers.1.self_attn.attn"
PERTURBED = "perturbed_by_test"  # the meta key of the node the broken pass inserts
# Decode steps of one request after its prompt: one descriptor, over and over.
REPEATED_DECODE = [[(0, 5)]] + [[(0, "decode")]] * 6


def graph_keys_run(runner) -> set[str]:
    """The descriptors that ran on graphs, from the dispatcher's counts (not the verifier's)."""
    return {key for key in runner.stats()["hits"] if not key.startswith(("none:", "eager:"))}


def run_verified(kind, mode, plan=GENERATION, **config):
    runner = make_runner(kind, mode, verify=True, **config)
    runner.capture()
    logits, tokens = generate(runner, runner.model.config.vocab_size, plan)
    return runner, logits, tokens


def assert_silent_and_right(runner, logits, tokens, caplog, kind, plan=GENERATION):
    eager = make_runner(kind, "eager")
    want_logits, want_tokens = generate(eager, eager.model.config.vocab_size, plan)
    assert tokens == want_tokens
    for got, want in zip(logits, want_logits):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    report = runner.stats()["verify"]
    ran = graph_keys_run(runner)
    assert ran and set(report["descriptors"]) == ran  # each one checked once, none missed
    assert report["checks"] == len(ran) and report["failures"] == 0
    for key, record in report["descriptors"].items():
        assert record["passed"] and record["checks"] == 1 and record["where"] is None, key
        assert record["max_rel"] <= record["tolerance"] == verify.DEFAULT_TOLERANCES[
            torch.float32]
    assert not [r for r in caplog.records if r.name == VERIFY_LOGGER
                and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("kind, mode, backend", [
    ("llama", "piecewise", None), ("llama", "full_decode_only", None),
    ("llama", "full_and_piecewise", None), ("deepseek_mla", "full_and_piecewise", None),
    ("llama", "full", "test_always"),  # full graphs of mixed batches too
])
def test_passes_silently_on_a_correct_model(kind, mode, backend, caplog):
    runner, logits, tokens = run_verified(kind, mode, attn_backend=backend)
    assert runner.config.graph_mode.value == mode
    assert_silent_and_right(runner, logits, tokens, caplog, kind)


def test_full_downgraded_by_the_backend_is_verified_too(caplog):
    runner, logits, tokens = run_verified("llama", "full")  # torch_native: full_and_piecewise
    assert_silent_and_right(runner, logits, tokens, caplog, "llama")


def test_passes_with_the_triton_backend(caplog):
    pytest.importorskip("triton")
    plan = [[(0, 3), (1, 2)], [(0, "decode"), (1, "decode")]]  # the interpreter is slow
    runner, logits, tokens = run_verified("llama", "piecewise", plan, attn_backend="triton")
    assert_silent_and_right(runner, logits, tokens, caplog, "llama", plan)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_passes_with_inductor_pieces(mode, compile_cache_dir, caplog):
    runner, logits, tokens = run_verified("llama", mode, piece_compiler="inductor",
                                          compile_sizes=(4,), cache_dir=compile_cache_dir)
    assert_silent_and_right(runner, logits, tokens, caplog, "llama")


# --- it catches what is broken, and says where ------------------------------------------------

def perturb_layer_1(gm: torch.fx.GraphModule) -> None:
    """A test-only pass: layer 1's merged q/k/v projection times 1.1 (one op, one layer)."""
    for node in gm.graph.nodes:
        paths = [path for path, _ in node.meta.get("nn_module_stack", {}).values()]
        if node.op == "call_function" and paths and paths[-1].endswith(".1.self_attn.qkv_proj"):
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(torch.mul, (node, 1.1))
            scaled.meta[PERTURBED] = True  # node names change in the split; meta stays
            node.replace_all_uses_with(scaled,
                                       delete_user_cb=lambda user, new=scaled: user is not new)
            return
    raise AssertionError("layer 1's qkv_proj is not in the graph")


def with_broken_pass(runner):
    backend = runner._forward.backend
    backend.pass_manager = PassManager([*backend.pass_manager.passes,
                                        GraphPass("perturb", perturb_layer_1)])
    return runner


def perturbed_piece(runner) -> str:
    (name,) = [p.name for p in runner._forward.backend.pieces
               if any(n.meta.get(PERTURBED) for n in p.graph_module.graph.nodes)]
    return name


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == VERIFY_LOGGER
            and r.levelno == logging.WARNING]


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_catches_a_broken_pass_and_names_descriptor_layer_and_piece(mode, caplog):
    runner = with_broken_pass(make_runner("llama", mode, verify=True))
    runner.capture()
    generate(runner, runner.model.config.vocab_size, GENERATION[:4])
    piece = perturbed_piece(runner)
    report = runner.stats()["verify"]
    ran = graph_keys_run(runner)
    assert set(report["descriptors"]) == ran and report["failures"] == len(ran)
    if mode == "full_and_piecewise":
        assert {key.split(":")[0] for key in ran} == {"full", "piecewise"}
    messages = warnings_of(caplog)
    assert len(messages) == len(ran)
    for key, record in report["descriptors"].items():
        assert not record["passed"] and record["max_rel"] > record["tolerance"]
        assert f"first layer whose inputs differ is {BROKEN_LAYER}" in record["where"]
        assert f"(piece {piece})" in record["where"]
        assert "no piece's compiled output differs from its FX code" in record["where"]
        (message,) = [m for m in messages if key in m]
        assert BROKEN_LAYER in message and piece in message


class TracesDifferently(LlamaAttention):
    """Layer code whose trace is not its eager code: the bug class verify is for."""

    def forward(self, positions, hidden):
        if torch.compiler.is_compiling():
            hidden = hidden * 1.1
        return super().forward(positions, hidden)


@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_catches_a_model_whose_trace_differs_in_one_layer(mode, caplog):
    runner = make_runner("llama", mode, verify=True)
    runner.model.model.layers[1].self_attn.__class__ = TracesDifferently  # before the trace
    runner.capture()
    generate(runner, runner.model.config.vocab_size, GENERATION[:3])
    report = runner.stats()["verify"]
    assert report["failures"] == report["checks"] == len(graph_keys_run(runner))
    for key, record in report["descriptors"].items():
        assert f"first layer whose inputs differ is {BROKEN_LAYER}" in record["where"], key
        assert "after model.layers.0.self_attn.attn" in record["where"]
        assert "traced graph itself differs from the model as written" in record["where"]
    assert all(BROKEN_LAYER in m for m in warnings_of(caplog))


def test_names_the_piece_whose_build_differs_from_its_fx_code():
    runner = make_runner("llama", "piecewise", verify=True)
    runner.compile()
    piece = runner._forward.backend.pieces[1]  # computes layer 1's attention inputs
    wrapper = piece.holder[piece.key]
    build = wrapper.runnable

    def broken_build(*args):
        return tuple(t * 1.1 if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                     for t in build(*args))

    wrapper.runnable = broken_build  # before capture: the graphs record it too
    runner.capture()
    generate(runner, runner.model.config.vocab_size, GENERATION[:1])
    (record,) = runner.stats()["verify"]["descriptors"].values()
    assert f"piece {piece.name}'s compiled output differs from its FX code" in record["where"]
    assert f"{BROKEN_LAYER} (its" in record["where"]


def test_says_when_only_the_graphs_differ():
    runner = make_runner("llama", "piecewise", verify=True)
    runner.capture()
    batch = kvgraph.RequestChunk(list(range(3)), 0, [5])
    for (mode, descriptor), graphs in runner._graphs._graphs.items():
        if descriptor.num_tokens == 4:
            for entry in graphs.values():  # every replay of this descriptor is off by 1%
                run = entry.graph.fn
                entry.graph.fn = lambda *args, run=run: tuple(
                    t * 1.01 if isinstance(t, torch.Tensor) and t.is_floating_point() else t
                    for t in run(*args))
    runner.execute([batch])
    (key,) = runner.stats()["verify"]["descriptors"]
    record = runner.stats()["verify"]["descriptors"][key]
    assert not record["passed"]
    assert f"the graphs of {key} (capture or replay) are where they part" in record["where"]


def test_raise_leaves_the_graphs_cache_state():
    def broken_runner(**config):
        runner = with_broken_pass(make_runner("llama", "piecewise", **config))
        runner.capture()
        return runner

    runner, plain = broken_runner(verify=True, verify_action="raise"), broken_runner()
    chunks = [kvgraph.RequestChunk([1, 2, 3, 4, 5], 0, [7, 3])]
    with pytest.raises(kvgraph.VerifyError, match=r"piecewise:BatchDescriptor\(num_tokens=8.*"
                       + BROKEN_LAYER):
        runner.execute(chunks)
    plain.execute(chunks)
    for name, caches in plain.kv_caches.items():
        for got, want in zip(runner.kv_caches[name], caches):
            assert torch.equal(got, want), name


# --- it changes nothing, and costs nothing when off -------------------------------------------

@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_a_verified_run_is_bit_identical_to_one_without(mode):
    runners = []
    for config in ({"verify": True, "verify_every": 1}, {}):
        runner = make_runner("llama", mode, **config)
        runner.capture()
        runners.append((runner, *generate(runner, runner.model.config.vocab_size)))
    (checked, logits, tokens), (plain, want_logits, want_tokens) = runners
    assert checked.stats()["verify"]["checks"] == sum(checked.stats()["hits"][k]
                                                      for k in graph_keys_run(checked))
    assert tokens == want_tokens
    assert all(torch.equal(g, w) for g, w in zip(logits, want_logits))
    assert torch.equal(checked.hidden_states, plain.hidden_states)
    for name, caches in plain.kv_caches.items():
        for got, want in zip(checked.kv_caches[name], caches):
            assert torch.equal(got, want), name
    stats, want = checked.stats(), plain.stats()
    assert (stats["hits"], stats["graphs"]["replays"]) == (want["hits"], want["graphs"]["replays"])


def test_off_by_default_and_free(monkeypatch):
    assert kvgraph.CompilationConfig().verify is False
    calls = {"kernel": 0, "verifier": 0, "probe": 0}
    default = get_platform("cpu").attention_backend  # what make_runner's runner uses
    backend_cls = type(kvgraph.attention.backends.get_attention_backend(default, "cpu"))
    forward = backend_cls.forward

    def counted(self, *args, **kwargs):
        calls["kernel"] += 1
        return forward(self, *args, **kwargs)

    def count(name):
        def counter(*args, **kwargs):
            calls[name] += 1
        return counter

    monkeypatch.setattr(backend_cls, "forward", counted)
    monkeypatch.setattr(verify.Verifier, "__init__", count("verifier"))
    monkeypatch.setattr(verify_locate.Probe, "__call__", count("probe"))
    runner = make_runner("llama", "piecewise")
    runner.capture()
    calls["kernel"] = 0
    generate(runner, runner.model.config.vocab_size)
    layers = len(kvgraph.attention_layers(runner.model))
    assert calls == {"kernel": layers * len(GENERATION), "verifier": 0, "probe": 0}
    assert runner.stats()["verify"] == verify.disabled_stats()


class StepRecorder:
    """Passes each step to `runner.execute` and notes the descriptor the dispatcher chose."""

    def __init__(self, runner):
        self.runner, self.steps = runner, []

    def execute(self, chunks):
        hits = dict(self.runner.stats()["hits"])
        logits = self.runner.execute(chunks)
        (key,) = [k for k, n in self.runner.stats()["hits"].items() if n != hits.get(k, 0)]
        self.steps.append(key)
        return logits


@pytest.mark.parametrize("every", [0, 2, 3])
def test_verify_every_rechecks_every_nth_step(every):
    runner = make_runner("llama", "piecewise", verify=True, verify_every=every)
    runner.capture()
    recorder = StepRecorder(runner)
    generate(recorder, runner.model.config.vocab_size, REPEATED_DECODE)
    seen, expected = set(), {}
    for number, key in enumerate(recorder.steps, 1):
        if key not in seen or (every and number % every == 0):
            expected[key] = expected.get(key, 0) + 1
        seen.add(key)
    report = runner.stats()["verify"]["descriptors"]
    assert {key: record["checks"] for key, record in report.items()} == expected
    assert len(expected) == 2 and (sum(expected.values()) > 2) == (every > 0)


# --- what it reports ----------------------------------------------------------------------------

def test_a_flip_on_a_near_tie_reads_differently_from_a_bug():
    eager = torch.tensor([[1.0, 0.9999, 0.0], [5.0, 0.0, 0.0]])
    graph = torch.tensor([[0.9999, 1.0, 0.0], [0.0, 5.0, 0.0]])
    flips = verify.token_flips(graph, eager, tolerance=1e-4)
    assert [(f["row"], f["eager_token"], f["graph_token"], f["near_tie"]) for f in flips] == [
        (0, 0, 1, True), (1, 0, 1, False)]
    assert flips[0]["eager_margin"] == pytest.approx(1e-4, rel=1e-3)
    message = verify.failure_message("piecewise:X", {
        **verify.compare(graph, eager, [], [], [], 1e-4), "where": None})
    assert "changed in 2 row(s)" in message and "1 near-tie(s), 1 not" in message


def test_default_tolerances_by_dtype():
    tolerances = verify.DEFAULT_TOLERANCES
    assert tolerances[torch.float64] < tolerances[torch.float32] < tolerances[torch.bfloat16]
    runner = make_runner("llama", "piecewise", verify=True, verify_tolerance=0.5)
    runner.capture()
    generate(runner, runner.model.config.vocab_size, GENERATION[:1])
    (record,) = runner.stats()["verify"]["descriptors"].values()
    assert record["tolerance"] == 0.5


def test_each_check_goes_to_the_dump(tmp_path):
    runner = make_runner("llama", "piecewise", verify=True, debug_dump_path=str(tmp_path))
    runner.capture()
    generate(runner, runner.model.config.vocab_size, GENERATION[:3])
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    checks = [e for e in events if e["stage"] == "verify"]
    assert len(checks) == runner.stats()["verify"]["checks"] == len(graph_keys_run(runner))
    report = json.loads((tmp_path / "verify.json").read_text())  # the newest, rewritten
    assert report["descriptors"] == json.loads(json.dumps(runner.stats()["verify"]["descriptors"]))
    assert report["last"]["passed"] is True


def test_the_cli_flag_and_the_server_metrics():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from examples.engine import AsyncEngine, build_engine
    from examples.engine.engine_args import compilation_config
    from examples.generate import parse_args as generate_args
    from examples.serve import MODELS, build_app, parse_args

    assert compilation_config(generate_args(["--verify"])).verify is True
    args = parse_args(["--preset", "tiny", "--graph-mode", "piecewise", "--piece-compiler",
                       "eager", "--max-model-len", "64", "--max-num-seqs", "2",
                       "--max-num-tokens", "16", "--capture-sizes", "1,2,4,8,16", "--verify"])
    engine, _ = build_engine(args, MODELS)
    with TestClient(build_app(AsyncEngine(engine), "tiny")) as client:
        answer = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        checks = engine.runner.stats()["verify"]["checks"]
        assert checks >= 2  # the prompt's descriptor and the decode's
        # The engine publishes its stats after each step, maybe just after the answer went out.
        deadline = time.monotonic() + 10
        while True:
            text = client.get("/metrics").text
            if f"kvgraph_verify_checks_total {float(checks)}" in text or \
                    time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert f"kvgraph_verify_checks_total {float(checks)}" in text
    assert "kvgraph_verify_failures_total 0.0" in text


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["piecewise", "full_and_piecewise"])
def test_on_a_gpu_it_stays_silent_and_catches_a_broken_pass(mode, caplog):
    """The device path: CUDA graphs replay without Python, so only this shows that the snapshot
    of touched blocks, the eager rerun and the location work around real device graphs."""
    runner, _, _ = run_verified("llama", mode, device="cuda")
    report = runner.stats()["verify"]
    assert report["checks"] == len(graph_keys_run(runner)) > 0 and report["failures"] == 0
    broken = with_broken_pass(make_runner("llama", mode, device="cuda", verify=True))
    broken.capture()
    generate(broken, broken.model.config.vocab_size, GENERATION[:4])
    report = broken.stats()["verify"]
    assert report["failures"] == len(graph_keys_run(broken)) > 0
    assert all(BROKEN_LAYER in record["where"] for record in report["descriptors"].values())


def test_raise_fails_the_steps_requests_at_once_and_the_engine_goes_on():
    """Under load, a failing check ends every request of its step at once, without running
    each alone (which would check, and fail, again); later requests are served."""
    from examples.engine import LLMEngine, SamplingParams
    from examples.engine.tokenizer import ByteTokenizer

    runner = with_broken_pass(make_runner("llama", "piecewise", verify=True,
                                          verify_action="raise"))
    runner.capture()
    engine = LLMEngine(runner, ByteTokenizer())
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    requests = [engine.add_request([1 + i, 2, 3], params) for i in range(4)]
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == sorted(r.request_id for r in requests)
    assert all("verify found the graphs and eager apart on this step" in o.error
               and "VerifyError" in o.error for o in outputs)
    assert engine.num_step_retries == 0 and not engine.has_unfinished
    stats = engine.stats()
    assert stats["failed"] == 4 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # The descriptor was checked once: the same step again runs on its graphs (as verify mode
    # does) and is answered.
    later = engine.generate([[1 + i, 2, 3] for i in range(4)],
                            SamplingParams(max_tokens=1, ignore_eos=True))
    assert all(c.error is None and len(c.token_ids) == 1 for c in later)
