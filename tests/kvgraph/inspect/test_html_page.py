"""The top of `python -m kvgraph.inspect DIR --html OUT.html`: the overview of real dumps (what
ran, graph mode, graphs, pieces and descriptors, compile-cache hits and misses, warnings,
verify, time) against what the dump's own files say, and the page as headless Chromium renders
it: the overview drawn in its colours at the top, its text in the DOM before the first table."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from kvgraph.inspect.__main__ import main
from kvgraph.inspect.html_overview import STATUS_COLOURS
from kvgraph.inspect.html_report import COLLAPSED_ROWS
from kvgraph.inspect.overview import BAD, MAX_VALUE_CHARS, OK, WARN
from kvgraph.inspect.units import seconds
from tests.support.capture_faults import CannotCaptureFourTokens
from tests.support.chromium import chromium_binary, rendered_dom, screenshot
from tests.support.dumps import make_dump
from tests.support.html_tree import Element, Tree
from tests.support.png import png_rows, png_size

WIDTH, HEIGHT = 1280, 900  # the browser window, as a laptop shows the page
TOP_ROWS = 450  # of the screenshot: where the overview is drawn
COLOURED_PIXELS = 1000  # of each status's background in those rows: a card's worth
FAILED_KEY = "piecewise:BatchDescriptor(num_tokens=8, num_reqs=None, uniform_decode=False)"
FAILED_WHERE = "layer 1 (model.layers.1)"


# --- the dumps and what their files say ---------------------------------------------------------


@pytest.fixture(scope="module")
def passing_dump(tmp_path_factory) -> Path:
    """A runner's dump with verify on (its checks pass) and two steps above the capture sizes
    (a warning)."""
    return make_dump(tmp_path_factory.mktemp("passing"), "full_and_piecewise", verify=True)


@pytest.fixture(scope="module")
def failing_dump(tmp_path_factory) -> Path:
    """A dump whose 4-token captures fail (so mode full is served as full_and_piecewise), with
    a verify report of one failed check written over the real one."""
    dump = make_dump(tmp_path_factory.mktemp("failing"), "full",
                     attn_backend=CannotCaptureFourTokens.name, verify=True)
    (dump / "verify.json").write_text(json.dumps({
        "enabled": True, "checks": 2, "failures": 1, "token_flips": 1, "descriptors": {
            FAILED_KEY: {"checks": 2, "failures": 1, "max_rel": 0.5, "cache_max_rel": 0.0,
                         "token_flips": 1, "passed": False, "where": FAILED_WHERE}}}))
    return dump


def events(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "events.jsonl").read_text().splitlines()]


def report(dump: Path, name: str) -> dict:
    return json.loads((dump / f"{name}.json").read_text())


def runner_data(dump: Path) -> dict:
    return next(e["data"] for e in events(dump) if e["stage"] == "runner")


def cache_card(dump: Path) -> str:
    """What the compile-cache card must say, from the cache-key and build events: hits are
    builds loaded, misses builds built (or fallen back) where the cache was used."""
    recorded = events(dump)
    keys = [e["data"] for e in recorded if e["stage"] == "cache"]
    if not any(key["used"] for key in keys):
        return f"not used {keys[0]['why']}"
    outcomes = Counter(e["data"]["outcome"] for e in recorded if e["stage"] == "build")
    hits, misses = outcomes["loaded"], outcomes["built"] + outcomes["fallback"]
    return (f"{hits} {'hit' if hits == 1 else 'hits'}, "
            f"{misses} {'miss' if misses == 1 else 'misses'}")


def time_by_kind(dump: Path) -> dict[str, float]:
    """The seconds of each kind of work, from the events: the backend's rest is its time less
    its builds, passes and split."""
    recorded = events(dump)

    def total(stage: str, name: str | None = None) -> float:
        return sum(e["seconds"] or 0 for e in recorded
                   if e["stage"] == stage and name in (None, e["name"]))

    passes = sum(p["seconds"] for e in recorded if e["stage"] == "passes" for p in e["data"])
    builds, split = total("build"), total("split", "split")
    return {"trace (Dynamo)": total("trace"), "builds": builds, "passes": passes,
            "split": split, "backend, the rest": total("counters") - builds - passes - split,
            "capture": sum(e["data"]["seconds"] for e in recorded if e["stage"] == "capture")}


# --- reading a page -----------------------------------------------------------------------------


@dataclass
class Card:
    """One card of the overview as the page shows it: `status` its colour's class, `link` the
    table it points to; `detail` ends in the link's text."""

    label: str
    value: str
    detail: str
    status: str
    link: str | None


