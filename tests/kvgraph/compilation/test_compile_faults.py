"""Faults kvgraph survives, each injected by real means: a read-only, unwritable or full cache
dir, a process killed while writing or loading an artifact (and the scratch it leaves), and a
piece that inductor fails to build. Inductor's own cache dir: tests/kvgraph/compilation/test_inductor_cache.py."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed

import kvgraph
from kvgraph.compilation.backend import KVGraphBackend
from kvgraph.compilation.cache import (
    LOAD_PREFIX,
    SCRATCH_MAX_AGE_S,
    WRITE_PREFIX,
    CompileCache,
)
from kvgraph.compilation.cache_key import digest
from kvgraph.compilation.counters import compile_counters

ROOT = Path(__file__).resolve().parents[3]
KEY = digest("fault-test-key")
CACHE_LOGGER = "kvgraph.compilation.cache"

pytestmark = pytest.mark.usefixtures("fresh_compile_state")


def write_bytes(payload: bytes):
    return lambda path: Path(path).write_bytes(payload)


def read_bytes(path: str) -> bytes:
    return Path(path).read_bytes()


def entries(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# --- read-only: permissions the process cannot bypass ------------------------------------------


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


CAP_VERSION_3 = 0x20080522
CAP_DAC_OVERRIDE = 1


@contextlib.contextmanager
def without_dac_override():
    """As root, drop (from this thread's effective set) the capability that writes through file
    permissions, so chmod binds; restored on exit. Nothing to do for other users."""
    if os.geteuid() != 0:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    header, data = _CapHeader(CAP_VERSION_3, 0), (_CapData * 2)()
    if libc.capget(ctypes.byref(header), data) != 0:
        pytest.skip("capget failed: cannot run as root without CAP_DAC_OVERRIDE")
    saved = data[0].effective
    data[0].effective &= ~(1 << CAP_DAC_OVERRIDE)
    libc.capset(ctypes.byref(header), data)
    try:
        yield
    finally:
        data[0].effective = saved
        libc.capset(ctypes.byref(header), data)


@contextlib.contextmanager
def read_only(root: Path):
    """`root` and everything in it read-only, for this process (which may be root) too."""
    paths = [root, *root.rglob("*")]
    for path in paths:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        with without_dac_override():
            probe = root / "probe"
            with contextlib.suppress(PermissionError):
                probe.touch()
                probe.unlink()
                pytest.skip("could not make a directory read-only for this process")
            yield
    finally:
        for path in paths:
            path.chmod(0o700 if path.is_dir() else 0o600)


def test_read_only_warm_cache_loads_and_saves_nothing(tmp_path, caplog):
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("good", write_bytes(b"a warm artifact"))
    cache.save("damaged", write_bytes(b"soon damaged"))
    cache.path("damaged").write_bytes(cache.path("damaged").read_bytes()[:-3])
    before = entries(tmp_path)
    with read_only(tmp_path), caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        warm = CompileCache.open(tmp_path, KEY)
        assert warm is not None and not warm.writable
        assert warm.load("good", read_bytes) == b"a warm artifact"
        assert warm.load("damaged", read_bytes) is None  # rebuilt, though it cannot be deleted
        warm.save("new", write_bytes(b"nowhere to go"))
        with warm.inductor_dir():  # inductor keeps its own cache dir: ours is read-only
            from torch._inductor.runtime.cache_dir_utils import cache_dir
            assert not cache_dir().startswith(str(tmp_path))
    messages = warnings_of(caplog)
    assert len([m for m in messages if "read-only" in m]) == 1
    assert len(messages) == 2 and "checksum" in messages[1]
    assert entries(tmp_path) == before


def test_read_only_cold_cache_compiles_uncached(tmp_path, caplog):
    with read_only(tmp_path), caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        cache = CompileCache.open(tmp_path, KEY)
        assert cache is not None and not cache.writable
        assert cache.load("piece", read_bytes) is None
        cache.save("piece", write_bytes(b"x"))
    assert len(warnings_of(caplog)) == 1 and entries(tmp_path) == []


# --- unwritable: a file where a directory is expected ------------------------------------------


def test_cache_dir_under_a_file_compiles_uncached(tmp_path, caplog):
    (tmp_path / "a-file").write_text("x")
    root = tmp_path / "a-file" / "cache"
    kvgraph.CompilationConfig(cache_dir=str(root))  # not there yet: accepted
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        assert CompileCache.open(root, KEY) is None
    [message] = warnings_of(caplog)
    assert "without the compile cache" in message and str(root) in message
    assert "KVGRAPH_CACHE_DIR" in message


def test_artifact_dir_replaced_by_a_file_compiles_uncached(tmp_path, caplog):
    directory = CompileCache.open(tmp_path, KEY).directory
    directory.rmdir()
    directory.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        assert CompileCache.open(tmp_path, KEY) is None
    [message] = warnings_of(caplog)
    assert str(directory) in message and "not a directory" in message and "remove it" in message
    assert directory.read_text() == "not a directory"  # left for the user to look at


# --- full: a file size limit (EFBIG, as ENOSPC would be) ---------------------------------------


@contextlib.contextmanager
def file_size_limit(limit: int):
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_full_cache_warns_once_keeps_what_it_had_and_saves_nothing_more(tmp_path, caplog):
    assert signal.getsignal(signal.SIGXFSZ) == signal.SIG_IGN  # Python's default: EFBIG, no kill
    cache = CompileCache.open(tmp_path, KEY)
    cache.save("piece", write_bytes(b"the old build"))
    limit = 64 << 10
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        with file_size_limit(limit):
            # The payload fits; with kvgraph's header it does not: the failure is in its write.
            cache.save("piece", write_bytes(b"n" * (limit - 8)))
            cache.save("other", write_bytes(b"small"))
    [message] = warnings_of(caplog)
    assert "File too large" in message and "without saving" in message
    assert cache.load("piece", read_bytes) == b"the old build"
    assert cache.load("other", read_bytes) is None
    assert entries(cache.directory) == ["piece.bin"]


# --- killed while writing ----------------------------------------------------------------------

WRITER = """
import sys
from pathlib import Path
from kvgraph.compilation.cache import CompileCache
cache = CompileCache.open(sys.argv[1], sys.argv[2])
payloads = [bytes([i]) * (8 << 20) for i in (1, 2)]
print("ready", flush=True)
i = 0
while True:
    cache.save("piece", lambda path: Path(path).write_bytes(payloads[i % 2]))
    i += 1
"""


def kill_while_writing(root: Path, after_first_save: bool, delay: float) -> None:
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), KEY], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert writer.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while after_first_save and not CompileCache(root, KEY).path("piece").exists():
            assert time.monotonic() < deadline, "the writer never saved"
            time.sleep(0.005)
        time.sleep(delay)
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=60)
    assert writer.returncode == -signal.SIGKILL


@pytest.mark.slow
def test_a_writer_killed_mid_save_leaves_nothing_damaged_to_load(tmp_path):
    payloads = [bytes([i]) * (8 << 20) for i in (1, 2)]
    kill_while_writing(tmp_path, after_first_save=False, delay=0.0)
    assert CompileCache.open(tmp_path, KEY).load("piece", read_bytes) in (None, *payloads)
    for delay in (0.0, 0.013, 0.05, 0.2):
        kill_while_writing(tmp_path, after_first_save=True, delay=delay)
        # A whole artifact was in place before the kill, and stays whole, old or new.
        assert CompileCache.open(tmp_path, KEY).load("piece", read_bytes) in payloads
    assert compile_counters.cache_corrupt == 0
    leftovers = [e for e in entries(CompileCache(tmp_path, KEY).directory) if e != "piece.bin"]
    assert all(e.startswith(WRITE_PREFIX) for e in leftovers), leftovers  # scratch, never loaded


# A process stuck in a save and in a load, each inside a user's saver or loader, until killed.
STUCK = """
import os, sys, threading, time
from pathlib import Path
from kvgraph.compilation.cache import CompileCache

def say(line):  # one write per line: two threads' print()s interleave on a loaded machine
    os.write(1, (line + "\\n").encode())

cache = CompileCache.open(sys.argv[1], sys.argv[2])
cache.save("piece", lambda path: Path(path).write_bytes(b"a good build"))

def stuck_saver(path):
    Path(path).write_bytes(b"half a build" * 40_000)
    say("saving")
    time.sleep(600)

def stuck_loader(path):
    say("loading")
    time.sleep(600)

threading.Thread(target=cache.save, args=("other", stuck_saver), daemon=True).start()
threading.Thread(target=cache.load, args=("piece", stuck_loader), daemon=True).start()
time.sleep(600)
"""
OPEN = "import sys; from kvgraph.compilation.cache import CompileCache; " \
       "CompileCache.open(sys.argv[1], sys.argv[2])"


def run_python(script: str, root: Path, temp_dir: Path) -> subprocess.Popen:
    """`script` in a new process whose system temp dir is `temp_dir`."""
    return subprocess.Popen([sys.executable, "-c", script, str(root), KEY], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(temp_dir)})


def scratch_of(root: Path, temp_dir: Path) -> list[Path]:
    return sorted([*CompileCache(root, KEY).directory.glob(f"{WRITE_PREFIX}*"),
                   *temp_dir.glob(f"{LOAD_PREFIX}*")])


@pytest.mark.slow
def test_scratch_of_a_killed_process_is_removed_on_a_later_start(tmp_path):
    root, temp_dir = tmp_path / "cache", tmp_path / "tmp"
    temp_dir.mkdir()
    stuck = run_python(STUCK, root, temp_dir)
    try:
        assert sorted(stuck.stdout.readline().strip() for _ in range(2)) == ["loading", "saving"]
    finally:
        stuck.kill()
        stuck.wait(timeout=60)
    scratch = scratch_of(root, temp_dir)
    assert [p.name.startswith(WRITE_PREFIX) for p in scratch] == [True, False], scratch
    assert sum(f.stat().st_size for f in scratch[0].rglob("*")) > 400_000
    # Young scratch may be a live process's: the next start keeps it.
    assert run_python(OPEN, root, temp_dir).wait(timeout=120) == 0
    assert scratch_of(root, temp_dir) == scratch
    # Older than any live save or load: the next start removes it, and only it.
    long_ago = time.time() - SCRATCH_MAX_AGE_S - 60
    not_scratch = CompileCache(root, KEY).directory / "notes"  # not kvgraph's to remove
    not_scratch.mkdir()
    for path in (*scratch, not_scratch):
        os.utime(path, (long_ago, long_ago))
    assert run_python(OPEN, root, temp_dir).wait(timeout=120) == 0
    assert scratch_of(root, temp_dir) == [] and not_scratch.is_dir()
    assert CompileCache.open(root, KEY).load("piece", read_bytes) == b"a good build"


# --- inductor fails to build a piece -----------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, x):
        return torch.relu(x * self.scale + 1.25)


def compile_tiny(config: kvgraph.CompilationConfig, scale: float):
    model = Tiny(scale)
    x = torch.randn(6, 4)
    kvgraph.mark_token_dims(x)
    return torch.compile(model, backend=KVGraphBackend(config))(x), model(x)


# A compiler that does not exist: inductor genuinely fails to build any C++ kernel.
NO_COMPILER = {"cpp.cxx": ("/nonexistent/c++",)}


@pytest.mark.slow
@pytest.mark.parametrize("graph_mode, scale", [("piecewise", 3.0625), ("full_decode_only", 5.1875)])
def test_a_piece_inductor_cannot_build_runs_eagerly_with_a_warning(tmp_path, caplog, graph_mode,
                                                                   scale):
    config = kvgraph.CompilationConfig(graph_mode=graph_mode, cache_dir=str(tmp_path))
    with torch._inductor.config.patch(NO_COMPILER), caplog.at_level(logging.WARNING):
        got, want = compile_tiny(config, scale)
    torch.testing.assert_close(got, want)
    messages = [m for m in warnings_of(caplog) if "could not build" in m]
    assert len(messages) == 1, warnings_of(caplog)
    assert "eager" in messages[0] and "on_compile_error='raise'" in messages[0]
    assert "C++ compiler" in messages[0]
    assert compile_counters.builds == 0 and compile_counters.cache_hits == 0
    assert compile_counters.build_fallbacks >= 1
    assert list(tmp_path.glob("*/*.bin")) == []  # nothing to cache


@pytest.mark.slow
def test_on_compile_error_raise_stops_at_the_failure(tmp_path):
    config = kvgraph.CompilationConfig(on_compile_error="raise", cache_dir=str(tmp_path))
    with torch._inductor.config.patch(NO_COMPILER), pytest.raises(BackendCompilerFailed) as info:
        compile_tiny(config, 7.4375)
    assert "No working C++ compiler" in str(info.value.inner_exception)


@pytest.mark.slow
def test_an_unusable_cache_dir_compiles_uncached_with_inductor(tmp_path, caplog):
    (tmp_path / "a-file").write_text("x")
    config = kvgraph.CompilationConfig(cache_dir=str(tmp_path / "a-file" / "cache"))
    with caplog.at_level(logging.WARNING):
        got, want = compile_tiny(config, 9.8125)
    torch.testing.assert_close(got, want)
    assert compile_counters.builds == 1 and compile_counters.cache_hits == 0
    assert len([m for m in warnings_of(caplog) if "without the compile cache" in m]) == 1
    assert entries(tmp_path) == ["a-file"]
