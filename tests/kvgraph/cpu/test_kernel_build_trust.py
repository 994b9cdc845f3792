"""kvgraph loads only a CPU kernel library it built: a library that is truncated, empty, without
a record of its build or with other bytes than the build wrote is discarded and rebuilt, never
dlopen'ed; a cache dir, or any directory on the way to the library, that another user owns or
can write is refused, checked again once the build lock is held. Each failure is a fallback to
torch_native whose one-line reason is the true cause (the path and why, a full disk, a missing
compiler).

Faults are made the real way (files cut short, real permissions, another uid, a second library
with a constructor) in a copy of the library the suite builds once into kvgraph's cache dir;
each start runs in a child process, so a library that crashes the loader fails the test instead
of killing pytest.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
LIBRARY = "kvgraph_cpu_kernels.so"
OTHER_UID = 12345

# One process start: the CPU backend as the platform builds it, then (when it did not fall back)
# one attention call against the dense reference, so "loaded" means "the real kernels work".
START = """
import json, logging, sys
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from kvgraph.attention.backends.cpu_paged import CPUPagedBackend
from tests.support.attention_reference import assert_close, check_caches, random_attention_batch
backend = CPUPagedBackend()
if backend.fallback_reason is None:
    batch = random_attention_batch("mixed", 4, "gqa", dtype=torch.float32)
    q, k, v = batch.inputs
    out = torch.full_like(q, float("nan"))
    backend.forward(q, k, v, list(batch.caches), out, batch.md, batch.scale, None)
    assert_close(out, batch.ref, torch.float32)
    check_caches(batch)
print(json.dumps({"fallback_reason": backend.fallback_reason,
                  "loaded": sorted(torch.ops.loaded_libraries)}))
"""


@pytest.fixture(scope="module")
def built() -> Path:
    """The build dir of the suite's one real build (kvgraph's cache dir): tests copy it."""
    from kvgraph.cpu import build

    try:
        return build.load_kernels()
    except build.KernelBuildError as error:
        pytest.skip(f"the CPU kernels cannot be built here: {error}")


def copy_build(built: Path, root: Path, with_library: bool = True) -> Path:
    """`built` copied to `root`'s build dir; mtimes kept, so ninja finds it up to date. Copied
    under the build lock: other processes may be building there."""
    directory = root / "cpu_kernels" / built.name
    ignore = None if with_library else shutil.ignore_patterns(f"{LIBRARY}*")
    lock = os.open(built.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.copytree(built, directory, symlinks=True, ignore=ignore)
    finally:
        os.close(lock)
    return directory


@pytest.fixture
def cache(tmp_path, built) -> Path:
    """A private cache dir holding a copy of the built library; returns its build dir."""
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    return copy_build(built, root)


class Start:
    """What one process start reported: why it fell back (None: it ran the kernels), the
    libraries it loaded, its log. A start that died (a signal, a traceback) fails the test."""

    def __init__(self, result: subprocess.CompletedProcess):
        self.log = result.stderr
        died = (f"killed by {signal.Signals(-result.returncode).name}"
                if result.returncode < 0 else f"exit status {result.returncode}")
        assert result.returncode == 0, f"the process died at start-up ({died}):\n{self.log}"
        report = json.loads(result.stdout.strip().splitlines()[-1])
        self.fallback_reason: str | None = report["fallback_reason"]
        self.loaded: list[str] = report["loaded"]


def environment(root: Path, **env: str) -> dict[str, str]:
    return {**os.environ, "KVGRAPH_CACHE_DIR": str(root), **env}


def start(root: Path, **env: str) -> Start:
    """A process that starts the CPU backend with `root` as kvgraph's cache dir."""
    return Start(subprocess.run([sys.executable, "-c", START], cwd=REPO,
                                env=environment(root, **env), capture_output=True, text=True,
                                timeout=300))


def keep_stat(path: Path, change) -> None:
    """Run `change(path)`, then give `path` back its mode and mtime."""
    info = path.stat()
    change(path)
    os.chmod(path, stat.S_IMODE(info.st_mode))
    os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))


def truncate_to(size: int):
    def cut(path: Path) -> None:
        with open(path, "r+b") as file:
            file.truncate(size)
    return cut


