"""The compile cache across processes: warm starts, damaged artifacts, concurrent writers, a
read-only cache."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PR_CAPBSET_DROP = 24
CAP_DAC_OVERRIDE = 1


def _drop_dac_override() -> None:
    """In a child of root, before exec: drop the capability that writes through permissions."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_DAC_OVERRIDE)")


def start(cache_dir, bound_by_permissions: bool = False) -> subprocess.Popen:
    """A worker process; `bound_by_permissions`: one that chmod binds even when run as root."""
    drop = bound_by_permissions and os.geteuid() == 0
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.warm_start_worker", str(cache_dir)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        preexec_fn=_drop_dac_override if drop else None,
    )


def finish(process: subprocess.Popen, stderr: list | None = None) -> dict:
    out, err = process.communicate(timeout=600)
    assert process.returncode == 0, err[-3000:]
    if stderr is not None:
        stderr.append(err)
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

    # A read-only warm cache, which the worker cannot write: it loads, builds nothing, warns once.
    paths = [Path(tmp_path), *Path(tmp_path).rglob("*")]
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        stderr = []
        read_only = finish(start(tmp_path, bound_by_permissions=True), stderr)
    finally:
        for path in paths:
            path.chmod(0o700 if path.is_dir() else 0o600)
    assert read_only["counters"]["builds"] == 0
    assert read_only["counters"]["cache_hits"] == len(saved)
    assert read_only["logits"] == pytest.approx(cold[0]["logits"], abs=1e-5)
    assert stderr[0].count("is read-only: loading what it holds") == 1, stderr[0][-3000:]
    assert artifacts(tmp_path) == saved
