"""Whether kvgraph may use a compile cache dir, and trust what lies in it.

Loading a compiled artifact runs the code in it. So kvgraph trusts only what this process's user
(its effective uid) owns and no other user can write (no group or world write bit), reached
without following a symbolic link inside the cache dir (the cache dir itself may be a link:
choosing it is the user's own act). Anything else is refused with a `ConfigError` saying why and
how to fix it. The same holds for every entry of a tree whose files are code too (inductor's
cache inside kvgraph's: `check_tree`), and for every directory on the way from the cache dir to
a file that is code (`check_path`).
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from kvgraph.errors import ConfigError

# How a user chooses the cache dir, for messages that ask for another one.
CACHE_DIR_SETTINGS = "cache_dir, --compile-cache-dir or KVGRAPH_CACHE_DIR"
WHY = "loading a compiled artifact runs its code, so kvgraph loads only what no one else can change"


def _refuse(what: str, path: str | os.PathLike, why: str, fix: str) -> ConfigError:
    return ConfigError("cache_dir", f"kvgraph refuses {what} {path}: {why} ({WHY}). {fix}")


def check_trusted(path: str | os.PathLike, what: str, follow_link: bool = False
                  ) -> os.stat_result:
    """`path`'s stat, unless it is a link (and not `follow_link`), someone else's, or writable
    by others: then a ConfigError."""
    info = os.stat(path) if follow_link else os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(what, path, f"it is a symbolic link (to {os.readlink(path)})",
                      "Remove the link; kvgraph rebuilds what it stood for.")
    if info.st_uid != os.geteuid():
        raise _refuse(what, path, f"it belongs to uid {info.st_uid}, not to this process's user "
                      f"(uid {os.geteuid()})",
                      f"Use a cache dir of your own ({CACHE_DIR_SETTINGS}).")
    writers = [who for who, bit in (("its group", stat.S_IWGRP), ("other users", stat.S_IWOTH))
               if info.st_mode & bit]
    if writers:
        raise _refuse(what, path, f"it is writable by {' and '.join(writers)} "
                      f"(mode {stat.filemode(info.st_mode)})",
                      f"Fix: chmod go-w {path} if it is yours alone, or use a cache dir of your "
                      f"own ({CACHE_DIR_SETTINGS}).")
    return info


def check_tree(directory: str | os.PathLike, what: str) -> None:
    """Refuse, as `check_trusted` does, the first entry under `directory` that may not be
    trusted. Links are refused, never followed; an entry that vanishes meanwhile (another
    process's scratch, renamed into place) is skipped. Costs one lstat per entry."""
    for parent, dirnames, filenames in os.walk(directory):
        for name in (*dirnames, *filenames):
            with contextlib.suppress(FileNotFoundError):
                check_trusted(os.path.join(parent, name), what)


def check_path(root: str | os.PathLike, path: str | os.PathLike, what: str) -> None:
    """Refuse, as `check_trusted` does, the cache dir `root` (a link there is the user's choice,
    followed) or any entry on the way from it down to `path` (`path` included; links refused):
    whoever may write a directory on the way may swap everything below it."""
    check_trusted(root, "cache_dir", follow_link=True)
    current = Path(root)
    for part in Path(path).relative_to(root).parts:
        current = current / part
        check_trusted(current, what)


def can_write(directory: Path) -> bool:
    """Whether this process may create entries in `directory`."""
    return directory.is_dir() and os.access(directory, os.W_OK | os.X_OK, effective_ids=True)


def check_cache_dir(path: str | os.PathLike) -> None:
    """Refuse a cache dir that exists but is not a directory or may not be trusted; a missing
    one is fine (kvgraph makes it, private to its user, on first use)."""
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise ConfigError("cache_dir", f"cache_dir {path} is not a directory: give a directory "
                          f"({CACHE_DIR_SETTINGS}), or move the file away")
    check_trusted(path, "cache_dir", follow_link=True)
