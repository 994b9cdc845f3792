"""The benchmark scripts run end to end on their tiniest CPU configs, and their baseline model
computes what the example Llama computes."""

import importlib.util
import json

import pytest
import torch

import kvgraph
from examples.benchmarks import attention_kernels, decode_latency
from examples.benchmarks.static_llama import StaticLlama
from examples.models.llama import Llama
from tests.support.measured import assert_measured


def kvgraph_greedy(model: Llama, prompt: list[int], steps: int) -> list[torch.Tensor]:
    """Eager kvgraph logits of the prompt's last token, then of `steps` greedy tokens."""
    caches = kvgraph.allocate_kv_caches(kvgraph.kv_cache_specs(model, 16, torch.float32), 8, "cpu")
    kvgraph.bind_kv_cache(kvgraph.attention_layers(model), caches)
    chunk, logits = kvgraph.RequestChunk(prompt, 0, list(range(1, 8))), []
    for _ in range(steps + 1):
        metadata = kvgraph.build_attention_metadata([chunk], 16)
        input_ids, positions = kvgraph.build_model_inputs([chunk])
        with torch.no_grad(), kvgraph.set_forward_context(metadata):
            logits.append(model.compute_logits(model(input_ids, positions))[-1])
        chunk = kvgraph.RequestChunk([int(logits[-1].argmax())], chunk.seq_len, chunk.block_ids)
    return logits


def test_static_llama_matches_the_example_llama():
    llama = Llama.from_preset("tiny")
    prompt = torch.randint(256, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = kvgraph_greedy(llama, prompt, steps=3)
    static = StaticLlama.like(llama)
    static.setup_cache(batch=1, max_len=32)
    with torch.no_grad():
        got = [static(torch.tensor([prompt]), torch.arange(12))[0]]
        for position in range(12, 15):
            token = torch.tensor([[int(got[-1].argmax())]])
            got.append(static(token, torch.tensor([position]))[0])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), atol=1e-5, rtol=1e-4)


def test_decode_latency_runs_on_a_tiny_config(tmp_path, compile_cache_dir):
    out = tmp_path / "decode.json"
    payload = decode_latency.main([
        "--preset", "tiny", "--piece-compiler", "eager", "--batch-sizes", "2",
        "--prompt-len", "8", "--steps", "1", "--parity-steps", "2",
        "--modes", "eager", "full_decode_only", "--baselines", "hf", "bound",
        "--cache-dir", compile_cache_dir, "--json", str(out),
    ])
    rows = {row["name"]: row for row in payload["results"]}
    assert {"kvgraph eager", "kvgraph full_decode_only", "memory bound"} <= rows.keys()
    if importlib.util.find_spec("transformers") is not None:
        assert "hf static cache" in rows  # on a CPU HF does not compile its decode step
    for name, row in rows.items():  # the HF row is skipped without transformers
        if name != "memory bound":
            assert row["token_match"] == {2: 1.0}, name
    assert_measured(rows["kvgraph full_decode_only"]["host_ms"].values())
    assert_measured(rate for row in rows.values() for rate in row.get("prefill_tok_s", {}).values())
    assert rows["kvgraph eager"]["prefill_tok_s"].keys() == {2}
    assert payload["attn_backend"] == "cpu_paged"  # the CPU platform's default
    assert json.loads(out.read_text())["results"]


def test_decode_latency_profiles_a_step(tmp_path, compile_cache_dir, capsys):
    payload = decode_latency.main([
        "--preset", "tiny", "--piece-compiler", "eager", "--batch-sizes", "2",
        "--prompt-len", "8", "--modes", "full_decode_only", "--profile",
        "--cache-dir", compile_cache_dir, "--json", str(tmp_path / "profile.json"),
    ])
    assert "self_cpu" in payload["results"][0]["profiles"][2]
    assert "one decode step, by self_cpu time" in capsys.readouterr().out


