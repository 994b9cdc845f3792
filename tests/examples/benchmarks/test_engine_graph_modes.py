"""The engine-per-graph-mode benchmark (examples/benchmarks/engine_graph_modes.py), tiny."""

from examples.benchmarks import engine_graph_modes
from tests.support.measured import assert_measured


def test_it_times_every_mode_against_eager(tmp_path):
    payload = engine_graph_modes.main([
        "--preset", "tiny", "--max-model-len", "128", "--modes", "eager", "full",
        "--batch-sizes", "2", "--rounds", "1", "--decode-base", "2", "--decode-steps", "2",
        "--piece-compiler", "eager", "--json", str(tmp_path / "modes.json")])
    assert set(payload["ms"]) == {"eager", "full"}
    assert set(payload["ms"]["full"]) == {"decode b=2 (ms)", "prefill 16x64 (ms)"}
    assert all(value == 1.0 for value in payload["relative"]["eager"].values())
    assert_measured(ms for row in payload["ms"].values() for ms in row.values())
    assert (tmp_path / "modes.json").exists()
