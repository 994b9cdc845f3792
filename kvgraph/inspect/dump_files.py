"""The files a dump names, read only where they are the dump's own: inside its directory once
every symlink is resolved, regular files (no devices, no fifos), and no more of each than a cap.

A dump is untrusted input: an event's `file` may be absolute, climb out with `..`, or be a
symlink to /etc/passwd or /dev/zero; each of those is Refused, never opened.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

MAX_EVENTS_BYTES = 64 * 2**20  # events.jsonl: a large model's real one is a few MiB
MAX_REPORT_BYTES = 16 * 2**20  # capture.json, stats.json, verify.json: a table per descriptor
MAX_CODE_BYTES = 4 * 2**20  # a code file the HTML page shows: past it, cut with a note

# Opening a fifo must not wait for a writer; a file resolved as no symlink must not have become
# one by the time it is opened. (Flags POSIX has and other systems may lack.)
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
               | getattr(os, "O_CLOEXEC", 0))


class Refused(ValueError):
    """A file a dump names that inspect does not read; the message says why, to follow its
    name: "is outside the dump", "is not a regular file"."""


@dataclass(frozen=True)
class Contents:
    """The bytes of a file, at most a cap of them; `cut` when the file holds more."""

    data: bytes
    cut: bool


def inside(directory: Path, name: str) -> Path:
    """`directory / name` with every symlink resolved; Refused when that is not in
    `directory` (`name` absolute, `..` climbing out, a symlink pointing out)."""
    try:
        root = directory.resolve()
        path = (root / name).resolve()
    except (OSError, ValueError, RuntimeError):  # a NUL in the name; a symlink loop
        raise Refused("is not the name of a file") from None
    if not path.is_relative_to(root):
        raise Refused("is outside the dump")
    return path


def check(directory: Path, name: str) -> Path:
    """`inside`, and Refused also when the file is there but not a regular file; a missing
    file passes (whoever shows it says it is missing)."""
    path = inside(directory, name)
    try:
        mode = path.stat().st_mode
    except OSError:
        return path
    if not stat.S_ISREG(mode):  # stat before open: opening a device can do things
        raise Refused("is not a regular file")
    return path


def open_file(directory: Path, name: str) -> BinaryIO:
    """The dump's file `name`, open for reading in binary; Refused, or OSError (missing)."""
    descriptor = os.open(check(directory, name), _OPEN_FLAGS)
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # swapped since `check`
            raise Refused("is not a regular file")
        return os.fdopen(descriptor, "rb")
    except BaseException:
        os.close(descriptor)
        raise


def read(directory: Path, name: str, cap: int) -> Contents:
    """The first `cap` bytes of the dump's file `name` (never more in memory)."""
    with open_file(directory, name) as file:
        data = file.read(cap + 1)
    return Contents(data[:cap], len(data) > cap)
