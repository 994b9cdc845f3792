"""BlockStore (kvgraph/kv_transfer/block_store.py): a saved block comes back byte for byte into
any block id; a file that is damaged, foreign, untrusted or missing is refused without touching
the destination; writes are private and atomic; a full disk only warns; the least recently used
blocks go past the size limit; scratch files of killed writers are cleaned up."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import struct
import time

import pytest
import torch

from kvgraph.errors import ConfigError
from kvgraph.kv_transfer import block_store
from kvgraph.kv_transfer.block_store import (
    MAGIC,
    SCRATCH_MAX_AGE_S,
    SCRATCH_PREFIX,
    BlockFileError,
    BlockStore,
    StoreLayout,
)

LAYOUT = StoreLayout("tiny-llama/fp32", block_size=16)
NUM_BLOCKS = 4
NOBODY = 65534


def standard_caches(dtype=torch.float32, head_size=8, layers=2):
    return {f"model.layers.{i}.attn": tuple(torch.randn(NUM_BLOCKS, 16, 2, head_size).to(dtype)
                                            for _ in ("key", "value")) for i in range(layers)}


def mla_caches(dtype=torch.float32, layers=2):
    return {f"model.layers.{i}.attn": (torch.randn(NUM_BLOCKS, 16, 32).to(dtype),
                                       torch.randn(NUM_BLOCKS, 16, 8).to(dtype))
            for i in range(layers)}


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"prefix-{i}".encode()).digest()


def copy_of(caches):
    return {name: tuple(t.clone() for t in cache) for name, cache in caches.items()}


def assert_same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    # Bytes, not values: NaN != NaN and -0.0 == 0.0 would hide a wrong copy.
    assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_caches_unchanged(caches, before) -> None:
    for name, cache in caches.items():
        for t, t0 in zip(cache, before[name]):
            assert_same_bytes(t, t0)


def store_files(store: BlockStore) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(store.directory) for f in files)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("make_caches", [standard_caches, mla_caches], ids=["kv", "mla"])
def test_saved_block_loads_byte_equal_into_another_block_id(tmp_path, dtype, make_caches):
    """A block saved from block 1 loads, bit for bit, into block 3 of another cache; that
    cache's other blocks keep their bytes."""
    source, destination = make_caches(dtype), make_caches(dtype)
    source["model.layers.0.attn"][0][1, 0, 0] = float("nan")
    source["model.layers.1.attn"][1][1, 0, 0] = -0.0
    before = copy_of(destination)
    store = BlockStore(tmp_path / "kv", LAYOUT, None)
    assert store.save(block_hash(0), 1, source)
    store.load(block_hash(0), 3, destination)
    for name, cache in destination.items():
        for j, t in enumerate(cache):
            assert_same_bytes(t[3], source[name][j][1])
            assert_same_bytes(t[:3], before[name][j][:3])


def checksummed(payload: bytes) -> bytes:
    return MAGIC + hashlib.sha256(payload).digest() + payload


def header_only(text: bytes) -> bytes:
    return checksummed(struct.pack("<Q", len(text)) + text)