def planted_library(tmp_path: Path, marker: Path) -> Path:
    """A valid shared library kvgraph did not build; its constructor creates `marker`."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("needs a C compiler")
    source = tmp_path / "planted.c"
    source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void)'
                      f' {{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    library = tmp_path / "planted.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


def forge_manifest(library: Path) -> None:
    """Record `library` as kvgraph records what it built (what a swapper could also do)."""
    try:
        from kvgraph.attention.backends.cpu_paged import library_digest
    except ImportError:  # a kvgraph that records nothing: there is nothing to forge
        return
    library_digest.record(library)


def give_away(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)


def assert_rebuilt(started: Start, library: Path, why: str) -> None:
    """The start discarded `library`, saying why, and ran the kernels it built anew."""
    assert started.fallback_reason is None, started.fallback_reason
    assert started.loaded == [str(library)]
    assert f"{library}" in started.log and why in started.log, started.log  # logged, with why
    from kvgraph.cpu.library_digest import problem

    assert problem(library) is None  # what loaded is what the build recorded


# --- the library is verified before it is loaded ---------------------------------------------


def test_a_truncated_library_is_rebuilt_never_loaded(cache):
    library = cache / LIBRARY
    keep_stat(library, truncate_to(library.stat().st_size // 2))
    assert_rebuilt(start(cache.parent.parent), library, "truncated")


def test_an_empty_library_is_rebuilt_not_blamed_on_the_compiler(cache):
    library = cache / LIBRARY
    keep_stat(library, truncate_to(0))
    assert_rebuilt(start(cache.parent.parent), library, "empty")


def test_a_library_without_a_record_of_its_build_is_rebuilt(cache):
    library = cache / LIBRARY
    for path in cache.iterdir():
        if path.name.startswith(LIBRARY) and path != library:
            path.unlink()
    built_at = library.stat().st_mtime_ns
    assert_rebuilt(start(cache.parent.parent), library, "no record")
    assert library.stat().st_mtime_ns != built_at


def test_a_library_kvgraph_did_not_build_never_runs(cache, tmp_path):
    library = cache / LIBRARY
    marker = tmp_path / "planted-constructor-ran"
    planted = planted_library(tmp_path, marker)
    keep_stat(library, lambda path: shutil.copyfile(planted, path))
    try:
        started = start(cache.parent.parent)
    finally:  # whether or not the start survived it
        assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert_rebuilt(started, library, "not what kvgraph built")


def test_a_library_that_cannot_be_rebuilt_is_a_fallback_saying_both(cache):
    library = cache / LIBRARY
    keep_stat(library, truncate_to(library.stat().st_size // 2))
    started = start(cache.parent.parent, CXX="/nonexistent/c++")
    reason = started.fallback_reason
    assert reason and "\n" not in reason
    assert str(library) in reason and "truncated" in reason and "could not be rebuilt" in reason
    assert "C++ compiler" in reason and "/nonexistent/c++" in reason
    assert started.loaded == [] and not library.exists()  # discarded, not left for the next start


# --- every directory on the way is trusted, checked again under the build lock ----------------


@pytest.mark.parametrize("where, change, why", [
    ("cache dir", lambda path: path.chmod(0o777), "and other users (mode drwxrwxrwx)"),
    ("cache dir", give_away, f"belongs to uid {OTHER_UID}"),
    ("cpu_kernels", give_away, f"belongs to uid {OTHER_UID}"),
    ("cpu_kernels", lambda path: path.chmod(0o775), "writable by its group"),
    ("build dir", give_away, f"belongs to uid {OTHER_UID}"),
    ("library", give_away, f"belongs to uid {OTHER_UID}"),
])
def test_an_untrusted_path_to_the_library_is_refused(cache, where, change, why):
    root = cache.parent.parent
    path = {"cache dir": root, "cpu_kernels": cache.parent, "build dir": cache,
            "library": cache / LIBRARY}[where]
    change(path)
    started = start(root)
    assert started.loaded == [], "a library was loaded from an untrusted dir"
    reason = started.fallback_reason
    assert reason and "\n" not in reason and f"{path}:" in reason and why in reason
    assert "C++ compiler" not in reason
    assert "torch_native" in started.log  # the fallback is logged


def test_a_cache_dir_that_is_a_link_the_user_chose_is_used(cache, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(cache.parent.parent)
    started = start(link)
    assert started.fallback_reason is None, started.fallback_reason
    assert started.loaded == [os.path.realpath(link / "cpu_kernels" / cache.name / LIBRARY)]


def blocked_on_flock(pid: int) -> bool:
    """Whether process `pid` waits for a flock (a `->` line of /proc/locks)."""
    lines = Path("/proc/locks").read_text().splitlines()
    return any("->" in line and " FLOCK " in line and f" {pid} " in line for line in lines)


def test_the_build_dir_is_checked_again_once_the_lock_is_held(cache, tmp_path):
    """While the process waits for the build lock, another user swaps in a build dir of their
    own, whose library (recorded as the build records it) has a constructor."""
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    root = cache.parent.parent
    marker = tmp_path / "planted-constructor-ran"
    planted = planted_library(tmp_path, marker)
    lock = os.open(cache.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        child = subprocess.Popen([sys.executable, "-c", START], cwd=REPO,
                                 env=environment(root), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120
        while not blocked_on_flock(child.pid):
            assert child.poll() is None and time.monotonic() < deadline, \
                f"the process never waited for the build lock: {child.communicate()[1]}"
            time.sleep(0.05)
        swapped = tmp_path / "swapped"
        shutil.copytree(cache, swapped, symlinks=True)
        keep_stat(swapped / LIBRARY, lambda path: shutil.copyfile(planted, path))
        forge_manifest(swapped / LIBRARY)
        for path in (swapped, *swapped.iterdir()):
            give_away(path)
        cache.rename(tmp_path / "real")
        swapped.rename(cache)
    finally:
        os.close(lock)  # releases the flock
    stdout, stderr = child.communicate(timeout=300)
    assert not marker.exists(), "the swapped-in library was loaded: its constructor ran"
    started = Start(subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr))
    assert started.loaded == []
    reason = started.fallback_reason
    assert reason and f"{cache}:" in reason and f"belongs to uid {OTHER_UID}" in reason


# --- the true cause -----------------------------------------------------------------------------


def test_a_full_disk_is_named_as_the_cause(built, tmpfs):
    """The disk fills while the library links: the reason says so, not "no compiler"."""
    page = 4096
    files = [path for path in built.iterdir() if not path.name.startswith(LIBRARY)]
    used = sum(-(-path.stat().st_size // page) * page for path in files)
    root = tmpfs(used + 64 * page)  # room for the objects, not for the library they link into
    copy_build(built, root, with_library=False)
    started = start(root)
    reason = started.fallback_reason
    assert reason and "\n" not in reason and "No space left on device" in reason
    assert "C++ compiler" not in reason and str(root) in reason


def test_a_missing_compiler_is_named_when_it_is_the_cause(built, tmp_path):
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    copy_build(built, root, with_library=False)
    started = start(root, CXX="/nonexistent/c++")
    reason = started.fallback_reason
    assert reason and "\n" not in reason
    assert "no C++ compiler" in reason and "/nonexistent/c++" in reason


def test_a_verified_library_loads_without_a_compiler(cache):
    """Loading what was built needs neither a compiler nor ninja."""
    started = start(cache.parent.parent, CXX="/nonexistent/c++")
    assert started.fallback_reason is None, started.fallback_reason


# --- the record of a build ----------------------------------------------------------------------


def test_the_record_says_what_is_wrong_with_a_library(tmp_path):
    from kvgraph.cpu.library_digest import problem, record

    library = tmp_path / LIBRARY
    assert problem(library) == "is missing"
    library.write_bytes(b"\x7fELF" + bytes(1000))
    assert "no record" in problem(library)
    record(library)
    assert problem(library) is None
    library.write_bytes(b"\x7fELF" + bytes(999) + b"!")
    assert "sha256" in problem(library) and "not what kvgraph built" in problem(library)
    library.write_bytes(b"\x7fELF" + bytes(500))
    assert problem(library) == ("is truncated or is not what kvgraph built (504 of the 1004 bytes "
                                "its build wrote)")
    library.write_bytes(b"")
    assert problem(library) == "is empty (0 bytes; its build wrote 1004)"
    library.write_bytes(b"\x7fELF" + bytes(1000))
    next(path for path in tmp_path.iterdir() if path != library).write_text('{"size": ')
    assert "record" in problem(library) and "unreadable" in problem(library)
