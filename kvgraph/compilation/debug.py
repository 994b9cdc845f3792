"""Debug dumps: every stage of every compile written as readable files, with one index.

A dump that cannot be written (a read-only or full disk, a path under /proc) is a fault, not an
error: kvgraph warns once and compiles on without it.

    <debug_dump_path>/index.md                     one line per file, in order
    <debug_dump_path>/compile-000/00-dynamo.py     the graph Dynamo traced
    <debug_dump_path>/compile-000/01-pass-noop_elimination.py, ..., split, pieces, summary
"""

from __future__ import annotations

import itertools
import json
import logging
from pathlib import Path
from typing import Any

from torch import fx

logger = logging.getLogger(__name__)


class DebugDump:
    """The dump of one compile, in a fresh numbered directory under `root`."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        for number in itertools.count():
            self.directory = self.root / f"compile-{number:03d}"
            try:
                self.directory.mkdir()  # atomic: concurrent compiles get distinct directories
                break
            except FileExistsError:
                continue
        self.count = 0
        self.failed = False

    @classmethod
    def open(cls, root: str | Path) -> DebugDump | None:
        """The dump of one compile under `root`; None, with a warning, if it cannot be made."""
        try:
            return cls(root)
        except (OSError, ValueError) as error:
            logger.warning("kvgraph: cannot write the debug dump under %s (%s); compiling "
                           "without it", root, error)
            return None

    def text(self, name: str, text: str, suffix: str = ".py") -> Path | None:
        """Write `text` as the next file of this compile and list it in the index; after a write
        error, warn once and write nothing more."""
        if self.failed:
            return None
        path = self.directory / f"{self.count:02d}-{name}{suffix}"
        self.count += 1
        try:
            path.write_text(text)
            with open(self.root / "index.md", "a") as index:
                index.write(f"- [{path.relative_to(self.root)}]({path.relative_to(self.root)})\n")
        except OSError as error:
            self.failed = True
            logger.warning("kvgraph: cannot write the debug dump %s (%s); the rest of this "
                           "compile is not dumped", path, error)
            return None
        return path

    def graph(self, name: str, gm: fx.GraphModule) -> Path | None:
        return self.text(name, gm.print_readable(print_output=False, include_stride=True,
                                                 include_device=True))

    def json(self, name: str, data: Any) -> Path | None:
        return self.text(name, json.dumps(data, indent=2, default=str), suffix=".json")
