"""The disaggregation benchmark end to end at a tiny size: a colocated server and P, D and the
proxy started as a user starts them, the same streaming mix against both, every timing measured,
every prompt D served loaded from P (pulled, or pushed layer by layer), and the transports timed
on caches of the model's shape."""

import json
import math

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from examples.benchmarks import disaggregation  # noqa: E402
from tests.support.measured import assert_measured  # noqa: E402


@pytest.mark.slow  # starts three servers and the proxy: ~35 s on 2 cores
@pytest.mark.parametrize("push", [False, True], ids=["pull", "push"])
def test_both_setups_run_the_mix_and_d_loads_every_prompt_from_p(tmp_path, push):
    out = tmp_path / "disagg.json"
    payload = disaggregation.main([
        "--preset", "tiny", "--max-model-len", "256", "--short-len", "8", "--decode-tokens", "6",
        "--decoders", "2", "--long-prompts", "2", "--long-len", "120", "--long-tokens", "3",
        "--long-every-s", "0.3", "--rounds", "1", "--bandwidth-rounds", "0" if push else "1",
        *(["--push"] if push else []), "--log-dir", str(tmp_path / "logs"),
        "--graph-mode", "eager", "--json", str(out)])
    assert set(payload["medians"]) == set(payload["rounds"]) == {"colocated", "1P1D"}
    for setup, medians in payload["medians"].items():
        for part in ("decode", "long"):
            assert medians[part]["requests"] >= (1 if part == "decode" else 2), (setup, part)
            assert_measured(v for k, v in medians[part].items() if k.endswith("_ms"))
        assert_measured([medians["all"]["tokens_per_s"]])
    counters = payload["connector"]
    # D computed no prompt but, at most, each one's last token: the rest came from P.
    assert counters["loaded_at_least"] <= counters["loaded_tokens"] <= counters["prompt_tokens"]
    assert counters["p"]["kvgraph_kv_connector_failed_pulls_total"] == 0
    assert counters["p"]["kvgraph_kv_connector_sent_blocks_total"] > 0
    written = json.loads(out.read_text())
    assert all(math.isfinite(v) for v in written["medians"]["1P1D"]["decode"].values())
    assert {p.name for p in (tmp_path / "logs").iterdir()} == {
        "colocated.log", "P.log", "D.log", "proxy.log"}
    if push:
        assert payload["bandwidth"] is None
        return
    # transfer_bandwidth.py on caches of the model's shape, one long prompt's blocks a pull.
    bandwidth = payload["bandwidth"]
    assert (bandwidth["args"]["pull"], bandwidth["args"]["layers"]) == (8, 2)
    assert {"memcpy", "gloo"} <= bandwidth["rows"].keys()