def test_attention_kernels_smoke(tmp_path):
    payload = attention_kernels.main(["--smoke", "--json", str(tmp_path / "attention.json")])
    assert len(payload["rows"]) == len(attention_kernels.CASE_SETS["smoke"])
    for row in payload["rows"]:
        for name in payload["backends"]:
            assert row["max_abs_diff"][name] < 1e-4, (row["case"], name)
            assert_measured([row["ms"][name]])


@pytest.mark.slow
def test_inductor_threads_compares_serial_and_parallel_builds(tmp_path, compile_cache_dir):
    from examples.benchmarks import inductor_threads

    payload = inductor_threads.main([
        "--preset", "tiny", "--dtypes", "float32", "--prefill", "2", "8", "--rounds", "2",
        "--steps", "32", "--max-model-len", "64", "--compile-cache-dir", compile_cache_dir,
        "--json", str(tmp_path / "threads.json")])
    (row,) = payload["results"]
    assert set(row["medians"]) == {"serial", "parallel"}
    assert set(row["ratio"]) == {"prefill_tok_s", "decode_b1_ms", "decode_b2_ms"}
    assert_measured(v for kind in row["medians"].values() for v in kind.values())
    assert payload["args"]["threads"] == 2 and len(row["samples"]["serial"]) == 2


def test_token_budget_times_prefill_and_the_stall_a_long_prompt_causes(tmp_path):
    from examples.benchmarks import token_budget

    payload = token_budget.main([
        "--preset", "tiny", "--budgets", "8", "16", "--prefill", "2", "8", "--decodes", "2",
        "--long-prompt", "24", "--max-model-len", "64", "--rounds", "2",
        "--piece-compiler", "eager", "--json", str(tmp_path / "budget.json")])
    assert set(payload["medians"]) == {8, 16}
    for budget, row in payload["medians"].items():
        # Two decoding requests take a token each of every step; the prompt gets the rest.
        assert row["stall_steps"] == -(-24 // (budget - 2))
        assert_measured([row["prefill_tok_s"], row["stall_ms"], row["decode_step_ms"]])
    assert len(payload["samples"][8]) == 2
    assert (tmp_path / "budget.json").is_file()


def test_kv_connector_times_each_way_to_a_first_token_and_counts_the_hooks(tmp_path):
    from examples.benchmarks import kv_connector

    payload = kv_connector.main([
        "--preset", "tiny", "--prompt-len", "40", "--max-model-len", "64", "--rounds", "2",
        "--decode-steps", "4", "--piece-compiler", "eager", "--graph-mode", "none",
        "--json", str(tmp_path / "kv.json")])
    assert set(payload["ttft_ms"]) == {"cold", "cold+save", "storage", "memory"}
    assert_measured(payload["ttft_ms"].values())
    hooks = payload["hooks"]
    # Two calls per layer per decode step when on; none at all when off.
    assert hooks["hook_calls_on"] == 2 * hooks["layers"] * 4 and hooks["hook_calls_off"] == 0
    assert_measured([hooks["hooks_us_per_layer"], hooks["step_wrapper_us"]])
    assert (tmp_path / "kv.json").is_file() and len(payload["samples"]) == 2


def test_transfer_bandwidth_times_each_transport_against_memcpy(tmp_path):
    from examples.benchmarks import transfer_bandwidth

    payload = transfer_bandwidth.main([
        "--layers", "2", "--blocks", "32", "--pull", "8", "--rounds", "1",
        "--json", str(tmp_path / "bw.json")])
    # Every transport ran, or says why it could not (an engine that does not import).
    assert set(payload["rows"]) | set(payload["skipped"]) == {"memcpy", "gloo", "mooncake",
                                                              "nixl"}
    assert "gloo" in payload["rows"] and "memcpy" in payload["rows"]
    assert_measured(row["ms"] for row in payload["rows"].values())
    assert payload["bytes"] == 8 * 2 * 2 * 16 * 8 * 64 * 2  # blocks x layers x (k, v) x bf16
