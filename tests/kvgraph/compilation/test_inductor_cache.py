"""Inductor's cache inside kvgraph's (`<cache>/inductor`): held to kvgraph's trust rules, private,
repaired when damaged, bypassed when full. Each fault is injected by real means: a symbolic link
to a world-writable dir, truncated files, a small tmpfs (mounting one needs root)."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraph.compilation.cache import CompileCache
from kvgraph.compilation.cache_key import digest

ROOT = Path(__file__).resolve().parents[3]
KEY = digest("inductor-cache-test-key")

pytestmark = pytest.mark.usefixtures("fresh_compile_state")

# One start of a model with one piece and two builds (general, size 4): JSON on its last line.
WORKER = """
import json, logging, sys
import torch
import kvgraph
from kvgraph.compilation.backend import KVGraphBackend
from kvgraph.compilation.counters import compile_counters


class Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class Tiny(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x * 3.0625 + 1.25)


warnings = Warnings()
logging.getLogger("kvgraph").addHandler(warnings)
config = kvgraph.CompilationConfig(graph_mode="none", compile_sizes=(4,), cache_dir=sys.argv[1])
model, general, static = Tiny(), torch.randn(6, 4), torch.randn(4, 4)
kvgraph.mark_token_dims(general)
compiled = torch.compile(model, backend=KVGraphBackend(config))
try:
    for x in (general, static):
        torch.testing.assert_close(compiled(x), model(x))
except Exception as error:
    print(json.dumps({"error": str(getattr(error, "inner_exception", error))}))
else:
    print(json.dumps({"counters": compile_counters.snapshot(), "warnings": warnings.messages}))
"""


def start(cache_dir: Path, umask: int | None = None) -> dict:
    """One start of WORKER on `cache_dir` in a new process (under `umask` if given)."""
    result = subprocess.run(
        [sys.executable, "-c", WORKER, str(cache_dir)], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=600, check=False,
        preexec_fn=None if umask is None else lambda: os.umask(umask),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def compiled_every_build(run: dict, builds: int, hits: int) -> None:
    counters = run["counters"]
    assert (counters["builds"], counters["cache_hits"]) == (builds, hits), run
    assert counters["build_fallbacks"] == 0, run  # no piece runs uncompiled


def artifacts(cache_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in cache_dir.glob("*/*.bin")}


def builds(cache_dir: Path) -> dict[str, Path]:
    """The artifact files by build: "general" and "4"."""
    return {p.stem.rsplit("-", 1)[1]: p for p in cache_dir.glob("*/*.bin")}


def fill(directory: Path) -> None:
    """Take every free byte of the file system `directory` is on."""
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as error:
        assert error.errno == errno.ENOSPC
    finally:
        os.close(fd)


# --- the repairs, with a stand-in for inductor's reuse of cached files (fast) -------------------

GOOD_KERNEL = "def kernel(x):\n    return x + 1\n"


def cached_kernel():
    """As inductor does: the kernel file in its cache dir if it is there, however damaged;
    written whole where it is missing."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    path = Path(cache_dir()) / "kernel.py"
    if not path.exists():
        path.write_text(GOOD_KERNEL)
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    return scope["kernel"]


def test_damaged_files_are_removed_and_the_attempt_repeated_in_a_fresh_dir(tmp_path, caplog):
    cache = CompileCache.open(tmp_path, KEY)
    (cache.inductor_directory / "kernel.py").write_text(GOOD_KERNEL[:14])  # truncated
    with caplog.at_level(logging.WARNING), cache.inductor_dir():
        assert cache.inductor.run(cached_kernel)(1) == 2
    [message] = [r.getMessage() for r in caplog.records]
    assert "damaged" in message and "kernel.py" in message and "without saving" in message
    assert list(cache.inductor_directory.iterdir()) == [] and not cache.writable
    caplog.clear()
    again = CompileCache.open(tmp_path, KEY)  # the next start: the clean dir works
    with caplog.at_level(logging.WARNING), again.inductor_dir():
        assert again.inductor.run(cached_kernel)(2) == 3
    assert caplog.records == [] and again.writable
    assert (again.inductor_directory / "kernel.py").read_text() == GOOD_KERNEL


def test_a_genuine_failure_leaves_the_dir_alone_and_is_probed_once(tmp_path, caplog):
    cache = CompileCache.open(tmp_path, KEY)
    (cache.inductor_directory / "kernel.py").write_text(GOOD_KERNEL)
    calls = []

    def failing():
        calls.append(1)
        raise ValueError("inductor cannot lower this op")

    with caplog.at_level(logging.WARNING), cache.inductor_dir():
        for _ in range(2):
            with pytest.raises(ValueError, match="cannot lower"):
                cache.inductor.run(failing)
    assert len(calls) == 3  # here and in a fresh dir, then only here
    assert caplog.records == [] and cache.writable
    assert (cache.inductor_directory / "kernel.py").read_text() == GOOD_KERNEL


def test_a_full_dir_sends_inductor_to_fresh_private_dirs_with_one_warning(tmpfs, caplog):
    cache = CompileCache.open(tmpfs(64 << 10) / "cache", KEY)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    used = []

    def write_kernel():
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        directory = Path(cache_dir())
        used.append((directory, stat.S_IMODE(directory.stat().st_mode)))
        (directory / "kernel.so").write_bytes(b"k" * (128 << 10))
        return directory

    with caplog.at_level(logging.WARNING), cache.inductor_dir():
        first, second = cache.inductor.run(write_kernel), cache.inductor.run(write_kernel)
    assert used[0] == (cache.inductor_directory, 0o700)  # tried there first, and it was full
    assert [mode for _, mode in used[1:]] == [0o700, 0o700]
    assert len({first, second, cache.inductor_directory}) == 3  # fresh, each time
    assert not first.exists() and not second.exists()  # and removed after
    [message] = [r.getMessage() for r in caplog.records]
    assert "is full" in message and "No space left" in message and "without saving" in message
    assert not cache.writable
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before


