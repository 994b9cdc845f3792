"""One block store shared by processes at once: two writers saving (and deleting, and evicting)
the same prefix's blocks and a reader loading them never see a damaged or foreign file, only
whole blocks with the bytes written for their hash, or a miss."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvgraph.kv_transfer.block_store import SCRATCH_PREFIX, BlockFileError, BlockStore, StoreLayout
from tests.support.scripts import REPO, SCRIPT_ENV

pytestmark = pytest.mark.slow

LAYOUT = StoreLayout("tiny-llama/fp32", block_size=16)
LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
HASHES = [hashlib.sha256(f"prompt-block-{i}".encode()).digest() for i in range(20)]
ROUNDS = 100

WORKER = ("import sys; from tests.kvgraph.kv_transfer.test_store_processes import run_worker; "
          "run_worker(*sys.argv[1:])")


def expected_block(block_hash: bytes) -> dict[str, tuple[torch.Tensor, ...]]:
    """The rows every writer saves for `block_hash`: a function of the hash alone, so both
    writers of a hash write the same bytes."""
    generator = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little") >> 1)
    return {name: tuple(torch.randn(16, 2, 8, generator=generator) for _ in ("key", "value"))
            for name in LAYERS}


def empty_caches() -> dict[str, tuple[torch.Tensor, ...]]:
    return {name: (torch.zeros(2, 16, 2, 8), torch.zeros(2, 16, 2, 8)) for name in LAYERS}


def check_load(store: BlockStore, block_hash: bytes, caches, expected, report) -> None:
    """Load `block_hash` into block 1 and count what came: its bytes, a miss, or an error."""
    for cache in caches.values():  # a stale copy must not pass for a load
        for t in cache:
            t[1].fill_(float("nan"))
    try:
        store.load(block_hash, 1, caches)
    except BlockFileError as error:
        if str(error).startswith("missing"):
            report["missing"] += 1
        else:
            report["bad"].append(f"{block_hash.hex()[:8]}: {error}")
        return
    if all(torch.equal(t[1], e) for name in LAYERS for t, e in zip(caches[name], expected[name])):
        report["loaded"] += 1
    else:
        report["bad"].append(f"{block_hash.hex()[:8]}: other bytes than written")


def run_worker(role: str, root: str, max_bytes: str, ready: str, go: str) -> None:
    """A writer deletes a third of the blocks each round, saves every block and loads it back;
    the reader only loads, until both writers are done. Prints what the loads gave, as JSON."""
    torch.set_num_threads(1)
    store = BlockStore(root, LAYOUT, int(max_bytes) or None)
    caches, expected = empty_caches(), {h: expected_block(h) for h in HASHES}
    report = {"loaded": 0, "missing": 0, "saved": 0, "bad": []}
    Path(ready).touch()
    while not os.path.exists(go):  # start together: imports take seconds
        time.sleep(0.01)
    for round_ in itertools.count():
        # The reader reads for as long as the writers write.
        writers_done = len(list(Path(go).parent.glob("ready-*.done"))) == 2
        if round_ >= ROUNDS and (role != "reader" or writers_done):
            break
        for i, block_hash in enumerate(HASHES):
            if role != "reader":
                if (round_ + i) % 3 == 0:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(store.path(block_hash))
                for name in LAYERS:
                    for t, e in zip(caches[name], expected[block_hash][name]):
                        t[0].copy_(e)
                report["saved"] += store.save(block_hash, 0, caches)
            check_load(store, block_hash, caches, expected[block_hash], report)
    Path(f"{ready}.done").touch()
    report["write_failures"] = store.write_failures
    report["bad"] = report["bad"][:20] + [f"... {len(report['bad'])} in all"] * (
        len(report["bad"]) > 20)
    print(json.dumps(report))


def test_concurrent_writers_and_a_reader_see_whole_blocks_or_misses(tmp_path):
    """Two writers of the same blocks (one evicting past a size limit) and a reader at once:
    every load is the written bytes or a miss, and the store is left whole, with no scratch
    files."""
    root = tmp_path / "kv"
    BlockStore(root, LAYOUT, None)  # made once here: the processes all open an existing store
    probe = BlockStore(tmp_path / "probe", LAYOUT, None)
    probe.save(HASHES[0], 0, {n: tuple(t.unsqueeze(0) for t in c)
                              for n, c in expected_block(HASHES[0]).items()})
    block_bytes = probe.path(HASHES[0]).stat().st_size
    roles = [("writer", 0), ("writer", 8 * block_bytes), ("reader", 0)]
    processes = [subprocess.Popen(
        [sys.executable, "-c", WORKER, role, str(root), str(max_bytes),
         str(tmp_path / f"ready-{n}"), str(tmp_path / "go")], cwd=REPO, env=SCRIPT_ENV, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True) for n, (role, max_bytes) in enumerate(roles)]
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{n}").exists() for n in range(len(roles))):
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), \
                [p.communicate()[1][-2000:] for p in processes if p.poll() is not None]
            time.sleep(0.05)
        (tmp_path / "go").touch()
        outputs = [p.communicate(timeout=120) for p in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for process, (out, err) in zip(processes, outputs):
        assert process.returncode == 0, err[-2000:]
    reports = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    for (role, _), report in zip(roles, reports):
        assert report["bad"] == [] and report["write_failures"] == 0, (role, report)
        assert report["loaded"] > ROUNDS, (role, report)  # loads really happened, in every one
    # A third of the blocks deleted each round: both writers rewrote them many times over.
    assert all(report["saved"] > ROUNDS * len(HASHES) // 6 for report in reports[:2]), reports
    store, caches = BlockStore(root, LAYOUT, None), empty_caches()
    after = {"loaded": 0, "missing": 0, "bad": []}
    for block_hash in HASHES:
        check_load(store, block_hash, caches, expected_block(block_hash), after)
    assert after["bad"] == [] and after["loaded"] > 0, after
    assert not [f for _, _, files in os.walk(root) for f in files if f.startswith(SCRATCH_PREFIX)]
