"""BlockStore: KV cache blocks kept as files in a directory, named by their prefix chain hash.

One file per block holds that block's rows of every layer's cache tuple:
`MAGIC + sha256(payload) + payload`, the payload a JSON header (the store key, the block's hash,
each tensor's byte count) and the rows' bytes. Files live under `<root>/<store key>/`, where
the key is made of what changes the bytes (the model and its cache dtype, named by the caller's
`model_key`, the block size, the tensor-parallel rank) and each file's header names the layers'
row shapes and dtypes: a store shared by processes of other models or layouts never hands one
of them another's blocks.

The compile cache's trust rules hold here, as keys and values read from a file become a
model's context: only this user's files, with no group or world write bit, reached without a
symbolic link, are read (kvgraph/cache_dir.py). Writes are atomic (a private scratch file
renamed into place), so readers, and writers of the same block in other processes, see a whole
file or none. A file that is damaged, truncated or from another store key is deleted and
reported as a miss: its tokens are computed, never served from it. A write that fails (a full
disk) warns once and serving goes on. Past `max_bytes`, the least recently used files (by
modification time, which a load refreshes) are deleted.

No fsync: a crash may leave a damaged file, which its checksum refuses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from kvgraph.cache_dir import CACHE_DIR_SETTINGS, check_cache_dir, check_trusted
from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.block_hashes import BlockHash
from kvgraph.kv_transfer.compatibility import cache_layout

logger = logging.getLogger(__name__)

MAGIC = b"KVGRAPH-KVBLOCK-1\n"
DIGEST_SIZE = 32
SUFFIX = ".kvblock"
SCRATCH_PREFIX = ".kvgraph-write-"
# Eviction deletes down to this share of max_bytes, so it does not run on every save.
EVICT_TO = 0.9
# No live write takes this long: older scratch files were left by a killed process.
SCRATCH_MAX_AGE_S = 3600


class BlockFileError(Exception):
    """A block file that may not be served: why, in words."""


@dataclass(frozen=True)
class StoreLayout:
    """What a block's bytes depend on besides its tokens, and what the scheduler side knows:
    the model (its weights and cache dtype, named by `model_key`), the block size and the
    tensor-parallel rank. The layers' row shapes are checked in each file's header."""

    model_key: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def key(self) -> str:
        text = json.dumps([MAGIC.decode().strip(), self.model_key, self.block_size,
                           self.tp_rank, self.tp_size])
        return hashlib.sha256(text.encode()).hexdigest()[:32]


class BlockStore:
    """The block files of one store key under `root` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, layout: StoreLayout, max_bytes: int | None):
        try:
            check_cache_dir(root)
        except ConfigError as error:  # an untrusted root is the user's to fix
            raise ConfigError("shared_storage_path", f"shared_storage_path: {error}".replace(
                CACHE_DIR_SETTINGS, "kv_connector_extra_config.shared_storage_path")) from None
        self.root = Path(root)
        self.layout = layout
        self.directory = self.root / layout.key
        self.max_bytes = max_bytes
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self.directory.mkdir(mode=0o700, exist_ok=True)
            check_trusted(self.directory, "KV block store dir")
        except OSError as error:
            raise ConfigError("shared_storage_path", f"shared_storage_path {root}: cannot make "
                              f"the block store there ({error})") from error
        self._bytes = self._scan_bytes()
        self._warned: set[str] = set()
        self.evicted = 0
        self.write_failures = 0

    def path(self, block_hash: BlockHash) -> Path:
        name = block_hash.hex()
        return self.directory / name[:2] / f"{name}{SUFFIX}"

    def has(self, block_hash: BlockHash) -> bool:
        """Whether a file for `block_hash` is there and may be trusted (its content is checked
        when it is loaded). An untrusted one is no hit, and a save replaces it."""
        try:
            info = check_trusted(self.path(block_hash), "KV block file")
        except (OSError, ConfigError):
            return False
        return stat.S_ISREG(info.st_mode)

    def load(self, block_hash: BlockHash, block_id: int, kv_caches: dict[str, KVCache]) -> None:
        """Copy the stored block into `block_id` of every layer's cache; a BlockFileError (the
        file deleted if damaged or foreign) when it may not be served."""
        path = self.path(block_hash)
        try:
            check_trusted(path.parent, "KV block dir")
            check_trusted(path, "KV block file")
            blob = _read(path)
        except FileNotFoundError:
            raise BlockFileError("missing (evicted or never written)") from None
        except ConfigError as error:  # someone else's, writable by others, or a link: left alone
            raise BlockFileError(f"not trusted: {error}") from None
        except OSError as error:
            raise BlockFileError(f"unreadable: {error}") from None
        try:
            tensors = self._decode(blob, block_hash, kv_caches)
        except BlockFileError:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        for dst, src in tensors:
            dst[block_id].copy_(src)
        with contextlib.suppress(OSError):  # recency for eviction; a read-only store keeps order
            os.utime(path)

    def save(self, block_hash: BlockHash, block_id: int, kv_caches: dict[str, KVCache]) -> bool:
        """Write `block_id`'s rows under `block_hash` unless a file is there; whether it wrote.
        A failed write warns (once per kind) and is counted: serving goes on."""
        path = self.path(block_hash)
        if self.has(block_hash):
            return False
        try:
            size = self._write(path, self._encode(block_hash, block_id, kv_caches))
        except OSError as error:
            self.write_failures += 1
            self._warn_once(type(error).__name__, f"kvgraph: cannot save KV blocks to "
                            f"{self.directory} ({error}); serving goes on without saving")
            return False
        self._bytes += size
        if self.max_bytes is not None and self._bytes > self.max_bytes:
            self.evict()
        return True

    def evict(self) -> None:
        """Delete the least recently used files until the store is under EVICT_TO of its size
        limit (other processes' deletions are tolerated)."""
        files = []
        for sub in _entries(self.directory):
            for entry in _entries(sub.path):
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    files.append((info.st_mtime_ns, info.st_size, entry.path))
        total = sum(size for _, size, _ in files)
        target = int((self.max_bytes or 0) * EVICT_TO)
        for _, size, path in sorted(files):
            if total <= target:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                self.evicted += 1
            total -= size
        self._bytes = total

    @property
    def nbytes(self) -> int:
        """The store's size as this process last counted it."""
        return self._bytes

    def _encode(self, block_hash: BlockHash, block_id: int, kv_caches: dict[str, KVCache]
                ) -> bytes:
        rows = [t[block_id].detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
                for _, cache in sorted(kv_caches.items()) for t in cache]
        header = json.dumps({"store_key": self.layout.key, "block_hash": block_hash.hex(),
                             "layers": cache_layout(kv_caches)}).encode()
        payload = struct.pack("<Q", len(header)) + header + b"".join(rows)
        return MAGIC + hashlib.sha256(payload).digest() + payload

    def _decode(self, blob: bytearray, block_hash: BlockHash, kv_caches: dict[str, KVCache]
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        data = memoryview(blob)
        payload = data[len(MAGIC) + DIGEST_SIZE:]
        if bytes(data[:len(MAGIC)]) != MAGIC or \
                bytes(data[len(MAGIC):len(MAGIC) + DIGEST_SIZE]) != hashlib.sha256(payload).digest():
            raise BlockFileError("damaged or truncated: its checksum does not match")
        try:
            (header_len,) = struct.unpack_from("<Q", payload)
            header = json.loads(bytes(payload[8:8 + header_len]))
        except (struct.error, ValueError) as error:  # a whole file, checksummed, yet not ours
            raise BlockFileError(f"foreign: its header cannot be read ({error})") from None
        if not isinstance(header, dict):
            raise BlockFileError("foreign: its header is not an object")
        if header.get("store_key") != self.layout.key or \
                header.get("block_hash") != block_hash.hex():
            raise BlockFileError("foreign: written for another model, layout or block")
        if header.get("layers") != cache_layout(kv_caches):
            raise BlockFileError("foreign: its layers' rows differ from this cache's")
        targets = [t for _, cache in sorted(kv_caches.items()) for t in cache]
        sizes = [t[0].numel() * t.element_size() for t in targets]
        if len(payload) != 8 + header_len + sum(sizes):
            raise BlockFileError(f"foreign: {len(payload)} bytes where the header says "
                                 f"{8 + header_len + sum(sizes)}")
        offset, out = 8 + header_len, []
        for target, size in zip(targets, sizes):
            src = torch.frombuffer(payload[offset:offset + size], dtype=torch.uint8)
            out.append((target, src.view(target.dtype).view(target.shape[1:])))
            offset += size
        return out

    def _write(self, path: Path, blob: bytes) -> int:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        fd, scratch = tempfile.mkstemp(prefix=SCRATCH_PREFIX, dir=path.parent)  # mode 0600
        try:
            with os.fdopen(fd, "wb") as file:
                file.write(blob)
            os.replace(scratch, path)  # atomic: readers see the whole file or none
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(scratch)
            raise
        return len(blob)

    def _scan_bytes(self) -> int:
        """The store's size; scratch files killed writers left (older than an hour) removed."""
        total, now = 0, time.time()
        for sub in _entries(self.directory):
            for entry in _entries(sub.path, scratch=True):
                with contextlib.suppress(OSError):
                    info = entry.stat(follow_symlinks=False)
                    if not entry.name.startswith(SCRATCH_PREFIX):
                        total += info.st_size
                    elif now - info.st_mtime > SCRATCH_MAX_AGE_S:
                        os.unlink(entry.path)
        return total

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message)


def _entries(directory: str | os.PathLike, scratch: bool = False) -> Sequence[os.DirEntry]:
    """`directory`'s entries (none if it is gone or not a directory); scratch files only when
    asked."""
    try:
        return [e for e in os.scandir(directory)
                if scratch or not e.name.startswith(SCRATCH_PREFIX)]
    except OSError:
        return []


def _read(path: Path) -> bytearray:
    """The file's bytes, writable (so tensors may view them without a copy or a warning)."""
    with open(path, "rb") as file:
        blob = bytearray(os.fstat(file.fileno()).st_size)
        blob = blob[:file.readinto(blob)]
    return blob
