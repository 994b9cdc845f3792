"""Builds the CPU kernels (attention, linears, thread binding) on first use, into the cache dir,
and loads only a library it built.

The C++ sources ship with the package in `csrc/` (`paged_attention.cpp`, the header it includes,
`small_batch_linear.cpp`, `bf16_linear.cpp` and `thread_affinity.cpp`); torch's extension
builder (which needs a C++ compiler and ninja, as inductor needs a compiler) builds them once
into `<cache dir>/cpu_kernels/<key>`, where the key covers the sources, torch's version, the
flags and the processor (the build is `-march=native`). A second process finds the library
there and only loads it: no compiler or ninja needed. The cache dir is kvgraph's default one
(`KVGRAPH_CACHE_DIR`, else `$XDG_CACHE_HOME/kvgraph`: where compiled pieces go unless a config
names another; a backend is chosen before any config reaches it).

The library is code, so, before anything is loaded:
- Trust (kvgraph/cache_dir.py's rules): the cache dir (which may be a link the user chose),
  `cpu_kernels/`, the build dir and everything in it must be this user's and writable by no
  one else, with no link on the way. Checked before the build lock is taken (its file lies in
  `cpu_kernels/`) and again once it is held: until then the tree may change under us.
- Verification (library_digest.py): a build records the library's size and sha256 next to
  it; a start loads it only if its bytes are those. One without a record, with other bytes,
  empty or truncated (which would crash the loader with SIGBUS) is discarded, logged with why,
  and built again, never dlopen'ed: kvgraph builds with torch's builder and loads the verified
  file itself (torch's `load` would dlopen whatever ninja finds up to date).
Any failure raises `KernelBuildError` with its true cause in one line (which path is not trusted
and why, a full disk, a missing compiler, a library that failed verification and could not be
rebuilt): callers fall back to torch-native code.

Two processes building at once: an exclusive `flock` on `<key>.lock` serialises them (the kernel
drops it when a process dies, so a killed build blocks no one); a build killed midway leaves no
record, so the next start builds again (ninja redoes only the steps that did not finish).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Iterator

import torch

import kvgraph.cpu.library_digest as library_digest
from kvgraph.cache_dir import CACHE_DIR_SETTINGS, check_cache_dir, check_path, check_tree
from kvgraph.config import default_cache_dir
from kvgraph.errors import ConfigError

logger = logging.getLogger(__name__)

# The CPU platform's native kernels: paged attention, the linears kvgraph.cpu.small_batch_linear
# (a decode step's rows) and kvgraph.cpu.packed_linear (tile-packed bf16 and fp32 weights) route
# through, and the engine's thread binding.
CSRC = Path(__file__).with_name("csrc")  # the C++ sources, shipped with the package
SOURCES = (CSRC.joinpath("paged_attention.cpp"),
           CSRC.joinpath("small_batch_linear.cpp"),
           CSRC.joinpath("bf16_linear.cpp"),
           CSRC.joinpath("fp32_linear.cpp"),
           CSRC.joinpath("thread_affinity.cpp"))
HEADERS = (CSRC.joinpath("attention_tiles.h"),  # included by paged_attention.cpp
           CSRC.joinpath("tile_matmul.h"))  # by bf16_linear.cpp and fp32_linear.cpp
LIBRARY_NAME = "kvgraph_cpu_kernels"
# OpenMP: at::parallel_for runs on torch's threads. On x86, GCC's tuning for recent Intel cores
# keeps loops at 256-bit vectors, half of what AVX-512 offers the tiles' loops.
CFLAGS = ("-O3", "-march=native", "-fopenmp",
          *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()))
LDFLAGS = ("-fopenmp",)
PRIVATE_DIR = 0o700
WHAT = "CPU kernel build entry"  # how refusals name what lies under the cache dir
# How a build log, or an OSError, says that the disk is full.
DISK_FULL = ("No space left on device", "Disk quota exceeded")
NINJA_MISSING = "Ninja is required"  # torch's message when it finds no ninja


class KernelBuildError(RuntimeError):
    """The CPU kernels could not be built or loaded; the message says why, in one line."""


class MissingTool(RuntimeError):
    """A C++ compiler or ninja, which a build needs, is not installed."""


class RebuildFailed(RuntimeError):
    """A library failed verification and was discarded, and building it again failed."""


def cache_root() -> Path:
    """kvgraph's cache dir, as `CompilationConfig.cache_dir` defaults to it."""
    return Path(os.environ.get("KVGRAPH_CACHE_DIR", "").strip() or default_cache_dir())


def _processor() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags, where Linux says."""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({line for line in lines
                                 if line.startswith(("model name", "flags", "Features"))}))
    return platform.processor() or platform.machine()


def build_key() -> str:
    """The build dir's name: it changes with anything that changes the library."""
    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in (*SOURCES, *HEADERS)), torch.__version__.encode(),
                 " ".join(CFLAGS).encode(), _processor().encode()):
        digest.update(part)
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released by the kernel if this process dies
        yield
    finally:
        os.close(fd)


