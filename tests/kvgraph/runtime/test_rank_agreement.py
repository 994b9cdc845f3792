"""Tensor-parallel ranks agree or fail together: settings, captured descriptors, each step's
descriptor, and one rank's failure reported on every rank as "rank N failed", never a hang."""

import time

import pytest
import torch

import kvgraph
from kvgraph import distributed as tp
from tests.support.scenario import generate, make_runner
from tests.support.tp_harness import PROCESS_GROUP_TIMEOUT_S, run_ranks


def _expect_runner_error(fn) -> str:
    start = time.monotonic()
    with pytest.raises(kvgraph.RunnerError) as info:
        fn()
    return f"{time.monotonic() - start:.1f}|{info.value}"


def _settings_differ(rank: int) -> str:
    sizes = (4,) if rank == 0 else (8,)
    return _expect_runner_error(lambda: make_runner("llama", "piecewise", compile_sizes=sizes))


def test_ranks_built_with_different_settings_fail_together(tmp_path):
    for got in run_ranks(_settings_differ, tmp_path):
        assert "disagree on the runner's settings" in got
        assert "rank 0: " in got and "rank 1: " in got and "(8,)" in got


def _capture_order_differs(rank: int) -> str:
    runner = make_runner("llama", "full_and_piecewise")
    if rank == 1:
        keys = runner._dispatcher.descriptors_to_capture()
        runner._dispatcher.descriptors_to_capture = lambda: list(reversed(keys))
    return _expect_runner_error(runner.capture)


def test_ranks_capturing_other_descriptors_fail_fast(tmp_path):
    for got in run_ranks(_capture_order_differs, tmp_path):
        seconds, _, message = got.partition("|")
        assert "disagree on the descriptors to capture, in order: entry 0" in message
        # An exchange, not a collective timeout: the seconds include waiting for the peer to
        # reach the capture (seconds on a loaded machine), never the group's timeout.
        assert float(seconds) < PROCESS_GROUP_TIMEOUT_S


def _steps(rank: int, check: bool) -> dict:
    runner = make_runner("llama", "piecewise", check_rank_agreement=check)
    runner.capture()
    logits, tokens = generate(runner, runner.model.config.vocab_size)  # same batches: agree
    chunk = kvgraph.RequestChunk([1, 2, 3][: 2 + rank], 0, [0])
    return {"tokens": tokens, "logits": logits[-1].clone(),
            "error": _expect_runner_error(lambda: runner.execute([chunk])) if check else None}


def test_each_step_descriptor_is_checked_when_asked(tmp_path):
    results = run_ranks(_steps, tmp_path, args=(True,))
    assert results[0]["tokens"] == results[1]["tokens"]
    torch.testing.assert_close(results[0]["logits"], results[1]["logits"], rtol=0, atol=0)
    for got in results:
        message = got["error"].partition("|")[2]
        assert "disagree on this step's batch descriptor" in message
        assert "rank 0: 'none:" in message or "rank 0: 'piecewise:" in message


class _Reducing(torch.nn.Module):
    """A Llama whose hidden states are all-reduced: a model collective in every forward."""

    def __init__(self, inner: torch.nn.Module, fail: bool):
        super().__init__()
        self.inner, self.config, self.fail = inner, inner.config, fail

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("this rank's model cannot be traced")
        return tp.all_reduce(self.inner(input_ids, positions)) / 2

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.inner.compute_logits(hidden)


def _compile_fails_on_rank_1(rank: int) -> str:
    from tests.support.scenario import BLOCK_SIZE, NUM_BLOCKS, make_model

    model = _Reducing(make_model("llama"), fail=rank == 1)
    config = kvgraph.CompilationConfig(graph_mode="piecewise", piece_compiler="eager",
                                       capture_sizes=(1, 2))
    runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                 max_num_tokens=8, max_num_seqs=2)
    return _expect_runner_error(runner.compile)


