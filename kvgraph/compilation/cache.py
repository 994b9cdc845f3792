"""The compile cache's storage: built artifacts on disk, under a key of everything that changes
them (the key is made in kvgraph/compilation/cache_key.py).

Each artifact is one file, `MAGIC + sha256(payload) + payload`, written in a scratch dir
(`kvgraph-write-*`), synced and renamed into place, so a reader (or a start after a crash) sees
a whole file or none. Only a content problem discards an artifact: a digest that does not match
(truncated, damaged) or a loader error that is not an OSError (written by another torch); it is
logged, deleted and rebuilt, never loaded. An OSError while loading (a full disk, an I/O error)
says nothing about the file: it is kept, and the piece built instead. The digest finds damage,
not tampering: what may be trusted is decided by owner and permissions (kvgraph/cache_dir.py).
Inductor's own cache (which holds the built CPU kernels that artifacts refer to) lives inside
the same directory while kvgraph compiles, so a warm start reuses those kernels too; it is
trusted, kept private, repaired and bypassed as kvgraph/compilation/inductor_cache.py says.
Scratch that killed processes left (kvgraph's own, older than SCRATCH_MAX_AGE_S) is removed when
a cache is opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from kvgraph.cache_dir import (
    CACHE_DIR_SETTINGS,
    can_write,
    check_cache_dir,
    check_trusted,
)
from kvgraph.compilation.counters import CompileCounters, compile_counters
from kvgraph.compilation.inductor_cache import PROBE_PREFIX, InductorCache

logger = logging.getLogger(__name__)

MAGIC = b"KVGRAPH-ARTIFACT-1\n"
DIGEST_SIZE = 32
# Modes of what kvgraph creates in its cache: only its own user can read or write them.
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# kvgraph's scratch dirs: a save's (inside the artifact dir), a load's (in the system temp dir).
WRITE_PREFIX = "kvgraph-write-"
LOAD_PREFIX = "kvgraph-load-"
# No live save, load or inductor probe takes this long: older scratch was left by a killed process.
SCRATCH_MAX_AGE_S = 3600
FACTORS = "factors.json"  # what a key was made of, beside its artifacts


class CompileCache:
    """Compiled artifacts of one model and config, under `root/<key>`.

    Made by `open`, which refuses (ConfigError) a directory kvgraph may not trust, inductor's
    tree included. A cache it cannot write (read-only, full, or a file where its directory
    should be) is a fault, not an error: kvgraph warns once and compiles on, loading what it can
    and saving nothing.
    """

    def __init__(self, root: str | os.PathLike, key: str,
                 counters: CompileCounters | None = None):
        # The compiled model's (damaged artifacts are counted there), else the process's.
        self.counters = counters or compile_counters
        self.root = Path(root)
        self.directory = self.root / key[:24]
        self.inductor_directory = self.root / "inductor"
        self.inductor = InductorCache(self.inductor_directory, self.stop_saving)
        self.writable = True
        self.last_miss: str | None = None  # why the last `load` found nothing to load
        self.key_change: str | None = None  # why this key is new here (see `record_factors`)

    @classmethod
    def open(cls, root: str | os.PathLike, key: str, counters: CompileCounters | None = None
             ) -> CompileCache | None:
        """The cache for `key` under `root`, its directories made (private) where missing,
        inductor's tree checked and killed processes' scratch removed; None, with a warning,
        when there is nothing to load and nowhere to save."""
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
        cache.inductor.check()
        sweep_scratch(cache.directory, (WRITE_PREFIX,))
        sweep_scratch(Path(tempfile.gettempdir()), (LOAD_PREFIX, PROBE_PREFIX))
        if not can_write(cache.directory):
            cache.writable = False
            logger.warning("kvgraph: the compile cache %s is read-only: loading what it holds, "
                           "saving nothing", cache.directory)
        return cache

    @staticmethod
    def _make_dir(directory: Path) -> None:
        """Make `directory` (private) if missing and the root allows; refuse an untrusted one."""
        if not os.path.lexists(directory) and can_write(directory.parent):
            directory.mkdir(mode=PRIVATE_DIR, exist_ok=True)
        if os.path.lexists(directory):
            check_trusted(directory, "compile cache dir")
            if not directory.is_dir():
                raise NotADirectoryError(f"{directory} is not a directory (remove it to use "
                                         "the cache again)")

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.bin"

    def inductor_dir(self) -> contextlib.AbstractContextManager[None]:
        """Point inductor's cache at ours while kvgraph compiles (its kernels are part of a warm
        start); inductor keeps its own where ours cannot be written."""
        return self.inductor.active()

    def load(self, name: str, loader: Callable[[str], Any]) -> Any | None:
        """The artifact saved as `name`, read through `loader(path)`; None if absent, damaged
        (discarded) or unreadable (kept)."""
        path = self.path(name)
        self.last_miss = None
        try:
            check_trusted(path, "compiled artifact")
            blob = path.read_bytes()
        except FileNotFoundError:
            self.last_miss = ("not built before under this key" + (f" ({self.key_change})"
                                                                   if self.key_change else ""))
            return None
        except OSError as error:
            return self._unreadable(path, error)
        payload = blob[len(MAGIC) + DIGEST_SIZE:]
        header_ok = blob.startswith(MAGIC)
        digest_ok = blob[len(MAGIC):len(MAGIC) + DIGEST_SIZE] == hashlib.sha256(payload).digest()
        if not (header_ok and digest_ok):
            return self._discard(path, "its checksum does not match (truncated or damaged)")
        try:
            return _load_copy(payload, loader)
        except OSError as error:  # full, or an I/O error: nothing wrong with the artifact
            return self._unreadable(path, error)
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
            self.stop_saving(f"cannot write to the compile cache {self.directory} ({error})")

    def stop_saving(self, why: str) -> None:
        """Save nothing more from now on, with one warning (for the first `why`)."""
        if self.writable:
            self.writable = False
            logger.warning("kvgraph: %s: compiling on without saving", why)

    def _write(self, name: str, saver: Callable[[str], None]) -> None:
        # The scratch dir lies inside the cache dir, so the final rename stays on one file system.
        with tempfile.TemporaryDirectory(prefix=WRITE_PREFIX, dir=self.directory) as scratch:
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

    def record_factors(self, factors: dict[str, Any]) -> None:
        """Keep what this key was made of (`factors.json`, for debug dumps) and, for a key new
        here, say in `key_change` how it differs from the key used last in this cache."""
        path = self.directory / FACTORS
        if path.exists():
            return
        self.key_change = _key_change(self.root, factors)
        if self.writable:
            with contextlib.suppress(OSError):  # a dump aid: never worth failing a compile
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE)
                with os.fdopen(fd, "w") as file:
                    json.dump(factors, file, indent=2, default=str)

    def _unreadable(self, path: Path, error: OSError) -> None:
        """Build instead of loading, keeping the file: `error` is the disk's, not its content's."""
        self.last_miss = f"the artifact could not be read ({error})"
        logger.warning("kvgraph: cannot load compiled artifact %s (%s); building it instead, "
                       "the file is kept", path, error)

    def _discard(self, path: Path, why: str) -> None:
        self.last_miss = f"the artifact was discarded: {why}"
        logger.warning("kvgraph: discarding compiled artifact %s: %s; rebuilding it", path, why)
        self.counters.add("cache_corrupt")
        with contextlib.suppress(OSError):  # gone already, or a read-only cache: rebuilt anyway
            path.unlink()
        return None


def _key_change(root: Path, factors: dict[str, Any]) -> str:
    """How `factors` differ from those of the key last written under `root`."""
    known = []
    for path in root.glob(f"*/{FACTORS}"):
        with contextlib.suppress(OSError, ValueError):
            known.append((path.stat().st_mtime, json.loads(path.read_text())))
    if not known:
        return "no earlier key in this cache"
    _, last = max(known, key=lambda item: item[0])
    changed = _changed_fields(last, json.loads(json.dumps(factors, default=str)))
    return "key changed since the last one used here: " + (", ".join(changed) or "?")


def _changed_fields(old: Any, new: Any, prefix: str = "") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        return [change for name in sorted(set(old) | set(new))
                for change in _changed_fields(old.get(name), new.get(name), f"{prefix}{name}.")]
    return [] if old == new else [f"{prefix[:-1]}: {old!r} -> {new!r}"]


def _load_copy(payload: bytes, loader: Callable[[str], Any]) -> Any:
    """`loader` on a private scratch copy of `payload`, outside the cache (it may be read-only)."""
    with tempfile.TemporaryDirectory(prefix=LOAD_PREFIX) as scratch:
        scratch_path = os.path.join(scratch, "artifact")
        Path(scratch_path).write_bytes(payload)
        return loader(scratch_path)


def sweep_scratch(directory: Path, prefixes: tuple[str, ...]) -> None:
    """Remove the scratch dirs in `directory` that killed processes left: named with one of
    `prefixes`, this user's, and untouched for SCRATCH_MAX_AGE_S (a live process's are younger)."""
    try:
        entries = list(os.scandir(directory))
    except OSError:  # gone, or unreadable: nothing of ours to find
        return
    now = time.time()
    for entry in entries:
        if not entry.name.startswith(prefixes):
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or a read-only cache: kept
            info = entry.stat(follow_symlinks=False)
            if (stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
                    and now - info.st_mtime > SCRATCH_MAX_AGE_S):
                shutil.rmtree(entry.path)
                logger.info("kvgraph: removed %s, scratch left by a killed process", entry.path)


def _fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (a crash after it keeps the new name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some file systems cannot sync a directory
            os.fsync(fd)
    finally:
        os.close(fd)
