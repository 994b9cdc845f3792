"""A runner drives a KV connector's worker side (issue 45): the calls, their order per step and
layer, the graph modes a layer-by-layer connector allows, and nothing called without one.

The recording connector's log is the reference: every step must show `start_load_kv`, then per
layer, in the model's order, `wait_for_layer_load` before that layer's attention and
`save_kv_layer` after it, then `wait_for_save`. The layer order is the model's own (module order
of its attention layers), not anything the runner reports.
"""

from __future__ import annotations

import logging

import pytest
import torch

import kvgraph
from kvgraph.kv_transfer import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    KVTransferConfig,
)
from kvgraph.runtime import runner as runner_module
from tests.support.scenario import BLOCK_SIZE, CAPTURE_SIZES, NUM_BLOCKS, make_model

RECORDING = KVTransferConfig("Recording")


class RecordingConnector(KVConnectorBase):
    """A worker-side connector that logs each call; `layerwise` as the test asks."""

    def __init__(self, layerwise: bool = True):
        super().__init__(RECORDING, KVConnectorRole.WORKER, BLOCK_SIZE)
        self.layerwise = layerwise
        self.log: list[tuple] = []
        self.registered: dict = {}

    def register_kv_caches(self, kv_caches):
        self.registered = dict(kv_caches)

    def start_load_kv(self, attn_metadata):
        self.log.append(("start_load_kv", type(self.connector_metadata).__name__))

    def wait_for_layer_load(self, layer_name):
        self.log.append(("wait", layer_name))
        self._before = [t.clone() for t in self.registered[layer_name]]

    def save_kv_layer(self, layer_name, kv_cache, attn_metadata):
        # The cache handed over is the layer's own tuple; the op wrote it after the wait (every
        # step writes new tokens' rows) and before this call.
        assert kv_cache is self.registered[layer_name]
        written = all(not torch.equal(t, b) for t, b in zip(kv_cache, self._before))
        self.log.append(("save", layer_name, attn_metadata.num_actual_tokens, written))

    def wait_for_save(self):
        self.log.append(("wait_for_save",))


class StepMetadata(KVConnectorMetadata):
    pass


def build(kind: str, mode: str, connector: KVConnectorBase | None) -> kvgraph.ModelRunner:
    torch.manual_seed(0)
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager",
                                       capture_sizes=CAPTURE_SIZES)
    runner = kvgraph.ModelRunner(make_model(kind), config, num_blocks=NUM_BLOCKS,
                                 block_size=BLOCK_SIZE, max_num_tokens=32, max_num_seqs=8,
                                 kv_connector=connector)
    runner.capture()
    return runner


def steps():
    """A prefill of two requests, then two decode steps: (chunks, tokens in the step)."""
    yield [kvgraph.RequestChunk(list(range(1, 10)), 0, [3, 7, 9]),
           kvgraph.RequestChunk([5, 6, 7], 0, [11])], 12
    for n in range(2):
        yield [kvgraph.RequestChunk([20 + n], 9 + n, [3, 7, 9]),
               kvgraph.RequestChunk([30 + n], 3 + n, [11, 12])], 2


def expected_step(layers: list[str], num_tokens: int) -> list[tuple]:
    return [("start_load_kv", "StepMetadata"),
            *[call for layer in layers
              for call in (("wait", layer), ("save", layer, num_tokens, True))],
            ("wait_for_save",)]


@pytest.mark.parametrize("kind", ["llama", "mla"])
@pytest.mark.parametrize("mode", ["eager", "none", "piecewise"])
def test_each_layer_waits_for_its_load_before_attention_and_saves_after(kind, mode):
    connector = RecordingConnector()
    runner = build(kind, mode, connector)
    layers = list(kvgraph.attention_layers(runner.model))
    assert set(connector.registered) == set(runner.kv_caches) == set(layers)
    connector.log.clear()  # compile and capture steps are dummy steps: they must log nothing
    expected = []
    for chunks, num_tokens in steps():
        runner.execute(chunks, StepMetadata())
        expected += expected_step(layers, num_tokens)
    assert connector.log == expected
    stats = runner.stats()["kv_connector"]
    assert stats["steps"] == 3 and stats["layer_hook_calls"] == 3 * 2 * len(layers)
    assert runner.config.graph_mode.value == mode


