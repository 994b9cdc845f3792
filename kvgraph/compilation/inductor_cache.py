"""Inductor's cache inside kvgraph's (`<cache>/inductor`): trusted, private, repaired, bypassed.

Inductor's files are code (the wrapper `.py` it imports, the kernel `.so` it loads), so they
follow kvgraph's trust rules (kvgraph/cache_dir.py): the tree is walked (lstat only) when the
cache is opened, and a symbolic link anywhere in it, or an entry another user owns or can write,
is refused with a ConfigError. While kvgraph compiles the process's umask is 077, and what
inductor opens up itself (it chmods each `.so` 0755) is made owner-only afterwards.

Damage: inductor reuses a cached file however damaged, so a truncated `.so` or `.py` fails every
build that needs it, on every start. Two repairs:
- before inductor runs, a `.so` shorter than its ELF header says is removed. This must come
  first: inductor probes the CPU's vector extensions once per process by loading small `.so`
  files it cached, and a damaged probe silently turns vectorisation off for the whole process,
  so every kernel cached with vectorisation then fails to build, even in a fresh dir;
- a load or build that fails here is tried once more (once per compile) in a fresh private
  dir; if it works there, this dir's contents were the fault: they are removed, and the process
  saves nothing more (inductor's in-process state may come from the damaged files), so the next
  start builds into the clean dir.

Full (ENOSPC, EDQUOT, EFBIG): not damage. From the load or build that found it to the end of
the compile, each one runs in its own fresh private dir (`in_fresh_dir`, which says why not in
inductor's default dir), nothing more is saved, and kvgraph warns once.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from kvgraph.cache_dir import can_write, check_tree

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Errors that mean "no room", whatever raised them (inductor, or the compiler's own output).
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# Owner-only: what inductor creates while kvgraph compiles is private from its first byte.
COMPILE_UMASK = 0o077
# Fresh dirs (telling damage from a genuine failure, or compiling beside a full cache): each
# lives for one load or build; swept when a killed process left one.
PROBE_PREFIX = "kvgraph-inductor-"


class InductorCache:
    """Inductor's cache dir for kvgraph's compiles; `stop_saving(why)` is called (to warn once
    and save nothing more) when the dir turns out full or damaged."""

    def __init__(self, directory: Path, stop_saving: Callable[[str], None]):
        self.directory = directory
        self.stop_saving = stop_saving
        self.in_use = False  # inductor compiles here now (inside `active`, until full)
        self.full = False  # found full during this compile: every attempt goes to a fresh dir
        self._may_probe = False

    def check(self) -> None:
        """Refuse (ConfigError) the tree if anything in it may not be trusted."""
        if self.directory.is_dir():
            check_tree(self.directory, "inductor cache entry")

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Point inductor here for the duration (its own dir where this one cannot be written),
        with everything it creates private."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        usable = can_write(self.directory)
        if usable:
            self._remove_truncated_libraries()
        previous_umask = os.umask(COMPILE_UMASK)  # process-wide, so restored below
        try:
            with temporary_cache_dir(str(self.directory)) if usable else contextlib.nullcontext():
                self.in_use = self._may_probe = usable
                yield
        finally:
            self.in_use = self.full = False
            os.umask(previous_umask)
            if usable:
                make_private(self.directory)

    def _remove_truncated_libraries(self) -> None:
        """Remove the cut-off `.so` files before inductor loads any (see the module docstring)."""
        truncated = truncated_libraries(self.directory)
        for path in truncated:
            with contextlib.suppress(OSError):  # gone already: removed all the same
                os.unlink(path)
        if truncated:
            logger.warning("kvgraph: removed %d truncated kernel libraries from inductor's cache "
                           "%s (%s, ...); inductor builds them again", len(truncated),
                           self.directory, truncated[0])

    def run(self, attempt: Callable[[], T]) -> T:
        """`attempt()`, a load or a build; in this dir, a full disk or damaged files are dealt
        with as the module docstring says, and anything else propagates."""
        if self.full:
            return in_fresh_dir(attempt)
        try:
            return attempt()
        except Exception as error:
            if not self.in_use:
                raise
            if is_full(error):
                self._leave_full(error)
                return in_fresh_dir(attempt)
            if not self._may_probe:
                raise
            self._may_probe = False
            works, result = _probe(attempt)
            if not works:
                raise
            self._clear(error)
            return result

    def _leave_full(self, error: BaseException) -> None:
        """Compile in fresh dirs for the rest of this compile: this one has no room."""
        self.in_use, self.full = False, True
        self.stop_saving(f"the compile cache's inductor dir {self.directory} is full "
                         f"({full_disk_line(error)}), so inductor compiles in private temporary "
                         "dirs")

    def _clear(self, error: BaseException) -> None:
        """Remove everything in this dir: `error` showed that something in it is damaged."""
        for entry in os.scandir(self.directory):
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):  # gone already: removed all the same
                    os.unlink(entry.path)
        self.stop_saving(f"inductor's cache {self.directory} held damaged files "
                         f"({describe(error)}), so kvgraph removed them and the next start "
                         "rebuilds them")


def in_fresh_dir(attempt: Callable[[], T]) -> T:
    """`attempt()` with inductor in a new private dir, removed after (what it built is loaded by
    then). Nothing is cached there to disagree with this process's state: inductor probes the
    CPU once per process, so a probe that failed in a full or damaged dir turned vectorisation
    off, and vectorised code cached anywhere would then fail to build."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    with tempfile.TemporaryDirectory(prefix=PROBE_PREFIX) as fresh, temporary_cache_dir(fresh):
        return attempt()