def test_a_compiler_that_ran_out_of_room_is_named_by_the_line_that_says_so(tmp_path, caplog):
    """A C++ compile error puts the full disk below its first line (the compiler's output), and
    may come wrapped in another error: the warning quotes the line that says it."""
    cache = CompileCache.open(tmp_path, KEY)
    calls = []

    def compile_kernel():
        calls.append(1)
        if len(calls) == 1:
            try:
                raise RuntimeError("C++ compile error\n\nCommand:\ng++ kernel.cpp -o kernel.so\n\n"
                                   "Output:\n/usr/bin/ld: final link failed: No space left on "
                                   "device\ncollect2: error: ld returned 1 exit status")
            except RuntimeError as compiler:
                raise ValueError("backend compiler failed") from compiler
        return "built"

    with caplog.at_level(logging.WARNING), cache.inductor_dir():
        assert cache.inductor.run(compile_kernel) == "built"
    [message] = [r.getMessage() for r in caplog.records]
    assert ("is full (RuntimeError: /usr/bin/ld: final link failed: No space left on device)"
            in message), message
    assert len(calls) == 2 and not cache.writable


# --- real inductor, real starts (slow) ---------------------------------------------------------


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """A cache one cold start filled, under umask 0 (the most open there is)."""
    cache_dir = tmp_path_factory.mktemp("warm") / "cache"
    run = start(cache_dir, umask=0)
    compiled_every_build(run, builds=2, hits=0)
    assert run["warnings"] == []
    return cache_dir


@pytest.fixture
def warm_copy(warm_cache, tmp_path):
    copy = tmp_path / "cache"
    shutil.copytree(warm_cache, copy, symlinks=True)
    return copy


@pytest.mark.slow
def test_what_inductor_writes_in_the_cache_is_private(warm_cache):
    entries = [warm_cache, *warm_cache.rglob("*")]
    assert len(entries) > 20 and any(p.suffix == ".so" for p in entries)
    opened = {str(p.relative_to(warm_cache)): stat.filemode(p.lstat().st_mode) for p in entries
              if stat.S_IMODE(p.lstat().st_mode) & 0o077 or p.is_symlink()}
    assert opened == {}
    assert {stat.S_IMODE(p.stat().st_mode) for p in entries if p.is_dir()} == {0o700}


@pytest.mark.slow
def test_a_link_inside_the_inductor_dir_is_refused_not_followed(warm_copy, tmp_path):
    # The wrapper modules inductor imports, moved to a world-writable dir with a payload added,
    # their dirs replaced by links to it.
    world = tmp_path / "world-writable"
    world.mkdir()
    world.chmod(0o1777)
    marker = tmp_path / "payload-ran"
    wrappers = list((warm_copy / "inductor").glob("*/*.py"))
    assert wrappers
    for wrapper in wrappers:
        (world / wrapper.name).write_text(f"open({str(marker)!r}, 'w').close()\n"
                                          + wrapper.read_text())
        shutil.rmtree(wrapper.parent)
        wrapper.parent.symlink_to(world)
    run = start(warm_copy)
    assert "kvgraph refuses inductor cache entry" in run["error"]
    assert f"it is a symbolic link (to {world})" in run["error"]
    assert "Remove the link" in run["error"]
    assert not marker.exists()
    assert all(wrapper.parent.is_symlink() for wrapper in wrappers)  # left for the user to see


@pytest.mark.slow
def test_damaged_kernels_are_repaired_and_every_piece_compiled(warm_copy):
    general, static = builds(warm_copy)["general"], builds(warm_copy)["4"]
    static.unlink()  # one build loads, the other is built
    damaged = [p for p in (warm_copy / "inductor").rglob("*") if p.suffix in (".so", ".py")]
    assert damaged
    for path in damaged:
        os.truncate(path, path.stat().st_size // 3)
    repaired = start(warm_copy)
    compiled_every_build(repaired, builds=1, hits=1)
    assert any("truncated kernel libraries" in m for m in repaired["warnings"])
    assert any("damaged" in m and ".py" in m for m in repaired["warnings"])
    assert general.exists()  # the artifact was whole: kept
    after = start(warm_copy)
    compiled_every_build(after, builds=1, hits=1)
    assert after["warnings"] == []
    compiled_every_build(start(warm_copy), builds=0, hits=2)


@pytest.mark.slow
def test_a_full_disk_cold_compiles_every_piece_without_the_cache(tmpfs):
    cache_dir = tmpfs(64 << 10) / "cache"
    run = start(cache_dir)
    compiled_every_build(run, builds=2, hits=0)
    [message] = run["warnings"]
    assert "is full" in message and "No space left" in message and "without saving" in message
    assert artifacts(cache_dir) == {}


@pytest.mark.slow
def test_a_full_disk_warm_keeps_its_artifacts_and_builds_the_missing_one(warm_cache, tmpfs):
    cache_dir = tmpfs(8 << 20) / "cache"
    shutil.copytree(warm_cache, cache_dir, symlinks=True)
    builds(cache_dir)["4"].unlink()
    kept = artifacts(cache_dir)
    fill(cache_dir)
    run = start(cache_dir)
    compiled_every_build(run, builds=1, hits=1)
    assert run["counters"]["cache_corrupt"] == 0
    [message] = run["warnings"]
    assert "No space left" in message and "without saving" in message
    assert artifacts(cache_dir) == kept  # the good one neither deleted nor changed