def test_compile_and_capture_call_no_hook():
    connector = RecordingConnector()
    build("llama", "piecewise", connector)
    assert connector.log == []


@pytest.mark.parametrize("requested, resolved", [
    ("full", "piecewise"), ("full_and_piecewise", "piecewise"), ("full_decode_only", "none"),
    ("piecewise", "piecewise")])
def test_a_layerwise_connector_resolves_full_graphs_away_with_one_warning(requested, resolved,
                                                                           caplog):
    with caplog.at_level(logging.WARNING, logger="kvgraph.runtime.dispatcher"):
        runner = build("llama", requested, RecordingConnector())
    warnings = [r for r in caplog.records if "works layer by layer" in r.getMessage()]
    assert runner.config.graph_mode.value == resolved
    assert len(warnings) == (requested != resolved)
    change = runner.stats()["kv_connector"].get("graph_mode_change")
    assert change == (None if requested == resolved else f"{requested} -> {resolved}")


@pytest.mark.parametrize("mode", ["full", "full_and_piecewise"])
def test_a_whole_request_connector_keeps_full_graphs(mode):
    connector = RecordingConnector(layerwise=False)
    runner = build("llama", mode, connector)
    connector.log.clear()
    for chunks, _ in steps():
        runner.execute(chunks, StepMetadata())
    assert runner.config.graph_mode.value == mode
    assert runner.stats()["graphs"]["replays"] >= 3  # the steps ran as full graphs
    assert connector.log == [("start_load_kv", "StepMetadata"), ("wait_for_save",)] * 3


def test_forced_into_a_full_graph_the_cpu_misses_the_saves_as_a_device_would(monkeypatch):
    """The CPU graph keeps the device contract: a full graph's replay runs no Python, so a
    layer-by-layer connector forced past the resolution loses its per-layer calls on every
    replayed step. The resolved runner, on the same steps, sees them all."""
    monkeypatch.setattr(runner_module, "resolve_runner_mode",
                        lambda config, backend, connector: (config.graph_mode, None))
    forced = RecordingConnector()
    runner = build("llama", "full", forced)
    assert runner.config.graph_mode.value == "full"
    forced.log.clear()
    for chunks, _ in steps():
        runner.execute(chunks, StepMetadata())
    replayed = runner.stats()["graphs"]["replays"]
    assert replayed >= 3  # every step of this schedule ran as a full-graph replay
    assert [c for c in forced.log if c[0] in ("wait", "save")] == []
    monkeypatch.undo()

    resolved = RecordingConnector()
    runner = build("llama", "full", resolved)
    resolved.log.clear()
    for chunks, _ in steps():
        runner.execute(chunks, StepMetadata())
    layers = list(kvgraph.attention_layers(runner.model))
    assert sum(c[0] == "save" for c in resolved.log) == 3 * len(layers)


def test_without_a_connector_nothing_is_called():
    runner = build("llama", "piecewise", None)
    for chunks, _ in steps():
        runner.execute(chunks)
    assert runner.kv_connector is None
    assert runner.stats()["kv_connector"] == {"connector": None, "layerwise": False, "steps": 0,
                                              "layer_hook_calls": 0}


def test_a_runner_refuses_a_connector_built_for_the_scheduler():
    scheduler_side = RecordingConnector()
    scheduler_side.role = KVConnectorRole.SCHEDULER
    with pytest.raises(kvgraph.ConfigError, match="worker role"):
        build("llama", "eager", scheduler_side)