def test_one_ranks_compile_error_is_raised_on_every_rank(tmp_path):
    # Rank 0 waits in its model's all-reduce for the group's timeout (5 s), then learns why.
    results = run_ranks(_compile_fails_on_rank_1, tmp_path, timeout_s=5)
    for rank, got in enumerate(results):
        message = got.partition("|")[2]
        assert message.startswith("rank 1 failed (compile): CompileError: compiling the model "
                                  "failed: ValueError: this rank's model cannot be traced"), message


def _inductor_run(rank: int, cache_dir: str) -> dict:
    from tests.support.scenario import BLOCK_SIZE, NUM_BLOCKS, make_model

    model = _Reducing(make_model("llama"), fail=False)
    config = kvgraph.CompilationConfig(graph_mode="piecewise", piece_compiler="inductor",
                                       capture_sizes=(1, 2), cache_dir=cache_dir)
    runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                 max_num_tokens=8, max_num_seqs=2)
    runner.capture()
    logits = runner.execute([kvgraph.RequestChunk([1, 2, 3], 0, [0])])
    return {"compile": runner.stats()["compile"], "logits": logits.clone()}


@pytest.mark.slow
def test_ranks_share_one_cache_dir_and_sizes_do_not(tmp_path):
    """Two ranks build into one cache dir, then both load from it; TP=1 loads nothing of TP=2's
    (its key has the TP size) and matches it."""
    cache_dir = str(tmp_path / "cache")
    cold = run_ranks(_inductor_run, tmp_path, args=(cache_dir,))
    warm = run_ranks(_inductor_run, tmp_path, args=(cache_dir,))
    for rank in range(2):
        assert cold[rank]["compile"]["builds"] + cold[rank]["compile"]["cache_hits"] > 0
        assert warm[rank]["compile"]["builds"] == 0, warm[rank]["compile"]
        assert warm[rank]["compile"]["cache_hits"] > 0
        torch.testing.assert_close(warm[rank]["logits"], cold[0]["logits"], rtol=0, atol=0)
    single = _inductor_run(0, cache_dir)  # no torch.distributed here: TP size 1
    assert single["compile"]["cache_hits"] == 0 and single["compile"]["builds"] > 0
    # TP=1's all-reduce is the identity, so its states are half the two equal ranks' sum.
    torch.testing.assert_close(2 * single["logits"], cold[0]["logits"], rtol=1e-5, atol=1e-5)


def _collective_as_splitting_op(rank: int) -> dict:
    from kvgraph.attention.op_names import ATTENTION_OPS
    from tests.support.scenario import BLOCK_SIZE, NUM_BLOCKS, make_model

    logits = {}
    for name, ops in (("default", ATTENTION_OPS),
                      ("split", ATTENTION_OPS + ("_c10d_functional::all_reduce",))):
        model = _Reducing(make_model("llama"), fail=False)
        config = kvgraph.CompilationConfig(graph_mode="piecewise", piece_compiler="eager",
                                           capture_sizes=(1, 2, 4), splitting_ops=ops)
        runner = kvgraph.ModelRunner(model, config, num_blocks=NUM_BLOCKS,
                                     block_size=BLOCK_SIZE, max_num_tokens=8, max_num_seqs=2)
        runner.capture()
        logits[name] = runner.execute([kvgraph.RequestChunk([1, 2, 3], 0, [0])]).clone()
        pieces = runner._forward.backend.pieces
        logits[f"{name}-pieces"] = len(pieces)
        runner.close()
    return logits


def test_a_collective_listed_as_splitting_op_runs_outside_the_graphs(tmp_path):
    for got in run_ranks(_collective_as_splitting_op, tmp_path):
        torch.testing.assert_close(got["split"], got["default"], rtol=0, atol=0)
        # The all-reduce after the last layer cuts the last piece in two.
        assert got["split-pieces"] == got["default-pieces"] + 1
