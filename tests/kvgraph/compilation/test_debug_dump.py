"""Debug dumps: what a runner's (or a torch.compile's) dump holds, that its index and events
agree with its files, and that a dump dir that fails never fails a compile or a capture."""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvgraph
from kvgraph.compilation.backend import KVGraphBackend
from kvgraph.compilation.counters import compile_counters
from passes import GraphPass, PassManager
from tests.support.scenario import assert_matches_eager, generate, make_runner

LAYERS = 2  # the scenario models' depth


def events(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]


def index_links(directory: Path) -> list[str]:
    return re.findall(r"\]\(([^)]+)\)", (directory / "index.md").read_text())


def dumped_runner(directory: Path, mode: str = "full_and_piecewise", **config):
    runner = make_runner("llama", mode, debug_dump_path=str(directory), **config)
    runner.capture()
    generate(runner, runner.model.config.vocab_size)
    runner.close()
    return runner


def test_a_runner_dump_holds_every_stage_and_its_index_resolves(tmp_path):
    dumped_runner(tmp_path)
    links = index_links(tmp_path)
    assert links and all((tmp_path / link).stat().st_size > 0 for link in links)
    listed = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert listed - set(links) == {"index.md", "events.jsonl"}  # every file is in the index
    recorded = events(tmp_path)
    assert [e["seq"] for e in recorded] == list(range(len(recorded)))
    assert {e["file"] for e in recorded if e["file"]} == set(links)
    stages = [e["stage"] for e in recorded]
    order = ["runner", "config", "dynamo", "cache", "pass", "passes", "split", "piece", "build",
             "counters", "bytecode", "trace", "capture", "stats"]
    assert [stage for stage in dict.fromkeys(stages) if stage in order] == order
    names = [Path(link).name for link in links]
    assert sum(name.split("-", 1)[1].startswith("piece-") for name in names if "-" in name) \
        == 2 * LAYERS + 1
    builds = [e for e in recorded if e["stage"] == "build"]
    assert [b["data"]["outcome"] for b in builds] == ["uncompiled"] * (LAYERS + 1)


def test_the_node_table_marks_each_layers_kv_cache(tmp_path):
    dumped_runner(tmp_path, "piecewise")
    (table,) = tmp_path.glob("compile-000/*-dynamo-nodes.md")
    rows = [line for line in table.read_text().splitlines()[2:]]
    caches = [row for row in rows if row.rstrip().endswith("| yes |")]
    assert len(caches) == 2 * LAYERS  # a key and a value cache per layer
    assert all("kv_cache" in row and "placeholder" in row for row in caches)
    (summary,) = json.loads(next(tmp_path.glob("compile-000/*-passes.json")).read_text())
    assert len(rows) == summary["nodes_before"]  # one row per node of the traced graph


def test_the_split_report_says_which_pieces_are_attention_and_where_values_flow(tmp_path):
    dumped_runner(tmp_path, "piecewise")
    (report,) = tmp_path.glob("compile-000/*-split-pieces.json")
    split = json.loads(report.read_text())
    kinds = [piece["kind"] for piece in split["pieces"]]
    assert kinds == ["compute", "attention"] * LAYERS + ["compute"]
    assert split["attention_pieces"] == LAYERS and split["compute_pieces"] == LAYERS + 1
    first, attention, second = split["pieces"][:3]
    assert first["inputs_from"] == ["input"] and "submod_1" in first["outputs_to"]
    assert attention["op"] == "torch.ops.kvgraph.unified_attention"
    assert "submod_0" in attention["inputs_from"] and "submod_0" in second["inputs_from"]
    assert split["pieces"][-1]["outputs_to"] == ["output"]


def defines(code: str, name: str) -> str | None:
    """The line of dumped graph code that assigns `name`, if any."""
    return next((line for line in code.splitlines()
                 if re.match(rf"\s*{name}(: .*)? = ", line)), None)


def _add_then_drop(gm: torch.fx.GraphModule) -> None:
    """A test pass: turns `cos` into `sin` and adds an unused node after the first input."""
    graph = gm.graph
    for node in graph.nodes:
        if node.target is torch.cos:
            node.target = torch.sin
    first = next(iter(graph.nodes))
    with graph.inserting_after(first):
        graph.call_function(torch.neg, (first,))


def test_each_pass_summary_matches_the_graphs_before_and_after_it(tmp_path):
    backend = KVGraphBackend(kvgraph.CompilationConfig(
        graph_mode="none", piece_compiler="eager", debug_dump_path=str(tmp_path)))
    backend.pass_manager = PassManager([GraphPass("add_then_drop", _add_then_drop)])
    compiled = torch.compile(lambda x: torch.cos(x).relu() + 1, backend=backend, fullgraph=True)
    x = torch.randn(5)
    torch.testing.assert_close(compiled(x), torch.sin(x).relu() + 1)  # the pass really ran
    (summary,) = json.loads(next(tmp_path.glob("compile-000/*-passes.json")).read_text())
    before = next(tmp_path.glob("compile-000/*-dynamo.py")).read_text()
    after = next(tmp_path.glob("compile-000/*-pass-add_then_drop.py")).read_text()
    (added,) = summary["added"]
    assert defines(before, added) is None and "torch.neg" in defines(after, added)
    (changed,) = summary["changed"]
    assert "torch.cos" in defines(before, changed) and "torch.sin" in defines(after, changed)
    assert summary["removed"] == []
    assert summary["nodes_after"] == summary["nodes_before"] + 1