def cards(root: Element) -> dict[str, Card]:
    """The overview's cards by label."""
    found = {}
    for card in root.find("card"):
        links = card.each("a")
        status = next(c for c in card.classes if c in STATUS_COLOURS)
        label = card.first("label").words()
        found[label] = Card(label, card.first("value").words(), card.first("detail").words(),
                            status, links[0].attrs["href"] if links else None)
    return found


def html_page(dump: Path, out: Path) -> tuple[Path, Tree]:
    """The page main() writes of `dump` to `out`, and its tree."""
    assert main([str(dump), "--html", str(out)]) == 0
    return out, Tree(out.read_text())


@pytest.fixture(scope="module")
def passing_page(passing_dump, tmp_path_factory) -> Tree:
    return html_page(passing_dump, tmp_path_factory.mktemp("html") / "passing.html")[1]


@pytest.fixture(scope="module")
def failing_page(failing_dump, tmp_path_factory) -> tuple[Path, Tree]:
    return html_page(failing_dump, tmp_path_factory.mktemp("html") / "failing.html")


# --- the overview, against the dump ---------------------------------------------------------------


def test_the_overview_counts_graphs_pieces_and_descriptors_as_the_dump_does(passing_dump,
                                                                           passing_page):
    shown = cards(passing_page.root)
    recorded = events(passing_dump)
    graphs = len({e["compile"] for e in recorded if e["compile"] is not None})
    pieces = next(e["data"]["pieces"] for e in recorded if e["name"] == "split-pieces")
    kinds = Counter(piece["kind"] for piece in pieces)
    assert shown["Compiled"].value == f"{graphs} graph, {len(pieces)} pieces"
    assert shown["Compiled"].detail.startswith(
        f"{kinds['compute']} compute, {kinds['attention']} attention")
    rows = report(passing_dump, "capture")["table"]
    assert not any(row["error"] for row in rows)
    assert shown["Captured"].value == f"{len(rows)} descriptors"
    assert shown["Captured"].detail.startswith(f"{sum(row['graphs'] for row in rows)} graphs")
    assert shown["Captured"].status == OK and "none failed" in shown["Captured"].detail
    assert f"{shown['Compile cache'].value} {shown['Compile cache'].detail}".startswith(
        cache_card(passing_dump))


def test_the_overview_says_what_ran_where_and_when(passing_dump, passing_page):
    about = passing_page.root.first("about")
    terms = [dt.words() for dt in about.each("dt")]
    said = dict(zip(terms, (dd.words() for dd in about.each("dd"))))
    runner = runner_data(passing_dump)
    assert runner["attn_backend"] in said["ran"] and runner["device"] in said["ran"]
    written = (passing_dump / "events.jsonl").stat().st_mtime
    assert said["dump written"] == datetime.fromtimestamp(written, timezone.utc).strftime(
        "%Y-%m-%d %H:%M:%S UTC")
    assert said["session open"] == seconds(max(e["time"] for e in events(passing_dump)))
    shown = cards(passing_page.root)
    assert shown["Graph mode"].value == runner["graph_mode"] == runner["requested_graph_mode"]
    assert shown["Graph mode"].status == OK


def test_a_passed_verify_and_the_time_are_the_dump_s(passing_dump, passing_page):
    shown = cards(passing_page.root)
    verify = report(passing_dump, "verify")
    assert verify["failures"] == 0 and verify["checks"] > 0
    assert shown["Verify"].value == "passed" and shown["Verify"].status == OK
    assert shown["Verify"].detail.startswith(f"{verify['checks']} checks")
    spent = {what: s for what, s in time_by_kind(passing_dump).items() if s > 0}
    most = max(spent, key=spent.get)
    time = shown["Compile and capture time"]
    assert time.value == seconds(sum(spent.values()))
    assert time.detail.startswith(f"most in {most}: {seconds(spent[most])}")
    legend = [item.words() for item in passing_page.root.first("legend").each("li")]
    assert len(legend) == len(spent) and legend[0].startswith(most)


