"""The compile cache across processes: warm starts, damaged artifacts, concurrent writers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def start(cache_dir) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.warm_start_worker", str(cache_dir)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def finish(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def artifacts(cache_dir) -> list[Path]:
    return sorted(p for p in Path(cache_dir).glob("*/*.bin"))


@pytest.mark.slow
def test_cold_concurrent_then_warm_then_damaged(tmp_path):
    # Two processes compile the same model into one empty directory at once: both succeed.
    first, second = start(tmp_path), start(tmp_path)
    cold = [finish(first), finish(second)]
    assert all(run["counters"]["builds"] > 0 for run in cold)
    assert cold[0]["logits"] == pytest.approx(cold[1]["logits"], abs=1e-5)
    saved = artifacts(tmp_path)
    assert saved and not list(Path(tmp_path).glob("*/tmp*")), "temporary files were left behind"

    warm = finish(start(tmp_path))
    assert warm["counters"]["builds"] == 0
    assert warm["counters"]["cache_hits"] == len(saved)
    assert warm["counters"]["cache_corrupt"] == 0
    assert warm["logits"] == pytest.approx(cold[0]["logits"], abs=1e-5)

    # A truncated artifact is detected, discarded and rebuilt; the rest still load.
    victim = saved[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    repaired = finish(start(tmp_path))
    assert repaired["counters"]["cache_corrupt"] == 1
    assert repaired["counters"]["builds"] == 1
    assert repaired["counters"]["cache_hits"] == len(saved) - 1
    assert repaired["logits"] == pytest.approx(cold[0]["logits"], abs=1e-5)
    assert artifacts(tmp_path) == saved
