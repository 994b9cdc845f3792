"""The compile cache: built artifacts on disk, keyed by everything that changes them.

Each artifact is one file, `MAGIC + sha256(payload) + payload`, written to a temporary name and
renamed into place, so a reader sees a whole file or none; a file whose digest does not match
(truncated, damaged, written by another torch) is logged, deleted and rebuilt, never loaded.
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

from kvgraph.compilation.counters import compile_counters

logger = logging.getLogger(__name__)

MAGIC = b"KVGRAPH-ARTIFACT-1\n"
DIGEST_SIZE = 32


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
    """Compiled artifacts of one model and config, under `root/<key>`."""

    def __init__(self, root: str | os.PathLike, key: str):
        self.root = Path(root)
        self.directory = self.root / key[:24]
        self.inductor_directory = self.root / "inductor"

    def path(self, name: str) -> Path:
        return self.directory / f"{name}.bin"

    @contextlib.contextmanager
    def inductor_dir(self) -> Iterator[None]:
        """Point inductor's cache at ours for the duration (its kernels are part of a warm start)."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        self.inductor_directory.mkdir(parents=True, exist_ok=True)
        with temporary_cache_dir(str(self.inductor_directory)):
            yield

    def load(self, name: str, loader: Callable[[str], Any]) -> Any | None:
        """The artifact saved as `name`, read through `loader(path)`; None if absent or damaged."""
        path = self.path(name)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        payload = blob[len(MAGIC) + DIGEST_SIZE:]
        header_ok = blob.startswith(MAGIC)
        digest_ok = blob[len(MAGIC):len(MAGIC) + DIGEST_SIZE] == hashlib.sha256(payload).digest()
        if not (header_ok and digest_ok):
            return self._discard(path, "its checksum does not match (truncated or damaged)")
        with tempfile.TemporaryDirectory(dir=self.directory) as scratch:
            scratch_path = os.path.join(scratch, "artifact")
            Path(scratch_path).write_bytes(payload)
            try:
                return loader(scratch_path)
            except Exception as error:  # a stale or foreign artifact: rebuild rather than fail
                return self._discard(path, f"loading it failed: {error!r}")

    def save(self, name: str, saver: Callable[[str], None]) -> None:
        """Write the artifact `saver(path)` produces under `name`, atomically."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.directory) as scratch:
            scratch_path = os.path.join(scratch, "artifact")
            saver(scratch_path)
            payload = Path(scratch_path).read_bytes()
            staged = os.path.join(scratch, "staged")
            Path(staged).write_bytes(MAGIC + hashlib.sha256(payload).digest() + payload)
            os.replace(staged, self.path(name))

    def _discard(self, path: Path, why: str) -> None:
        logger.warning("kvgraph: discarding compiled artifact %s: %s; rebuilding it", path, why)
        compile_counters.cache_corrupt += 1
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return None