DAMAGE = {  # what is done to a saved file -> the word its refusal starts with
    "flipped": (lambda blob, **_: blob[:-1] + bytes([blob[-1] ^ 1]), "damaged"),
    "truncated": (lambda blob, **_: blob[:len(blob) // 2], "damaged"),
    "empty": (lambda blob, **_: b"", "damaged"),
    "bad magic": (lambda blob, **_: b"X" + blob[1:], "damaged"),
    "other model": (lambda blob, other_model, **_: other_model, "foreign"),
    "other head size": (lambda blob, other_rows, **_: other_rows, "foreign"),
    "other block": (lambda blob, other_block, **_: other_block, "foreign"),
    # Checksummed, right header, rows cut short: refused before any row is copied.
    "short rows": (lambda blob, **_: checksummed(blob[len(MAGIC) + 32:-100]), "foreign"),
    "header not JSON": (lambda blob, **_: header_only(b"{{{"), "foreign"),
    "header a list": (lambda blob, **_: header_only(json.dumps([LAYOUT.key]).encode()), "foreign"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_or_foreign_file_is_refused_deleted_and_rewritable(tmp_path, damage):
    """A damaged or foreign file raises BlockFileError, leaves the destination block as it was,
    and is deleted, so the next save writes a good one."""
    caches, destination = standard_caches(), standard_caches()
    store = BlockStore(tmp_path / "kv", LAYOUT, None)
    other_model = BlockStore(tmp_path / "kv", StoreLayout("other-model/fp32", 16), None)
    other_model.save(block_hash(0), 1, caches)
    path = store.path(block_hash(0))
    store.save(block_hash(0), 1, standard_caches(head_size=4))  # same layout, other rows
    other_rows = path.read_bytes()
    path.unlink()
    store.save(block_hash(7), 1, caches)
    assert store.save(block_hash(0), 1, caches)
    change, word = DAMAGE[damage]
    path.write_bytes(change(path.read_bytes(), other_rows=other_rows,
                            other_model=other_model.path(block_hash(0)).read_bytes(),
                            other_block=store.path(block_hash(7)).read_bytes()))
    before = copy_of(destination)
    with pytest.raises(BlockFileError, match=f"^{word}"):
        store.load(block_hash(0), 2, destination)
    assert_caches_unchanged(destination, before)
    assert not path.exists()
    assert store.save(block_hash(0), 1, caches)
    store.load(block_hash(0), 2, destination)
    assert_same_bytes(destination["model.layers.1.attn"][1][2], caches["model.layers.1.attn"][1][1])


def test_missing_file_is_a_miss(tmp_path):
    """A hash never saved (or evicted) raises BlockFileError('missing ...') and writes nothing."""
    destination, store = standard_caches(), BlockStore(tmp_path / "kv", LAYOUT, None)
    before = copy_of(destination)
    with pytest.raises(BlockFileError, match="^missing"):
        store.load(block_hash(0), 0, destination)
    assert_caches_unchanged(destination, before)


def make_symlink(path, tmp_path):
    path.symlink_to(shutil.move(path, tmp_path / "elsewhere.kvblock"))


def give_away(path, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, NOBODY, NOBODY)


UNTRUSTED = {
    "symlink": make_symlink,
    "group-writable file": lambda path, _: path.chmod(0o660),
    "world-writable block dir": lambda path, _: path.parent.chmod(0o707),
    "another user's file": give_away,
}


@pytest.mark.parametrize("untrusted", UNTRUSTED)
def test_untrusted_file_is_refused_unread_and_left_alone(tmp_path, untrusted):
    """A whole, valid block that is a link, writable by others or someone else's is neither
    served nor deleted (it is not this user's to delete)."""
    caches, destination = standard_caches(), standard_caches()
    store = BlockStore(tmp_path / "kv", LAYOUT, None)
    store.save(block_hash(0), 1, caches)
    path = store.path(block_hash(0))
    UNTRUSTED[untrusted](path, tmp_path)
    before = copy_of(destination)
    with pytest.raises(BlockFileError, match="^not trusted"):
        store.load(block_hash(0), 2, destination)
    assert_caches_unchanged(destination, before)
    assert os.path.lexists(path) and path.read_bytes()


@pytest.mark.parametrize("make_root", [lambda root: root.write_text("not a dir"),
                                       lambda root: root.mkdir(mode=0o777) or root.chmod(0o777)],
                         ids=["a file", "world-writable"])
def test_unusable_root_is_a_config_error(tmp_path, make_root):
    """A store root that is a file, or that others may write, is refused on construction."""
    root = tmp_path / "kv"
    make_root(root)
    with pytest.raises(ConfigError, match=str(root)):
        BlockStore(root, LAYOUT, None)


def test_saves_are_private_atomic_and_never_rewritten(tmp_path):
    """After saves no scratch file is left, files are 0600 and dirs 0700, and saving a hash
    that is there returns False without touching the file."""
    caches = standard_caches()
    store = BlockStore(tmp_path / "kv", LAYOUT, None)
    assert all(store.save(block_hash(i), i % NUM_BLOCKS, caches) for i in range(6))
    for directory, dirs, files in os.walk(tmp_path / "kv"):
        assert os.stat(directory).st_mode & 0o777 == 0o700, directory
        assert not [f for f in files if f.startswith(SCRATCH_PREFIX)]
        assert all(os.stat(os.path.join(directory, f)).st_mode & 0o777 == 0o600
                   for f in files)
    assert len(store_files(store)) == 6
    path = store.path(block_hash(0))
    os.utime(path, (1000, 1000))
    was, inode = path.read_bytes(), path.stat().st_ino
    caches["model.layers.0.attn"][0].fill_(7.0)
    assert not store.save(block_hash(0), 0, caches)
    assert (path.read_bytes(), path.stat().st_ino, path.stat().st_mtime) == (was, inode, 1000)


def test_failed_writes_warn_once_and_later_saves_still_try(tmp_path, monkeypatch, caplog):
    """A write that fails (ENOSPC at the rename) returns False, is counted, warns once, leaves
    no scratch file, and the next save tries again."""
    caches = standard_caches()
    store = BlockStore(tmp_path / "kv", LAYOUT, None)
    tries, real_replace = [], os.replace

    def full_disk(src, dst, *args, **kwargs):
        if str(dst).endswith(".kvblock"):
            tries.append(dst)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(block_store.os, "replace", full_disk)
    with caplog.at_level(logging.WARNING, logger="kvgraph.kv_transfer.block_store"):
        assert [store.save(block_hash(i), 0, caches) for i in range(3)] == [False] * 3
    assert len(tries) == 3 and store.write_failures == 3 and store_files(store) == []
    assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
    monkeypatch.setattr(block_store.os, "replace", real_replace)
    assert store.save(block_hash(0), 0, caches) and len(store_files(store)) == 1


def test_a_full_disk_fails_saves_without_leftovers(tmpfs, caplog):
    """On a really full filesystem saves that do not fit return False, the ones that did load
    back, and no partial file is left; freeing space lets saves succeed again."""
    caches = standard_caches(head_size=32)  # about 16 KiB a block: three fit in 64 KiB
    store = BlockStore(tmpfs(64 * 1024) / "kv", LAYOUT, None)
    with caplog.at_level(logging.WARNING, logger="kvgraph.kv_transfer.block_store"):
        saved = [store.save(block_hash(i), i % NUM_BLOCKS, caches) for i in range(6)]
    assert 0 < sum(saved) < 6 and store.write_failures == saved.count(False)
    assert len(caplog.records) == 1
    assert len(store_files(store)) == sum(saved)  # no scratch file, no partial block
    for i in (i for i, ok in enumerate(saved) if ok):
        destination = standard_caches(head_size=32)
        store.load(block_hash(i), 0, destination)
        assert_same_bytes(destination["model.layers.1.attn"][1][0],
                          caches["model.layers.1.attn"][1][i % NUM_BLOCKS])
    store.path(block_hash(saved.index(True))).unlink()
    assert store.save(block_hash(saved.index(False)), 0, caches)


def set_mtime(store: BlockStore, i: int, when: int) -> None:
    os.utime(store.path(block_hash(i)), (when, when))


def test_eviction_keeps_the_store_under_its_limit_least_recently_used_first(tmp_path):
    """Past max_bytes the oldest files go first, a load makes a block recent again, the store
    stays at or under its limit, and `evicted` counts the deleted files."""
    caches = standard_caches()
    probe = BlockStore(tmp_path / "probe", LAYOUT, None)
    probe.save(block_hash(0), 0, caches)
    size = probe.path(block_hash(0)).stat().st_size
    store = BlockStore(tmp_path / "kv", LAYOUT, int(3.5 * size))

    def on_disk():
        return {i for i in range(8) if store.path(block_hash(i)).exists()}

    assert all(store.save(block_hash(i), i, caches) for i in range(3))
    for i, when in enumerate((3000, 1000, 2000)):  # block 1 the least recently used
        set_mtime(store, i, when)
    assert store.save(block_hash(3), 3, caches)
    assert on_disk() == {0, 2, 3} and store.evicted == 1
    for i, when in ((0, 1000), (2, 2000), (3, 3000)):
        set_mtime(store, i, when)
    store.load(block_hash(0), 1, standard_caches())  # block 0, the oldest, is used again
    assert store.save(block_hash(4), 0, caches)
    assert on_disk() == {0, 3, 4} and store.evicted == 2
    total = sum(os.path.getsize(f) for f in store_files(store))
    assert total <= store.max_bytes and store.nbytes == total


def test_old_scratch_files_are_removed_when_a_store_opens(tmp_path):
    """Scratch files older than SCRATCH_MAX_AGE_S (left by killed writers) are deleted on open;
    younger ones (a live write) and block files of any age stay, and only blocks count."""
    store = BlockStore(tmp_path / "kv", LAYOUT, None)
    store.save(block_hash(0), 0, standard_caches())
    block = store.path(block_hash(0))
    old, young = block.parent / f"{SCRATCH_PREFIX}old", block.parent / f"{SCRATCH_PREFIX}young"
    now = time.time()
    for path, age in ((old, SCRATCH_MAX_AGE_S + 60), (young, SCRATCH_MAX_AGE_S - 60),
                      (block, 10 * SCRATCH_MAX_AGE_S)):
        if path != block:
            path.write_bytes(b"x" * 1000)
        os.utime(path, (now - age, now - age))
    reopened = BlockStore(tmp_path / "kv", LAYOUT, None)
    assert not old.exists() and young.exists() and block.exists()
    assert reopened.nbytes == block.stat().st_size
