"""The tensor-parallel check script on the CPU: both world sizes end to end (gloo), its judging
of a wrong result, and its device defaults."""

import json

import pytest
import torch

from examples.benchmarks import tensor_parallel
from examples.models.llama import PRESETS
from tests.support.measured import assert_measured

LAYERS = PRESETS["tiny"]["num_hidden_layers"]


@pytest.mark.slow  # starts two processes: ~17 s on 2 cores
def test_both_world_sizes_pass_with_collectives_captured(tmp_path, compile_cache_dir):
    out = tmp_path / "tp.json"
    payload = tensor_parallel.main([
        "--device", "cpu", "--preset", "tiny", "--piece-compiler", "eager",
        "--modes", "piecewise", "full_and_piecewise", "--world-sizes", "1", "2",
        "--batch-sizes", "1", "2", "--prompt-len", "8", "--steps", "3", "--parity-steps", "2",
        "--cache-dir", compile_cache_dir, "--json", str(out),
    ])
    assert payload["passed"] and payload["complete"]
    rows = {(row["world_size"], row["mode"]): row for row in payload["results"]}
    assert rows.keys() == {(w, m) for w in (1, 2) for m in ("piecewise", "full_and_piecewise")}
    for (world_size, mode), row in rows.items():
        assert row["passed"] and row["tokens_equal"], (world_size, mode, row)
        assert row["ran_as"] == mode
        # Size 1: one forced all-reduce per layer; size 2: o_proj's and down_proj's per layer.
        reduces = LAYERS * (1 if world_size == 1 else 2)
        assert row["collectives"] == {"all_reduce": reduces, "wait_tensor": reduces,
                                      "dynamo_graphs": 1}, (world_size, mode)
        assert row["graphs"] > 0
        assert_measured(row["ms"].values())
        assert row["max_rel_diff"] <= row["tolerance"]
    # Size 1 sums one rank's values: bitwise the reference (eager pieces compute as eager).
    assert rows[1, "piecewise"]["max_abs_diff"] == 0.0
    assert rows[2, "piecewise"]["ranks_equal"] is True
    assert rows[1, "piecewise"]["ranks_equal"] is None
    assert rows[1, "piecewise"]["replayed"] == ["piecewise"]
    assert rows[2, "full_and_piecewise"]["replayed"] == ["full", "piecewise"]
    written = json.loads(out.read_text())
    assert written["complete"] and len(written["results"]) == 4


def _result(logits: torch.Tensor, **extra) -> dict:
    return {"mode": "piecewise", "ran_as": "piecewise", "graphs": 3, "capture_failed": [],
            "replayed": ["piecewise"], "ms": {1: 1.0}, "logits": {1: [logits]},
            "collectives": {"all_reduce": 2, "wait_tensor": 2}, **extra}


def test_a_wrong_or_uneven_result_fails():
    args = tensor_parallel.parse_args(["--device", "cpu", "--batch-sizes", "1"])
    want = torch.tensor([[0.0, 1.0, 3.0]])
    reference = {1: [want]}
    assert tensor_parallel.judge(args, 1, [_result(want.clone())], reference)["passed"]
    wrong = tensor_parallel.judge(args, 1, [_result(torch.tensor([[0.0, 4.0, 3.0]]))], reference)
    assert not wrong["passed"] and not wrong["checks"]["logits"] and not wrong["tokens_equal"]
    uneven = torch.tensor([[0.0, 1.0, 3.0 + 1e-6]])
    split = tensor_parallel.judge(args, 2, [_result(want.clone()), _result(uneven)], reference)
    assert split["ranks_equal"] is False and not split["passed"]
    untraced = tensor_parallel.judge(args, 1, [_result(want.clone(), collectives={})], reference)
    assert not untraced["checks"]["collectives_traced"]
    failed = tensor_parallel.judge(args, 2, [_result(want), {"mode": "piecewise", "error": "x"}],
                                   reference)
    assert failed == {"world_size": 2, "mode": "piecewise", "passed": False, "error": "x"}


def test_device_defaults(monkeypatch):
    cpu = tensor_parallel.parse_args(["--device", "cpu"])
    assert (cpu.preset, cpu.torch_dtype, cpu.piece_compiler) == ("tiny", torch.float32, "eager")
    cuda = tensor_parallel.parse_args(["--device", "cuda"])
    assert (cuda.preset, cuda.torch_dtype, cuda.piece_compiler) == ("1b", torch.bfloat16,
                                                                    "inductor")
    assert cuda.world_sizes == [1, 2] and cuda.batch_sizes == [1, 8]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert tensor_parallel.skipped_world_sizes(cuda) == {2: "1 CUDA device(s), 2 are needed"}
    assert tensor_parallel.skipped_world_sizes(cpu) == {}  # gloo ranks need no devices
