"""`python -m kvgraph.inspect DIR`: the text, HTML and JSON summaries of real debug dumps of a
two-layer model, the warnings they derive, and the paths that hold no dump."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch

import kvgraph
from kvgraph.inspect import load_dump, summary_json, text_report
from kvgraph.inspect.__main__ import main
from kvgraph.inspect.units import size
from tests.support.capture_faults import FAILING_SIZE, CannotCaptureFourTokens
from tests.support.dumps import make_dump
from tests.support.scenario import make_model

ROOT = Path(__file__).resolve().parents[3]
# The stages a runner's dump records, as events.jsonl names them.
RUNNER_STAGES = {"runner", "config", "dynamo", "cache", "pass", "passes", "split", "piece", "build",
                 "counters", "bytecode", "trace", "capture", "stats", "warning"}
# What the HTML page has a table of (kvgraph.inspect.sections' `stage` names).
HTML_TABLES = {"timeline", "runner", "config", "dynamo", "cache", "pass", "split", "piece", "build",
               "counters", "trace", "capture", "stats", "time", "warning"}


def inspect_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgraph.inspect", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def failing_dump(tmp_path_factory) -> Path:
    """A dump whose 4-token captures fail (a backend that cannot record them), in mode full,
    which that backend (like torch_native) serves only as full_and_piecewise."""
    return make_dump(tmp_path_factory.mktemp("dump"), "full",
                     attn_backend=CannotCaptureFourTokens.name)


@pytest.fixture(scope="module")
def inspected(failing_dump, tmp_path_factory):
    """The real command's text output and HTML page for `failing_dump`."""
    page = tmp_path_factory.mktemp("html") / "dump.html"
    result = inspect_command(str(failing_dump), "--html", str(page))
    assert result.returncode == 0, result.stderr
    return result.stdout, page.read_text()


def events(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "events.jsonl").read_text().splitlines()]