def test_a_second_runner_replaces_the_dump_and_leaves_other_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    dumped_runner(tmp_path, "piecewise")
    dumped_runner(tmp_path, "full_decode_only")
    runners = [e for e in events(tmp_path) if e["stage"] == "runner"]
    assert [r["data"]["graph_mode"] for r in runners] == ["full_decode_only"]
    assert sorted(p.name for p in tmp_path.glob("compile-*")) == ["compile-000"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_torch_compile_with_the_kvgraph_backend_shares_one_session_per_dump_path(tmp_path):
    options = {"debug_dump_path": str(tmp_path), "piece_compiler": "eager", "graph_mode": "none"}
    for fn in (torch.sin, torch.cos):
        compiled = torch.compile(lambda x, fn=fn: fn(x) * 2, backend="kvgraph", options=options)
        torch.testing.assert_close(compiled(torch.ones(3)), fn(torch.ones(3)) * 2)
    assert sorted(p.name for p in tmp_path.glob("compile-*")) == ["compile-000", "compile-001"]


def test_a_vanished_dump_dir_costs_one_warning_and_nothing_else(tmp_path, caplog):
    directory = tmp_path / "dump"
    runner = make_runner("llama", "full_and_piecewise", debug_dump_path=str(directory))
    shutil.rmtree(directory)
    with caplog.at_level(logging.WARNING):
        runner.capture()
        _, tokens = generate(runner, runner.model.config.vocab_size)
        stats = runner.stats()
        runner.close()
    stops = [r for r in caplog.records if "debug dump" in r.getMessage()]
    assert len(stops) == 1 and "stops here" in stops[0].getMessage()
    assert stats["compile"]["pieces"] == LAYERS + 1 and stats["graphs"]["replays"] > 0
    eager = make_runner("llama", "eager")
    assert generate(eager, eager.model.config.vocab_size)[1] == tokens


def test_a_dump_that_fills_its_disk_stops_with_one_warning_and_serves_on(tmpfs, caplog):
    directory = tmpfs(64 * 1024)  # room for the first files, not for all
    with caplog.at_level(logging.WARNING):
        runner = assert_matches_eager("llama", "full_and_piecewise",
                                      debug_dump_path=str(directory))
        runner.close()
    stops = [r for r in caplog.records if "debug dump" in r.getMessage()]
    assert len(stops) == 1 and "No space left" in stops[0].getMessage()
    assert (directory / "index.md").stat().st_size > 0


def test_a_distributed_job_dumps_each_rank_in_its_own_dir(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0,
                            world_size=1)
    try:
        dumped_runner(tmp_path / "dump", "piecewise")
    finally:
        dist.destroy_process_group()
    assert (tmp_path / "dump" / "rank_0" / "index.md").exists()
    assert not (tmp_path / "dump" / "index.md").exists()


def test_warnings_while_the_session_is_open_are_events(tmp_path, allow_capture_failures,
                                                       monkeypatch):
    runner = make_runner("llama", "piecewise", debug_dump_path=str(tmp_path))
    original = runner._capture_one

    def fail_size_four(mode, descriptor):
        if descriptor.num_tokens == 4:
            raise RuntimeError("injected capture failure")
        return original(mode, descriptor)

    monkeypatch.setattr(runner, "_capture_one", fail_size_four)
    summary = runner.capture()
    runner.close()
    (failed,) = summary["failed"]
    warned = [e["data"]["message"] for e in events(tmp_path) if e["stage"] == "warning"]
    assert any(failed in message and "injected" in message for message in warned)
    (row,) = [r for r in json.loads((tmp_path / "capture.json").read_text())["table"]
              if r["error"]]
    assert row["descriptor"] == failed and row["graphs"] == 0


@pytest.mark.slow
def test_inductor_builds_dump_their_code_and_say_why_the_cache_missed(tmp_path):
    cache = tmp_path / "cache"
    first, second, third = (tmp_path / name for name in ("first", "second", "third"))
    for directory, sizes in ((first, ()), (second, ()), (third, (4,))):
        compile_counters.reset()
        torch._dynamo.reset()
        dumped_runner(directory, "piecewise", piece_compiler="inductor", cache_dir=str(cache),
                      compile_sizes=sizes)
    builds = {d.name: [e["data"] for e in events(d) if e["stage"] == "build"]
              for d in (first, second, third)}
    assert {b["outcome"] for b in builds["first"]} == {"built"}
    assert all("not built before under this key" in b["why"] for b in builds["first"])
    assert {b["outcome"] for b in builds["second"]} == {"loaded"}
    assert any("compile_sizes" in (b["why"] or "") for b in builds["third"])
    code = next(first.glob("compile-000/*-build-submod_0-general.py")).read_text()
    assert "def call(" in code  # inductor's output code, not the FX graph
    (key,) = [e["data"] for e in events(third) if e["name"] == "cache-key"]
    assert key["used"] and "settings.compile_sizes: [] -> [4]" in key["key_change"]
    assert key["factors"]["torch"] == torch.__version__


@pytest.mark.slow
def test_cpu_builds_are_keyed_by_the_thread_count_inductor_generates_for(tmp_path):
    """Inductor builds for one thread without OpenMP: a one-thread build loaded by a
    two-thread process would run its kernels on one core. The two-thread process builds anew,
    saying why, with parallel loops."""
    cache = tmp_path / "cache"
    code = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        compile_counters.reset()
        torch._dynamo.reset()
        directory = tmp_path / f"threads-{threads}"
        dumped_runner(directory, "piecewise", piece_compiler="inductor", cache_dir=str(cache))
        builds = [e["data"] for e in events(directory) if e["stage"] == "build"]
        assert {b["outcome"] for b in builds} == {"built"}
        (key,) = [e["data"] for e in events(directory) if e["name"] == "cache-key"]
        assert key["factors"]["cpu_threads"] == threads
        code[threads] = "".join(p.read_text() for p in
                                directory.glob("compile-000/*-build-submod_*-general.py"))
    assert "cpu_threads: 1 -> 2" in key["key_change"]
    assert "omp parallel" not in code[1]
    # torch 2.11 leaves the tiny model's loops serial at two threads too; 2.13 parallelises them.
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 13):
        assert "omp parallel" in code[2]