@pytest.mark.usefixtures("allow_capture_failures")
def test_a_failed_verify_a_downgrade_and_failed_captures_lead_the_overview(failing_dump,
                                                                          failing_page):
    root = failing_page[1].root
    shown = cards(root)
    headline = root.first("headline")
    assert BAD in headline.classes and headline.words().startswith("Problems")
    assert shown["Verify"].value == "failed" and shown["Verify"].status == BAD
    assert "1 of 2 checks" in shown["Verify"].detail and FAILED_WHERE in shown["Verify"].detail

    runner = runner_data(failing_dump)
    assert runner["requested_graph_mode"] != runner["graph_mode"]  # downgraded: a warning
    assert shown["Graph mode"].status == WARN
    assert f"asked {runner['requested_graph_mode']}" in shown["Graph mode"].detail
    assert f"resolved {runner['graph_mode']}" in shown["Graph mode"].detail
    failed = [row["descriptor"] for row in report(failing_dump, "capture")["table"]
              if row["error"]]
    assert shown["Captured"].status == WARN and f"{len(failed)} failed" in shown["Captured"].detail

    # The verify failure first, then each failed capture; each links to its row below.
    named = root.first("top-warnings").each("a")
    assert FAILED_KEY in named[0].words()
    assert [[key for key in failed if key in a.words()] for a in named[1:]] == [[k] for k in failed]
    rows = failing_page[1].ids
    for link in named:
        row = rows[link.attrs["href"].removeprefix("#")]
        assert row.tag == "tr" and link.words().removesuffix("...") in row.words()
    table = next(t for t in root.each("table") if t.attrs.get("data-stage") == "warning")
    warned = len(table.each("tr")) - 1  # less the header
    assert shown["Warnings"].value == str(warned) and shown["Warnings"].status == WARN
    assert warned >= sum(e["stage"] == "warning" for e in events(failing_dump)) + 1


@pytest.mark.usefixtures("allow_capture_failures")
def test_a_multi_rank_page_has_a_row_per_rank_linking_to_it(passing_dump, failing_dump,
                                                           tmp_path):
    for rank, dump in ((0, passing_dump), (1, failing_dump)):
        shutil.copytree(dump, tmp_path / "ranks" / f"rank_{rank}")
    _, tree = html_page(tmp_path / "ranks", tmp_path / "ranks.html")
    table = tree.root.first("ranks")
    header = [th.words() for th in table.each("th")]
    rows = table.each("tr")[1:]
    assert len(rows) == 2
    for rank, row in enumerate(rows):
        cells = dict(zip(header, row.each("td")))
        link = cells["Rank"].each("a")[0].attrs["href"].removeprefix("#")
        assert cells["Rank"].words() == f"rank {rank}"
        section = tree.ids[link]
        assert section.tag == "section" and f"rank_{rank}, rank {rank}" in section.words()
        assert cells["Verify"].classes == [(OK, BAD)[rank]]
        assert cells["Verify"].words() == ("passed", "failed")[rank]
        assert cells["Warnings"].words() == cards(section)["Warnings"].value


def test_what_the_dump_says_is_escaped_and_cut_in_the_overview(passing_dump, tmp_path):
    dump = shutil.copytree(passing_dump, tmp_path / "dump")
    recorded = events(dump)
    device = '<img src="x" onerror="alert(1)">'
    message = "<script>alert(2)</script>" + "x" * 5000
    recorded[0]["data"]["device"] = device
    recorded.append({"seq": 999, "time": 9.0, "stage": "warning", "name": "hostile",
                     "compile": None, "file": None, "seconds": None,
                     "data": {"message": message}})
    (dump / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in recorded))
    page, tree = html_page(dump, tmp_path / "page.html")
    assert not [e for e in tree.root.each("img") + tree.root.each("script")]
    assert device in tree.root.first("about").words()
    named = [a.words() for a in tree.root.first("top-warnings").each("a")]
    hostile = next(text for text in named if text.startswith("<script>"))
    assert len(hostile) == MAX_VALUE_CHARS and message.startswith(hostile.removesuffix("..."))


