"""The compile cache: built artifacts on disk, keyed by everything that changes them.

Each artifact is one file, `MAGIC + sha256(payload) + payload`, written to a temporary name,
synced and renamed into place, so a reader (or a start after a crash) sees a whole file or none;
a file whose digest does not match (truncated, damaged, written by another torch) is logged,
deleted and rebuilt, never loaded. The digest finds damage, not tampering: what may be trusted
is decided by owner and permissions (kvgraph/cache_dir.py).
Inductor's own cache (which holds the built CPU kernels that artifacts refer to) lives inside
the same directory while kvgraph compiles, so a warm start reuses those kernels too.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import sympy
import torch
from torch import fx

from kvgraph.cache_dir import CACHE_DIR_SETTINGS, check_cache_dir, check_trusted
from kvgraph.compilation.counters import CompileCounters, compile_counters

logger = logging.getLogger(__name__)

MAGIC = b"KVGRAPH-ARTIFACT-1\n"
DIGEST_SIZE = 32
# Modes of what kvgraph creates in its cache: only its own user can read or write them.
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600


def digest(*parts: object) -> str:
    """A stable sha256 hex digest of the `repr` of each part."""
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(repr(part).encode())
        hasher.update(b"\0")
    return hasher.hexdigest()


def source_files_digest(paths: Iterable[str]) -> str:
    """The digest of the contents of the given source files (missing files count as absent)."""
    hasher = hashlib.sha256()
    for path in sorted(set(paths)):
        try:
            content = Path(path).read_bytes()
        except OSError:
            content = None
        hasher.update(repr((path, None if content is None else hashlib.sha256(content).digest()))
                      .encode())
    return hasher.hexdigest()


def _describe(value: Any, symbols: dict) -> str:
    """A placeholder's type and shape, with symbols named by first appearance."""
    def name(expr: Any) -> str:
        if isinstance(expr, torch.SymInt):
            expr = expr.node.expr
        if isinstance(expr, sympy.Expr):
            return str(expr.xreplace({s: symbols.setdefault(s, sympy.Symbol(f"n{len(symbols)}"))
                                      for s in expr.free_symbols}))
        return str(expr)

    if isinstance(value, torch.Tensor):
        return (f"T({[name(d) for d in value.shape]},{[name(s) for s in value.stride()]},"
                f"{value.dtype},{value.device.type})")
    return f"{type(value).__name__}({name(value)})"


def graph_fingerprint(gm: fx.GraphModule) -> str:
    """A digest of a graph's structure and input types, blind to node and symbol names.

    Two decoder layers give the same fingerprint, so identical pieces compile once.
    """
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    symbols: dict = {}

    def arg(a: Any) -> Any:
        return fx.node.map_arg(a, lambda n: f"%{index[n]}")

    lines = []
    for node in gm.graph.nodes:
        target = node.target
        if callable(target):
            # The qualified name, not __qualname__: boolean-dispatched functions share one of those.
            target = fx.node._get_qualified_name(target)
        if node.op == "placeholder":
            lines.append(f"in {_describe(node.meta.get('example_value', node.meta.get('val')), symbols)}")
        else:
            lines.append(f"{node.op} {target} {arg(node.args)} {arg(node.kwargs)}")
    return digest(*lines)


