"""Each tensor-parallel rank's KV connector report, back on rank 0 and merged (issue 46).

The rule is vLLM's (KVOutputAggregator): a request is sent or loaded once every rank has said
so, in whichever steps they do; a block failed if any rank failed it. Rank 0's side is checked
on a real runner behind a stand-in channel (what it sends, gathers and merges; a rank gone), the
gather itself over two real gloo processes, a report longer than the gather's buffer included.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import kvgraph
from examples.engine.kv_output_merge import KVOutputMerger
from examples.engine.step_channel import REPORT_BYTES, STEP, TRANSFER, StepChannel
from examples.engine.tp_runner import RankFailed, TensorParallelRunner
from kvgraph.distributed import TensorParallelGroup
from kvgraph.kv_transfer import KVConnectorOutput
from kvgraph.kv_transfer.shared_storage import SharedStorageMetadata
from tests.support.kv_engines import make_kv_engine


def report(sent=(), loaded=(), failed=()) -> KVConnectorOutput:
    return KVConnectorOutput(set(sent), set(loaded), set(failed))


# --- the rule -------------------------------------------------------------------------------

def test_a_request_finished_on_one_rank_only_is_not_finished():
    merger = KVOutputMerger(2)
    first = merger.merge([report(sent=["a"], loaded=["b"]), report()])
    assert first == report()
    # Rank 1 reports them a step later: only now are they finished, once.
    assert merger.merge([report(), report(sent=["a"], loaded=["b"])]) == report(["a"], ["b"])
    assert merger.merge([report(), report()]) == report()


def test_a_request_every_rank_reports_in_one_step_is_finished_then():
    merger = KVOutputMerger(3)
    assert merger.merge([report(loaded=["r"])] * 3) == report(loaded=["r"])
    assert merger.merge([report(loaded=["s"]), report(), report(loaded=["s"])]) == report()


def test_sent_and_loaded_are_counted_apart():
    merger = KVOutputMerger(2)
    assert merger.merge([report(sent=["r"]), report(loaded=["r"])]) == report()
    assert merger.merge([report(loaded=["r"]), report(sent=["r"])]) == report(["r"], ["r"])


def test_failed_blocks_are_the_union_at_once():
    merger = KVOutputMerger(2)
    merged = merger.merge([report(loaded=["r"], failed=[3, 4]), report(loaded=["r"], failed=[7])])
    assert merged == report(loaded=["r"], failed=[3, 4, 7])


def test_one_report_per_rank():
    with pytest.raises(ValueError, match=r"one KV connector report per rank \(2\), got 1"):
        KVOutputMerger(2).merge([report()])
    with pytest.raises(ValueError, match="at least 1 rank, got 0"):
        KVOutputMerger(0)


# --- rank 0: a real runner with a connector, a stand-in channel -----------------------------

class TwoRanks:
    """A step channel whose rank 1 reports `rank_one` (one report per gather), or is gone."""

    rank, world_size = 0, 2

    def __init__(self, *rank_one: KVConnectorOutput | Exception):
        self.rank_one = list(rank_one)
        self.sent: list[tuple[str, object]] = []

    def send(self, kind, payload=None):
        self.sent.append((kind, payload))

    def gather(self, mine):
        answer = self.rank_one.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return [mine, answer]


@pytest.fixture
def tp_runner(tmp_path):
    """A TensorParallelRunner over a tiny runner with the shared-storage connector, its rank 1
    the stand-in `TwoRanks(*rank_one)`."""
    engine = make_kv_engine("llama", store=tmp_path)
    made = []

    def make(*rank_one):
        made.append(TensorParallelRunner(engine.runner, TwoRanks(*rank_one)))
        return made[-1]
    yield make
    made[-1].close()


def test_the_metadata_goes_with_the_step_and_the_reports_come_back_merged(tp_runner):
    runner = tp_runner(report(loaded=["r"], failed=[5]), report())
    chunk = kvgraph.RequestChunk([1, 2, 3], 0, [0])
    metadata = SharedStorageMetadata()
    runner.execute([chunk], metadata)
    assert [(kind, chunks) for kind, (chunks, _) in runner._channel.sent] == [(STEP, [chunk])]
    assert isinstance(runner._channel.sent[0][1][1], SharedStorageMetadata)
    # Rank 0 reported nothing: rank 1's load is not finished, its failed block is.
    assert runner.kv_connector.output == report(failed=[5])
    output = runner.kv_connector.transfer(metadata)
    assert runner._channel.sent[-1][0] == TRANSFER
    assert output is runner.kv_connector.output and output == report()


def test_a_batch_every_rank_refuses_gathers_nothing_and_reports_nothing(tp_runner):
    runner = tp_runner(report(failed=[1]))
    runner.execute([kvgraph.RequestChunk([1], 0, [0])])
    assert runner.kv_connector.output == report(failed=[1])
    with pytest.raises(kvgraph.BatchError):
        runner.execute([kvgraph.RequestChunk([1, 2, 3], 0, [10**6])])
    assert runner.kv_connector.output == report()
    assert runner._channel.rank_one == []  # no gather asked for: none waits on the workers


def test_a_gather_that_fails_is_fatal(tp_runner):
    runner = tp_runner(RuntimeError("Connection closed by peer"))
    with pytest.raises(RankFailed, match="gathering the ranks' KV connector reports failed: "
                       "RuntimeError: Connection closed by peer"):
        runner.kv_connector.transfer(SharedStorageMetadata())
    with pytest.raises(RankFailed):
        runner.execute([kvgraph.RequestChunk([1], 0, [0])])


# --- the gather, over two processes ---------------------------------------------------------

LONG = report(failed=range(2 * REPORT_BYTES))  # its pickle is far longer than REPORT_BYTES
# What each rank reports, gather by gather.
REPORTS = [[report(sent=["a"]), LONG, report()],
           [report(loaded=["b"]), LONG, report(failed=[1])]]


def _gather_on(rank: int, store_path: str, results) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank,
                            world_size=2)
    try:
        channel = StepChannel(TensorParallelGroup(dist.group.WORLD, rank, 2, timeout_s=30))
        for mine in REPORTS[rank]:
            gathered = channel.gather(mine)
            if rank == 0:
                results.append(gathered)
    finally:
        dist.destroy_process_group()


def test_each_rank_s_report_reaches_rank_0_a_long_one_too(tmp_path):
    context = mp.get_context("spawn")
    results: list = []
    worker = context.Process(target=_gather_on, args=(1, str(tmp_path / "store"), []))
    worker.start()
    _gather_on(0, str(tmp_path / "store"), results)
    worker.join(60)
    assert worker.exitcode == 0
    assert results == [list(pair) for pair in zip(*REPORTS)]
