"""The backend says what it builds while it builds: the count it plans, a bar over the builds on
a terminal (with how many came from the compile cache), and a line when the pieces are ready."""

from __future__ import annotations

import io
import logging
import re
import sys

import pytest

from tests.support.scenario import make_runner


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def planned_and_ready(text: str) -> tuple[int, int, int, int]:
    """(distinct pieces, builds) the backend planned, (compiled, loaded) it reported at the end."""
    planned = re.search(r"building (\d+) distinct pieces? with \w+ \((\d+) builds?\)", text)
    ready = re.search(r"pieces ready in [\d.]+ s: (\d+) builds compiled, (\d+) loaded", text)
    assert planned and ready, text
    return (*map(int, planned.groups()), *map(int, ready.groups()))


@pytest.mark.parametrize("mode", ["piecewise", "full"])
def test_eager_pieces_plan_one_build_per_distinct_piece(mode, caplog):
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        runner = make_runner("llama", mode)
        runner.compile()
    distinct, builds, _, loaded = planned_and_ready(caplog.text)
    counters = runner.stats()["compile"]
    assert distinct == builds == counters["unique_pieces"]
    assert loaded == 0


@pytest.mark.slow
def test_inductor_builds_count_the_sizes_and_a_warm_start_says_they_were_loaded(
        tmp_path, caplog, monkeypatch):
    import torch._dynamo

    sizes = (2, 4)
    cold = make_runner("llama", "piecewise", piece_compiler="inductor", compile_sizes=sizes,
                       cache_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        cold.compile()
    distinct, builds, compiled, loaded = planned_and_ready(caplog.text)
    assert builds == distinct * (1 + len(sizes))  # a general build and one per compile size
    assert (compiled, loaded) == (builds, 0)
    assert compiled == cold.stats()["compile"]["builds"]

    cold.close()
    torch._dynamo.reset()
    caplog.clear()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    warm = make_runner("llama", "piecewise", piece_compiler="inductor", compile_sizes=sizes,
                       cache_dir=str(tmp_path))
    with caplog.at_level(logging.INFO, logger="kvgraph"):
        warm.compile()
    assert planned_and_ready(caplog.text) == (distinct, builds, 0, builds)
    assert warm.stats()["compile"]["cache_hits"] == builds
    assert f"{builds} from the compile cache" in terminal.getvalue()
