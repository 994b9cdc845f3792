"""The record of a library kvgraph built: its size and sha256, in a manifest next to it.

Loading a shared library runs its code, and a library cut short crashes the loader (SIGBUS when
a mapped page lies past the end of the file). So the build records what it wrote, right after
a successful build (`record`), and a later start loads the library only when its bytes are
those (`problem` is None); anything else (no record, other bytes, empty, truncated) is
discarded (`discard`) and built again. The manifest is written atomically (a temporary file,
fsync'ed, renamed into place), so a crash leaves the old record or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

MANIFEST_SUFFIX = ".manifest.json"
CHUNK = 1 << 20  # bytes hashed per read
MISSING = "is missing"  # `problem` of a library not built yet


def manifest_path(library: Path) -> Path:
    return library.with_name(library.name + MANIFEST_SUFFIX)


def _digest(library: Path) -> tuple[int, str]:
    """`library`'s size and sha256, read through one descriptor that follows no link."""
    digest = hashlib.sha256()
    fd = os.open(library, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as file:
        while chunk := file.read(CHUNK):
            digest.update(chunk)
        return file.tell(), digest.hexdigest()


def record(library: Path) -> None:
    """Write `library`'s manifest: call it only on what a successful build just wrote."""
    size, sha256 = _digest(library)
    manifest = manifest_path(library)
    scratch = manifest.with_name(f".{manifest.name}.{os.getpid()}")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w") as file:
            json.dump({"library": library.name, "size": size, "sha256": sha256}, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(scratch, manifest)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(scratch)
        raise
    directory = os.open(library.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)  # the rename itself survives a crash
    finally:
        os.close(directory)


def _recorded(library: Path) -> tuple[int, str] | str:
    """The size and sha256 `library`'s manifest records, or why there are none."""
    try:
        entry = json.loads(manifest_path(library).read_text())
        return int(entry["size"]), str(entry["sha256"])
    except FileNotFoundError:
        return "has no record of its build (no manifest): kvgraph does not know it built it"
    except (OSError, ValueError, KeyError, TypeError) as error:
        return f"has a record of its build that is unreadable ({type(error).__name__}: {error})"


def problem(library: Path) -> str | None:
    """None when `library` holds exactly the bytes its build recorded; else what is wrong with
    it, as the end of a sentence that starts with its path."""
    if not os.path.lexists(library):
        return MISSING
    recorded = _recorded(library)
    if isinstance(recorded, str):
        return recorded
    size, sha256 = recorded
    found_size, found_sha256 = _digest(library)
    if found_size == 0:
        return f"is empty (0 bytes; its build wrote {size})"
    if found_size < size:
        return (f"is truncated or is not what kvgraph built ({found_size} of the {size} bytes its "
                "build wrote)")
    if (found_size, found_sha256) != (size, sha256):
        return (f"is not what kvgraph built: {found_size} bytes of sha256 {found_sha256}, its "
                f"build wrote {size} of sha256 {sha256}")
    return None


def discard(library: Path) -> None:
    """Remove `library` and its record, so the next build writes both anew."""
    for path in (library, manifest_path(library)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
