"""Builds the CPU kernels (attention, linears, thread binding) on first use, into the cache dir.

The C++ sources ship with the package (`paged_attention.cpp`, the header it includes,
`small_batch_linear.cpp`, `bf16_linear.cpp` and `thread_affinity.cpp`); torch's extension
machinery (`torch.utils.cpp_extension.load`, which needs a C++ compiler and ninja, as inductor
needs a compiler) builds them once into `<cache dir>/cpu_attention/<key>`, where the key covers
the sources, torch's version, the flags and the processor (the build is `-march=native`). A
second process finds the library there and only loads it. The cache dir is
kvgraph's default one (`KVGRAPH_CACHE_DIR`, else `$XDG_CACHE_HOME/kvgraph`: where compiled pieces
go unless a config names another; a backend is chosen before any config reaches it), and the
same trust rules hold: the library is code, so a tree with a link, or with anything another user
owns or can write, is refused.

Two processes building at once: an exclusive `flock` on `<key>.lock` serialises them (the kernel
drops it when a process dies, so a killed build blocks no one); the holder removes the lock file
torch's own builder leaves behind when killed mid-build, which would otherwise block every later
build forever.
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

from kvgraph.cache_dir import check_tree
from kvgraph.config import default_cache_dir

logger = logging.getLogger(__name__)

# The CPU platform's native kernels: paged attention, the linears kvgraph.small_batch_linear
# (a decode step's rows) and kvgraph.packed_linear (tile-packed bf16 and fp32 weights) route
# through, and the engine's thread binding.
SOURCES = (Path(__file__).with_name("paged_attention.cpp"),
           Path(__file__).with_name("small_batch_linear.cpp"),
           Path(__file__).with_name("bf16_linear.cpp"),
           Path(__file__).with_name("fp32_linear.cpp"),
           Path(__file__).with_name("thread_affinity.cpp"))
HEADERS = (Path(__file__).with_name("attention_tiles.h"),  # included by paged_attention.cpp
           Path(__file__).with_name("tile_matmul.h"))  # by bf16_linear.cpp and fp32_linear.cpp
LIBRARY_NAME = "kvgraph_cpu_attention"
# OpenMP: at::parallel_for runs on torch's threads. On x86, GCC's tuning for recent Intel cores
# keeps loops at 256-bit vectors, half of what AVX-512 offers the tiles' loops.
CFLAGS = ("-O3", "-march=native", "-fopenmp",
          *(("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()))
LDFLAGS = ("-fopenmp",)
# What torch's builder (`FileBaton`) leaves in the build dir while it builds.
TORCH_BUILD_LOCK = "lock"


class KernelBuildError(RuntimeError):
    """The CPU attention kernels could not be built or loaded (no compiler, no ninja, ...)."""


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


def build_and_load(root: Path) -> Path:
    """Build (or find) the library under `root` and load its ops; returns the build dir."""
    from torch.utils import cpp_extension

    put_ninja_on_path()
    directory = root / "cpu_attention" / build_key()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_tree(root / "cpu_attention", "CPU attention kernel cache entry")
    with _exclusive(directory.with_suffix(".lock")):
        # Holding the flock, no live process is building here: a torch lock file is stale.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / TORCH_BUILD_LOCK)
        start = time.perf_counter()
        cpp_extension.load(LIBRARY_NAME, [str(source) for source in SOURCES],
                           extra_cflags=list(CFLAGS),
                           extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                           is_python_module=False)
        logger.info("kvgraph: CPU kernels ready from %s in %.2f s", directory,
                    time.perf_counter() - start)
    return directory


@functools.cache
def load_kernels() -> Path:
    """The kernels' build dir, built and loaded once per process (`torch.ops.kvgraph_cpu.*`).

    Raises KernelBuildError, saying what failed and how to fix it, when they cannot be built.
    """
    root = cache_root()
    try:
        return build_and_load(root)
    except Exception as error:
        raise KernelBuildError(
            f"could not build kvgraph's CPU attention kernels in {root / 'cpu_attention'}: "
            f"{type(error).__name__}: {first_error_line(str(error))}. They need a C++ compiler "
            f"(g++ or clang++) and ninja (pip install ninja); or choose attn_backend="
            f"'torch_native'") from error


def first_error_line(message: str) -> str:
    """The line of a build log that says what failed: the compiler's first error, else the
    last line."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [""])[0 if errors else -1].rstrip(".")