@pytest.mark.slow
def test_tlparse_shows_kvgraphs_stages_beside_dynamos(tmp_path):
    beside = Path(sys.executable).parent / "tlparse"  # a venv's, whether or not it is on PATH
    tlparse = str(beside) if beside.exists() else shutil.which("tlparse")
    if tlparse is None:
        pytest.skip("tlparse is not installed (pip install tlparse; it is in the test extra)")
    script = ("from tests.support.scenario import make_runner, generate\n"
              "r = make_runner('llama', 'full_and_piecewise')\n"
              "r.capture(); generate(r, r.model.config.vocab_size); r.close()\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parents[3],
                   env={**os.environ, "TORCH_TRACE": str(tmp_path / "trace")})
    (log,) = (tmp_path / "trace").iterdir()
    out = tmp_path / "out"
    subprocess.run([tlparse, str(log), "-o", str(out), "--no-browser", "--strict"], check=True,
                   capture_output=True)
    page = (out / "index.html").read_text()
    for name in ("kvgraph_dynamo", "kvgraph_split", "kvgraph_split-pieces", "kvgraph_passes",
                 "kvgraph_piece-submod_0", "kvgraph_build-submod_0-general", "kvgraph_capture",
                 "kvgraph_stats"):
        assert f"{name}_" in page, name
    assert "dynamo_output_graph" in page  # Dynamo's own entries are there too


def test_a_dropped_runners_dump_records_no_later_warnings(tmp_path):
    runner = make_runner("llama", "piecewise", debug_dump_path=str(tmp_path))
    runner.compile()
    del runner  # dropped without close(): torch keeps its backend, which must let go
    gc.collect()
    before = (tmp_path / "events.jsonl").read_text()
    logging.getLogger("kvgraph.runtime.runner").warning("kvgraph: a later warning")
    assert (tmp_path / "events.jsonl").read_text() == before


def test_dump_code_that_fails_on_a_graph_costs_a_note_not_the_compile(tmp_path, monkeypatch,
                                                                       caplog):
    import kvgraph.compilation.backend as backend

    def unexpected(*args):
        raise KeyError("a graph the report does not expect")

    monkeypatch.setattr(backend, "split_report", unexpected)
    with caplog.at_level(logging.WARNING):
        runner = assert_matches_eager("llama", "piecewise", debug_dump_path=str(tmp_path))
    assert runner.stats()["compile"]["pieces"] == LAYERS + 1
    (report,) = tmp_path.glob("compile-000/*-split-pieces.json")
    assert "could not describe split-pieces: KeyError" in report.read_text()
    assert sum("could not describe" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("configured", [False, True], ids=["no logging set up", "basicConfig"])
def test_a_dump_records_kvgraphs_warnings_without_taking_them_away(tmp_path, configured):
    """Without logging set up, Python prints warnings through `logging.lastResort`, which it
    stops using once any handler is on the way: the dump's recorder passes them on, once, and
    with a handler of the process's own it leaves them to that one."""
    script = (f"import logging{'; logging.basicConfig()' if configured else ''}\n"
              "from tests.support.scenario import make_runner\n"
              f"runner = make_runner('llama', 'none', debug_dump_path={str(tmp_path)!r})\n"
              "logging.getLogger('kvgraph.probe').warning('the probe warns')\n"
              "runner.close()\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=Path(__file__).parents[3], timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("the probe warns") == 1, result.stderr
    events = "".join(p.read_text() for p in tmp_path.rglob("*.jsonl"))
    assert "the probe warns" in events  # recorded in the dump too
