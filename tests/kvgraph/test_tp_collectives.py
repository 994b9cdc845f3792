"""kvgraph.distributed: the recorded TP group and its collectives, at size 1 and on two gloo ranks,
eager and traced through the kvgraph backend (kept inside pieces, never split from their wait)."""

import pytest
import torch
import torch.distributed as dist

from kvgraph import ConfigError
from kvgraph import distributed as tp
from tests.support.tp_harness import run_ranks


def test_without_torch_distributed_everything_is_size_one():
    assert not dist.is_initialized()
    group = tp.tensor_parallel_group()
    assert (group.rank, group.world_size, group.group, group.cpu_group) == (0, 1, None, None)
    x = torch.randn(3, 4)
    assert tp.all_reduce(x) is x
    assert tp.all_gather(x, dim=1) is x
    assert tp.reduce_scatter(x, dim=0) is x


def test_recording_needs_torch_distributed():
    with pytest.raises(ConfigError, match="init_process_group"):
        tp.init_tensor_parallel()


def _collectives(rank: int) -> dict:
    x = torch.arange(8, dtype=torch.float32).view(2, 4) + 10 * rank
    group = tp.tensor_parallel_group()
    with pytest.raises(ConfigError, match="already recorded"):
        tp.init_tensor_parallel(dist.new_group([0, 1]))
    # clone(): eager collectives return tensors that wait on first use, as later ops do.
    return {"rank": group.rank, "size": group.world_size, "backend": group.backend,
            "cpu_group_is_separate": group.cpu_group not in (None, group.group),
            "reduced": tp.all_reduce(x).clone(), "gathered0": tp.all_gather(x, 0).clone(),
            "gathered1": tp.all_gather(x, -1).clone(),
            "scattered0": tp.reduce_scatter(x, 0).clone(),
            "scattered1": tp.reduce_scatter(x, 1).clone()}


def test_collectives_on_two_ranks(tmp_path):
    results = run_ranks(_collectives, tmp_path)
    xs = [torch.arange(8, dtype=torch.float32).view(2, 4) + 10 * r for r in range(2)]
    total = xs[0] + xs[1]
    for rank, got in enumerate(results):
        assert (got["rank"], got["size"], got["backend"]) == (rank, 2, "gloo")
        assert got["cpu_group_is_separate"]
        torch.testing.assert_close(got["reduced"], total, rtol=0, atol=0)
        torch.testing.assert_close(got["gathered0"], torch.cat(xs, 0), rtol=0, atol=0)
        torch.testing.assert_close(got["gathered1"], torch.cat(xs, 1), rtol=0, atol=0)
        torch.testing.assert_close(got["scattered0"], total.chunk(2, 0)[rank], rtol=0, atol=0)
        torch.testing.assert_close(got["scattered1"], total.chunk(2, 1)[rank], rtol=0, atol=0)


class _Reducing(torch.nn.Module):
    """Attention between two reduced matmuls, so the split has collectives on both sides."""

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = tp.all_reduce(x @ w)
        y = torch.sin(y) + tp.all_gather(y, 0)[: y.shape[0]]
        return tp.reduce_scatter(y @ w, 1)


def _traced(rank: int) -> dict:
    from kvgraph import CompilationConfig
    from kvgraph.compilation.backend import KVGraphBackend

    torch.manual_seed(0)
    x, w = torch.randn(6, 4) + rank, torch.randn(4, 4)
    model = _Reducing()
    eager = model(x, w)
    backend = KVGraphBackend(CompilationConfig(graph_mode="none", piece_compiler="eager",
                                               use_compile_cache=False))
    graphs = []

    def keep(gm, example_inputs, **kwargs):
        graphs.append(gm)
        return backend(gm, example_inputs, **kwargs)

    compiled = torch.compile(model, backend=keep, fullgraph=True)(x, w)
    code = graphs[0].code
    return {"eager": eager.clone(), "compiled": compiled.clone(),
            "ops": [t for t in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                "wait_tensor") if t in code]}


def test_traced_collectives_match_eager(tmp_path):
    for got in run_ranks(_traced, tmp_path):
        assert got["ops"] == ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                              "wait_tensor"]
        torch.testing.assert_close(got["compiled"], got["eager"], rtol=0, atol=0)


def test_a_destroyed_group_is_forgotten(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        recorded = tp.tensor_parallel_group()
        assert (recorded.world_size, recorded.backend) == (1, "gloo")
        x = torch.ones(2)
        assert tp.all_reduce(x) is x  # size 1: the identity, even with a group
    finally:
        dist.destroy_process_group()
    assert tp.tensor_parallel_group().group is None


@pytest.mark.parametrize("version, refused", [((2, 9, 5), True), ((2, 9, 6), False),
                                              ((2, 21, 5), False)])
def test_nccl_too_old_to_capture_is_refused(monkeypatch, version, refused):
    from kvgraph import GraphError

    monkeypatch.setattr(tp.TensorParallelGroup, "backend", property(lambda self: "nccl"))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    group = tp.TensorParallelGroup(None, 0, 2)
    if refused:
        with pytest.raises(GraphError, match=r"NCCL 2\.9\.5 cannot be captured.*>= 2\.9\.6"):
            group.check_capturable()
    else:
        group.check_capturable()