def test_long_tables_are_collapsed_and_the_warnings_never(passing_dump, tmp_path):
    dump = shutil.copytree(passing_dump, tmp_path / "dump")
    extra = [{"seq": 1000 + n, "time": 9.0, "stage": stage, "name": stage, "compile": None,
              "file": None, "seconds": None, "data": {"message": f"warning {n}"}}
             for n in range(COLLAPSED_ROWS) for stage in ("bytecode", "warning")]
    with open(dump / "events.jsonl", "a") as file:
        file.writelines(json.dumps(e) + "\n" for e in extra)
    _, tree = html_page(dump, tmp_path / "page.html")
    collapsed = {t.attrs["data-stage"] for d in tree.root.each("details")
                 for t in d.each("table")}
    for table in tree.root.each("table"):
        stage = table.attrs.get("data-stage")
        rows = len(table.each("tr")) - 1
        assert (stage in collapsed) == (rows > COLLAPSED_ROWS and stage != "warning"), stage
    assert {"timeline"} <= collapsed and "warning" not in collapsed


@pytest.mark.slow
def test_the_cache_card_counts_hits_and_misses_as_the_build_events_do(compile_cache_dir,
                                                                       tmp_path):
    # The shared cache may be cold or warm here: either way the card is the events' count.
    dump = make_dump(tmp_path / "dump", "piecewise", piece_compiler="inductor",
                     cache_dir=compile_cache_dir)
    _, tree = html_page(dump, tmp_path / "page.html")
    card = cards(tree.root)["Compile cache"]
    assert card.value == cache_card(dump) and "hit" in card.value
    assert card.link and tree.ids[card.link.removeprefix("#")].words().startswith("Builds")


# --- the page in a browser ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium() -> str:
    """The browser, looked for before any dump is made for it."""
    return chromium_binary()


@pytest.fixture(scope="module")
def in_chromium(chromium, failing_page, tmp_path_factory) -> tuple[Path, str]:
    """The failing dump's page as Chromium renders it: a screenshot, and the DOM."""
    page = failing_page[0]
    png = screenshot(chromium, page, tmp_path_factory.mktemp("chromium") / "page.png", WIDTH,
                     HEIGHT)
    return png, rendered_dom(chromium, page)


@pytest.mark.usefixtures("allow_capture_failures")
def test_chromium_draws_the_overview_s_colours_at_the_top(in_chromium):
    png, _ = in_chromium
    assert png_size(png) == (WIDTH, HEIGHT)
    top = png_rows(png, TOP_ROWS)[:, :, :3]
    assert len(np.unique(top.reshape(-1, 3), axis=0)) > 100  # text, not a blank band
    for status in (OK, WARN, BAD):  # a passing card, the warnings, the failed verify
        background = STATUS_COLOURS[status][1]
        rgb = [int(background[i:i + 2], 16) for i in (1, 3, 5)]
        assert (top == rgb).all(axis=2).sum() >= COLOURED_PIXELS, status


@pytest.mark.usefixtures("allow_capture_failures")
def test_chromium_s_dom_has_the_overview_before_the_first_table(failing_dump, in_chromium):
    _, dom = in_chromium
    first_table = dom.rindex("<table", 0, dom.index("data-stage="))
    before = Tree(dom[:first_table]).root
    shown = cards(before)
    runner = runner_data(failing_dump)
    assert f"asked {runner['requested_graph_mode']}" in shown["Graph mode"].detail
    assert shown["Graph mode"].value == report(failing_dump, "stats")["graph_mode"]
    assert f"{shown['Compile cache'].value} {shown['Compile cache'].detail}".startswith(
        cache_card(failing_dump))
    assert shown["Verify"].value == "failed"
    assert before.first("headline").words().startswith("Problems")
    assert "top-warnings" in dom[:first_table]