class CompileCache:
    """Compiled artifacts of one model and config, under `root/<key>`.

    Made by `open`, which refuses (ConfigError) a directory kvgraph may not trust. A cache it
    cannot write (read-only, full, or a file where its directory should be) is a fault, not an
    error: kvgraph warns once and compiles on, loading what it can and saving nothing.
    """

    def __init__(self, root: str | os.PathLike, key: str,
                 counters: CompileCounters | None = None):
        # The compiled model's (damaged artifacts are counted there), else the process's.
        self.counters = counters or compile_counters
        self.root = Path(root)
        self.directory = self.root / key[:24]
        self.inductor_directory = self.root / "inductor"
        self.writable = True

    @classmethod
    def open(cls, root: str | os.PathLike, key: str, counters: CompileCounters | None = None
             ) -> CompileCache | None:
        """The cache for `key` under `root`, its directories made (private) where missing; None,
        with a warning, when there is nothing to load and nowhere to save."""
        check_cache_dir(root)
        cache = cls(Path(root).resolve(), key, counters)
        try:
            cache.root.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
            for directory in (cache.directory, cache.inductor_directory):
                cache._make_dir(directory)
        except OSError as error:
            logger.warning("kvgraph: compiling without the compile cache: %s (%s)", error,
                           CACHE_DIR_SETTINGS)
            return None
        if not _can_write(cache.directory):
            cache.writable = False
            logger.warning("kvgraph: the compile cache %s is read-only: loading what it holds, "
                           "saving nothing", cache.directory)
        return cache

    @staticmethod
    def _make_dir(directory: Path) -> None:
        """Make `directory` (private) if missing and the root allows; refuse an untrusted one."""
        if not os.path.lexists(directory) and _can_write(directory.parent):
            directory.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        if os.path.lexists(directory):
            check_trusted(directory, "compile cache dir")
            if not directory.is_dir():
                raise NotADirectoryError(f"{directory} is not a directory (remove it to use "
                                         "the cache again)")

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.bin"

    @contextlib.contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """Point inductor's cache at ours for the duration (its kernels are part of a warm start);
        inductor keeps its own default where ours cannot be written."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        if not _can_write(self.inductor_directory):
            yield
            return
        with temporary_cache_dir(str(self.inductor_directory)):
            yield

    def load(self, name: str, loader: Callable[[str], Any]) -> Any | None:
        """The artifact saved as `name`, read through `loader(path)`; None if absent or damaged."""
        path = self.path(name)
        try:
            check_trusted(path, "compiled artifact")
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            logger.warning("kvgraph: cannot read compiled artifact %s (%s); building it instead",
                           path, error)
            return None
        payload = blob[len(MAGIC) + DIGEST_SIZE:]
        header_ok = blob.startswith(MAGIC)
        digest_ok = blob[len(MAGIC):len(MAGIC) + DIGEST_SIZE] == hashlib.sha256(payload).digest()
        if not (header_ok and digest_ok):
            return self._discard(path, "its checksum does not match (truncated or damaged)")
        # A private scratch copy outside the cache, which may be read-only.
        with tempfile.TemporaryDirectory(prefix="kvgraph-load-") as scratch:
            scratch_path = os.path.join(scratch, "artifact")
            Path(scratch_path).write_bytes(payload)
            try:
                return loader(scratch_path)
            except Exception as error:  # a stale or foreign artifact: rebuild rather than fail
                return self._discard(path, f"loading it failed: {error!r}")

    def save(self, name: str, saver: Callable[[str], None]) -> None:
        """Write the artifact `saver(path)` produces under `name`, atomically and durably; on a
        write error (full, read-only), warn once and save nothing more."""
        if not self.writable:
            return
        try:
            self._write(name, saver)
        except OSError as error:
            self.writable = False
            logger.warning("kvgraph: cannot write to the compile cache %s (%s): compiling on "
                           "without saving", self.directory, error)

    def _write(self, name: str, saver: Callable[[str], None]) -> None:
        # The scratch dir lies inside the cache dir, so the final rename stays on one file system.
        with tempfile.TemporaryDirectory(dir=self.directory) as scratch:
            scratch_path = os.path.join(scratch, "artifact")
            saver(scratch_path)
            payload = Path(scratch_path).read_bytes()
            staged = os.path.join(scratch, "staged")
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
            with os.fdopen(fd, "wb") as file:
                file.write(MAGIC + hashlib.sha256(payload).digest() + payload)
                file.flush()
                os.fsync(file.fileno())  # the bytes reach the disk before the name does
            os.replace(staged, self.path(name))
        _fsync_dir(self.directory)

    def _discard(self, path: Path, why: str) -> None:
        logger.warning("kvgraph: discarding compiled artifact %s: %s; rebuilding it", path, why)
        self.counters.add("cache_corrupt")
        with contextlib.suppress(OSError):  # gone already, or a read-only cache: rebuilt anyway
            path.unlink()
        return None


def _can_write(directory: Path) -> bool:
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK, effective_ids=True)


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (a crash after it keeps the new name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some file systems cannot sync a directory
            os.fsync(fd)
    finally:
        os.close(fd)