def section(text: str, title: str) -> str:
    """The lines of the text report's section whose title starts with `title`."""
    match = re.search(rf"^## {re.escape(title)}.*?(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no section {title!r} in:\n{text}"
    return match.group(0)


# --- text -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("allow_capture_failures")
def test_the_text_names_every_stage_in_order_with_seconds(failing_dump, inspected):
    text, _ = inspected
    assert {e["stage"] for e in events(failing_dump)} == RUNNER_STAGES
    timeline = section(text, "Stages, in the order they ran")
    named = [line.split() for line in timeline.splitlines()[2:]]
    for stage in RUNNER_STAGES - {"piece", "warning"}:  # these have tables of their own
        assert any(stage in words for words in named), stage
    builds = [line for line in timeline.splitlines() if " build " in line]
    assert builds and all(re.search(r"\d ms|\d s", line) for line in builds)
    assert "## Pieces" in text and "## Warnings" in text
    time_spent = section(text, "Where the time went")
    assert "trace (Dynamo)" in time_spent and "capture" in time_spent and "%" in time_spent


@pytest.mark.usefixtures("allow_capture_failures")
def test_the_text_lists_the_pieces_and_which_are_attention(failing_dump, inspected):
    text, _ = inspected
    split = json.loads(next((failing_dump / "compile-000").glob("*-split-pieces.json")).read_text())
    pieces = section(text, "Pieces")
    assert len(split["pieces"]) == 5  # two layers: 3 compute pieces around 2 attention ones
    for piece in split["pieces"]:
        row = next(line for line in pieces.splitlines() if line.split()[1:2] == [piece["name"]])
        assert piece["kind"] in row.split()
    assert "piece_compiler 'eager' builds nothing to keep" in section(text, "Compile cache")


@pytest.mark.usefixtures("allow_capture_failures")
def test_the_descriptor_table_has_memory_and_the_failed_captures(failing_dump, inspected):
    text, _ = inspected
    capture = json.loads((failing_dump / "capture.json").read_text())
    table = section(text, "Captured graphs")
    for row in capture["table"]:
        line = next(line for line in table.splitlines() if line.startswith(row["descriptor"]))
        assert size(row["bytes"]) in line and row["mode"] in line
        if row["error"]:
            assert "out of memory while recording" in line
    assert any(row["bytes"] > 0 for row in capture["table"])
    assert f"the runner's graphs hold {size(capture['bytes'])}" in table


@pytest.mark.usefixtures("allow_capture_failures")
def test_the_downgrade_failed_captures_and_steps_without_graphs_are_warnings(inspected):
    warnings = section(inspected[0], "Warnings")
    assert "graph mode 'full' downgraded to 'full_and_piecewise'" in warnings  # logged
    assert ("graph mode downgraded: asked 'full', the runner resolved 'full_and_piecewise'"
            in warnings)
    failed = [line for line in warnings.splitlines() if "capturing" in line and "failed" in line]
    assert len(failed) == 2 and all(f"num_tokens={FAILING_SIZE}," in line for line in failed)
    assert "with no captured graph for its descriptor ran without graphs" in warnings  # stats
    assert "above the largest capture size (16 tokens) ran without graphs" in warnings


def test_a_mode_downgraded_by_the_compile_and_recompiles_are_warnings(tmp_path):
    # Splitting ops the model never calls: piecewise becomes full, then (torch_native captures
    # uniform decode only) full_decode_only.
    dump = make_dump(tmp_path / "downgraded", "piecewise",
                     splitting_ops=("kvgraph::encoder_attention",), attn_backend="torch_native")
    text = text_report(load_dump(dump))
    assert ("graph mode downgraded: asked 'piecewise', compile 0 built 'full', ran "
            "'full_decode_only'") in section(text, "Warnings")
    assert "## Pieces" in text and "whole graph" in section(text, "Pieces")

    torch._dynamo.reset()
    options = {"debug_dump_path": str(tmp_path / "plain"), "piece_compiler": "eager"}
    compiled = torch.compile(lambda x: torch.sin(x) * 2, backend="kvgraph", options=options)
    for shape in ((3,), (5,), (3, 3)):  # each a new trace: no dims were marked dynamic
        compiled(torch.randn(shape))
    torch._dynamo.reset()
    text = text_report(load_dump(tmp_path / "plain"))
    assert re.search(r"recompiled: Dynamo gave the backend \d graphs", text)
    assert "## Captured graphs" not in text  # a torch.compile dump: no runner, no capture


def test_identical_pieces_are_shown_sharing_one_build(tmp_path):
    torch._dynamo.reset()
    config = kvgraph.CompilationConfig(graph_mode="piecewise", piece_compiler="eager",
                                       capture_sizes=(1, 2), debug_dump_path=str(tmp_path))
    runner = kvgraph.ModelRunner(make_model("llama", num_layers=3), config, num_blocks=8,
                                 block_size=4, max_num_seqs=2, max_num_tokens=8)
    runner.compile()
    runner.close()
    torch._dynamo.reset()
    text = text_report(load_dump(tmp_path))
    shared = [line for line in section(text, "Pieces").splitlines()[1:] if "identical" in line]
    assert [line.split()[1] for line in shared] == ["submod_4"]  # layer 2's is layer 1's
    assert "those of submod_2 (identical: built once)" in shared[0]
    assert "4 compute pieces, 3 built (1 identical to an earlier one" in section(text, "Builds")


# --- HTML -------------------------------------------------------------------------------------


class Page(HTMLParser):
    """What the tests read off a page: tag balance, tables, collapsible code, outside links."""

    VOID = {"meta", "br", "hr", "img", "link", "input", "wbr", "col", "area", "base", "source"}

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.open: list[str] = []
        self.errors: list[str] = []
        self.tables: list[str | None] = []
        self.tags: list[str] = []
        self.code: list[str] = []  # each <pre> inside a <details>, unescaped
        self.outside: list[str] = []
        self.feed(text)
        self.close()
        self.errors += [f"<{tag}> never closed" for tag in self.open]

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        attrs = dict(attrs)
        if tag == "table":
            self.tables.append(attrs.get("data-stage"))
        self.outside += [v for k, v in attrs.items() if k in ("src", "href")
                         and v and not v.startswith("#")]
        if tag in self.VOID:
            return
        if tag == "pre" and "details" in self.open:
            self.code.append("")
        self.open.append(tag)

    def handle_endtag(self, tag):
        if not self.open or self.open[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.open[-1:] or 'nothing'}")
            return
        self.open.pop()

    def handle_data(self, data):
        if self.open and self.open[-1] == "pre" and "details" in self.open:
            self.code[-1] += data


@pytest.mark.usefixtures("allow_capture_failures")
def test_the_html_page_is_well_formed_self_contained_with_a_table_per_stage(inspected):
    page = Page(inspected[1])
    assert not page.errors, page.errors[:5]
    assert page.tags[0] == "html" and "style" in page.tags
    assert "script" not in page.tags and "link" not in page.tags and not page.outside
    assert sorted(page.tables) == sorted(HTML_TABLES)  # exactly one table per stage


@pytest.mark.usefixtures("allow_capture_failures")
def test_the_html_page_holds_each_piece_s_and_build_s_code_collapsible(failing_dump, inspected):
    page = Page(inspected[1])
    files = sorted((failing_dump / "compile-000").glob("*-piece-*.py")) + sorted(
        (failing_dump / "compile-000").glob("*-build-*.py"))
    assert len(files) == 5 + 3
    for file in files:  # escaped in the page, the same text once unescaped
        assert file.read_text() in page.code, file.name
    assert "&lt;" in inspected[1] or "&gt;" in inspected[1]


# --- JSON, ranks, damaged and missing dumps ---------------------------------------------------


@pytest.mark.usefixtures("allow_capture_failures")
def test_json_summary_of_a_multi_rank_dump(failing_dump, tmp_path, capsys):
    for rank in (1, 0):
        shutil.copytree(failing_dump, tmp_path / f"rank_{rank}")
    assert main([str(tmp_path), "--json"]) == 0
    sessions = json.loads(capsys.readouterr().out)["sessions"]
    assert [s["rank"] for s in sessions] == [0, 1]
    for session in sessions:
        assert [p["kind"] for p in session["compiles"][0]["pieces"]] == [
            "compute", "attention", "compute", "attention", "compute"]
        assert any("capturing" in w["message"] for w in session["warnings"])
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"{tmp_path / 'rank_0'}, rank 0" in text and f"{tmp_path / 'rank_1'}, rank 1" in text


@pytest.mark.usefixtures("allow_capture_failures")
def test_a_truncated_last_event_is_skipped_with_a_note(failing_dump, tmp_path, capsys):
    dump = shutil.copytree(failing_dump, tmp_path / "dump")
    lines = (dump / "events.jsonl").read_text().splitlines(keepends=True)
    (dump / "events.jsonl").write_text("".join(lines[:-1]) + lines[-1][:20])  # killed mid-write
    assert main([str(dump)]) == 0
    text = capsys.readouterr().out
    assert "note: events.jsonl ends in a partial record" in text
    assert "## Captured graphs" in text


@pytest.mark.usefixtures("allow_capture_failures")
def test_a_verify_report_is_shown_and_its_failures_are_warnings(failing_dump, tmp_path):
    dump = shutil.copytree(failing_dump, tmp_path / "dump")
    key = "piecewise:BatchDescriptor(num_tokens=8, num_reqs=None, uniform_decode=False)"
    (dump / "verify.json").write_text(json.dumps({
        "enabled": True, "checks": 2, "failures": 1, "descriptors": {
            key: {"checks": 2, "failures": 1, "max_rel": 0.5, "cache_max_rel": 0.0,
                  "token_flips": 1, "passed": False, "where": "layer 1 (model.layers.1)"}}}))
    summaries = load_dump(dump)
    text = text_report(summaries)
    assert key in section(text, "verify: graph against eager: descriptors")
    assert f"verify: {key} differs from eager in 1 of 2 checks" in section(text, "Warnings")
    assert "layer 1 (model.layers.1)" in text
    assert json.loads(summary_json(summaries))["sessions"][0]["verify"]["failures"] == 1


def test_a_missing_dir_exits_2_with_a_message_not_a_traceback(tmp_path):
    result = inspect_command(str(tmp_path / "nowhere"))
    assert result.returncode == 2
    assert "nowhere does not exist" in result.stderr and "Traceback" not in result.stderr


def test_a_dir_or_file_that_is_not_a_dump_exits_2(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a dump")
    assert main([str(tmp_path)]) == 2
    assert "is not a kvgraph debug dump: it has no events.jsonl" in capsys.readouterr().err
    assert main([str(tmp_path / "notes.txt")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_kvgraph_inspect_leaves_the_standard_inspect_module_alone():
    import inspect

    import kvgraph.inspect as dump_inspect

    assert sys.modules["inspect"] is inspect and inspect is not dump_inspect
    assert list(inspect.signature(make_dump).parameters)[:2] == ["directory", "mode"]
    assert kvgraph.inspect is dump_inspect  # the subpackage, reached through kvgraph


# --- the compile cache, with inductor ---------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_shows_the_cache_hits_the_first_one_missed(tmp_path):
    cache = str(tmp_path / "cache")
    first = make_dump(tmp_path / "first", "piecewise", piece_compiler="inductor", cache_dir=cache)
    second = make_dump(tmp_path / "second", "piecewise", piece_compiler="inductor",
                       cache_dir=cache)
    outputs = []
    for dump in (first, second):
        result = inspect_command(str(dump))
        assert result.returncode == 0, result.stderr
        outputs.append(section(result.stdout, "Builds"))
    missed, hit = (text.splitlines()[2:5] for text in outputs)
    assert all(" built " in line and " miss " in line and "not built before" in line
               for line in missed), missed
    assert all(" loaded " in line and " hit " in line for line in hit), hit
    assert "cache hits 3, misses 0" in outputs[1]