def _probe(attempt: Callable[[], T]) -> tuple[bool, T | None]:
    """(True, `attempt()` in a fresh dir), or (False, None) if it fails there too."""
    try:
        return True, in_fresh_dir(attempt)
    except Exception as error:
        logger.debug("kvgraph: it fails in a fresh inductor dir too: %s", describe(error))
        return False, None


def is_full(error: BaseException) -> bool:
    """Whether `error`, or one it came from, says a disk is full (its errno, or the message a
    compiler or linker printed)."""
    return full_disk_line(error) is not None


def full_disk_line(error: BaseException) -> str | None:
    """The line of `error`, or of one it came from, that says a disk is full, with that error's
    type; None if none does. A compiler's error puts it below its first line."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in FULL_ERRNOS:
            return describe(error)
        reasons = tuple(os.strerror(code) for code in FULL_ERRNOS)
        for line in str(error).splitlines():
            if any(reason in line for reason in reasons):
                return f"{type(error).__name__}: {line.strip()}"
        error = error.__cause__ or error.__context__
    return None


def describe(error: BaseException) -> str:
    """An error's type and first line, for a one-line warning."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def truncated_libraries(directory: Path) -> list[str]:
    """The `.so` files under `directory` that are not whole ELF files (cut off by a crash or a
    full disk)."""
    found = []
    for parent, _, filenames in os.walk(directory):
        for path in (os.path.join(parent, name) for name in filenames if name.endswith(".so")):
            with contextlib.suppress(OSError):  # gone meanwhile, or a link: not a library of ours
                if not _whole_elf(path):
                    found.append(path)
    return found


def _whole_elf(path: str) -> bool:
    """Whether `path` reaches the end of the section table its ELF header points to (linkers
    write that table last, so a cut-off file lacks it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        header = file.read(64)
        size = os.fstat(fd).st_size
    if len(header) < 64 or header[:4] != b"\x7fELF":
        return False
    order = "<" if header[5] == 1 else ">"
    if header[4] == 2:  # 64-bit: e_shoff at 0x28, e_shentsize and e_shnum at 0x3A
        (offset,), (entry, count) = (struct.unpack_from(order + "Q", header, 0x28),
                                     struct.unpack_from(order + "HH", header, 0x3A))
    else:  # 32-bit: e_shoff at 0x20, e_shentsize and e_shnum at 0x2E
        (offset,), (entry, count) = (struct.unpack_from(order + "I", header, 0x20),
                                     struct.unpack_from(order + "HH", header, 0x2E))
    return size >= offset + entry * count


def make_private(directory: Path) -> None:
    """Take group and other access off everything under `directory` (links are left alone)."""
    for parent, dirnames, filenames in os.walk(directory):
        for name in (*dirnames, *filenames):
            path = os.path.join(parent, name)
            with contextlib.suppress(OSError):  # gone meanwhile, or read-only: nothing to do
                mode = os.lstat(path).st_mode
                if not stat.S_ISLNK(mode) and mode & 0o077:
                    os.chmod(path, stat.S_IMODE(mode) & 0o700)