def put_ninja_on_path() -> None:
    """Make the `ninja` pip package's binary (a kvgraph dependency) findable: torch's builder
    runs `ninja` from PATH, which lacks the venv's bin dir when the venv is not activated."""
    if shutil.which("ninja") is not None:
        return
    with contextlib.suppress(ImportError):
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _make_dirs(root: Path, directory: Path) -> None:
    """Make what is missing from `root` down to `directory`, private to this user."""
    check_cache_dir(root)  # refused before kvgraph creates anything in it
    root.mkdir(parents=True, exist_ok=True, mode=PRIVATE_DIR)
    path = root
    for part in directory.relative_to(root).parts:
        path = path / part
        if not os.path.lexists(path):  # a link is left for check_path to refuse
            path.mkdir(mode=PRIVATE_DIR, exist_ok=True)


def _check_tools() -> None:
    """Refuse to build without a compiler or ninja, naming the one that is missing (torch's
    builder would go on and fail with a line of ninja's output)."""
    from torch.utils import cpp_extension

    put_ninja_on_path()
    compiler = cpp_extension.get_cxx_compiler()
    if shutil.which(compiler) is None:
        raise MissingTool(f"no C++ compiler: {compiler!r} (CXX, else c++) is not on PATH")
    if shutil.which("ninja") is None:
        raise MissingTool("no ninja: it is not on PATH (pip install ninja)")


def _build(library: Path) -> None:
    """Compile and link `library` with torch's builder (private, what `load` calls: its
    arguments follow the torch versions pyproject.toml allows), load nothing, record it."""
    from torch.utils import cpp_extension

    _check_tools()
    cpp_extension._write_ninja_file_and_build_library(
        name=LIBRARY_NAME, sources=[str(source) for source in SOURCES],
        extra_cflags=list(CFLAGS), extra_cuda_cflags=[], extra_sycl_cflags=[],
        extra_ldflags=list(LDFLAGS), extra_include_paths=[], build_directory=str(library.parent),
        verbose=False, with_cuda=False, with_sycl=False)
    library_digest.record(library)


def _verified_library(directory: Path) -> Path:
    """The library in `directory`, its bytes those its build recorded: built first where it is
    missing, discarded and built again where it fails verification."""
    from torch.utils import cpp_extension

    library = directory / f"{LIBRARY_NAME}{cpp_extension.LIB_EXT}"
    problem = library_digest.problem(library)
    if problem is None:
        return library
    if problem == library_digest.MISSING:
        _build(library)
        return library
    logger.warning("kvgraph: discarding the CPU kernel library %s: it %s; building it again",
                   library, problem)
    library_digest.discard(library)
    try:
        _build(library)
    except Exception as error:
        raise RebuildFailed(f"{library} {problem}, and it could not be rebuilt: "
                            f"{cause(error)}") from error
    return library


def build_and_load(root: Path) -> Path:
    """Build (or find) the library under `root`, verify it and load its ops; returns the build
    dir."""
    directory = root / "cpu_kernels" / build_key()
    _make_dirs(root, directory)
    check_path(root, directory, WHAT)  # before the lock file is opened in cpu_kernels/
    with _exclusive(directory.with_suffix(".lock")):
        # Again with the lock held: another process may have changed the tree while this one
        # waited. From here on no one else can write it, so what is verified is what loads.
        check_path(root, directory, WHAT)
        check_tree(directory, WHAT)
        start = time.perf_counter()
        library = _verified_library(directory)
        torch.ops.load_library(str(library))
        logger.info("kvgraph: CPU kernels ready from %s in %.2f s", directory,
                    time.perf_counter() - start)
    return directory


@functools.cache
def load_kernels() -> Path:
    """The kernels' build dir, built and loaded once per process (`torch.ops.kvgraph_cpu.*`).

    Raises KernelBuildError, saying in one line what failed and how to fix it, when they cannot
    be built, verified or loaded.
    """
    root = cache_root()
    try:
        return build_and_load(root)
    except Exception as error:
        raise KernelBuildError(
            f"kvgraph's CPU kernels could not be built or loaded in {root / 'cpu_kernels'}: "
            f"{cause(error)}") from error


def cause(error: Exception) -> str:
    """Why `error` happened, in one line, with the fix where kvgraph knows it."""
    text = str(error)
    if isinstance(error, (ConfigError, RebuildFailed)):
        return text.rstrip(".")  # says which path, why and what to do
    full = next((line.strip() for line in text.splitlines()
                 if any(words in line for words in DISK_FULL)), None)
    if full is not None:
        return (f"the disk is full ({full}): free space, or choose another cache dir "
                f"({CACHE_DIR_SETTINGS})")
    if isinstance(error, MissingTool) or NINJA_MISSING in text:
        return (f"{first_error_line(text)}. The build needs a C++ compiler (g++ or clang++) and "
                f"ninja (pip install ninja); or choose attn_backend='torch_native'")
    return f"{type(error).__name__}: {first_error_line(text)}"


def first_error_line(message: str) -> str:
    """The line of a build log that says what failed: the compiler's first error, else the
    last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [""])[0 if errors else -1].rstrip(".")
