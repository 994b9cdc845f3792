"""Moving blocks between two processes' caches (issue 46's first transport): runs cut alike on
both sides, bytes equal the sender's, nothing else written, every message received straight
into the cache (no staging buffer); and the fingerprint check that refuses a mismatched pair.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kvgraph.errors import ConfigError
from kvgraph.kv_transfer.block_pair import pair_group, paired_runs
from kvgraph.kv_transfer.compatibility import check_compatible, kv_fingerprint
from tests.support.kv_pair_worker import caches
from tests.support.transfer_engines import require_mooncake, require_nixl
from tests.support.scripts import free_port

ROOT = Path(__file__).resolve().parents[3]


def test_runs_break_where_either_side_stops_being_consecutive():
    assert paired_runs([3, 4, 5, 9], [10, 11, 2, 3]) == [(3, 10, 2), (5, 2, 1), (9, 3, 1)]
    assert paired_runs([0, 1, 2], [5, 6, 7]) == [(0, 5, 3)]
    assert paired_runs([], []) == []
    with pytest.raises(ValueError, match="2 source and 1 destination"):
        paired_runs([1, 2], [3])


def transfer(kind: str, src: list[int], dst: list[int], *die_after: int) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ids = [",".join(map(str, src)), ",".join(map(str, dst)), *map(str, die_after)]
    sides = [subprocess.Popen([sys.executable, "-m", "tests.support.kv_pair_worker", role,
                               str(port), kind, *ids], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for role in ("sender", "receiver")]
    outputs = [side.communicate(timeout=120) for side in sides]
    for side, (_, err) in zip(sides, outputs):
        assert side.returncode == (3 if die_after and side is sides[0] else 0), err[-3000:]
    return json.loads(outputs[1][0])


def test_a_sender_dying_mid_transfer_fails_the_receive_at_once_naming_it():
    # The receiver waits for five runs; the sender sends the first two blocks and dies. The
    # receive must fail (the pair connector then computes the prompt) long before the pair's
    # 60 s timeout, not return as if the blocks were whole.
    result = transfer("standard", [3, 4, 5, 9, 12], [10, 11, 2, 3, 0], 2)
    assert "KV block transfer with the sender failed" in result["error"]
    assert result["seconds"] < 30


@pytest.mark.parametrize("kind", ["standard", "mla"])
def test_blocks_arrive_byte_equal_and_in_place(kind):
    src, dst = [3, 4, 5, 9, 12], [10, 11, 2, 3, 0]
    result = transfer(kind, src, dst)
    assert result["equal"] and result["untouched"] and result["in_place"]
    # Four runs (3-4 -> 10-11, 5 -> 2, 9 -> 3, 12 -> 0), one message per run and tensor.
    assert result["messages"] == len(paired_runs(src, dst)) * 6
    per_block = sum(t[0].numel() * t.element_size() for cache in caches(kind, 0).values()
                    for t in cache)
    assert result["bytes"] == per_block * len(src)


def fingerprint(kind="standard", block_size=16, dtype=torch.float32, **kwargs):
    return kv_fingerprint(caches(kind, 0, dtype), block_size, "llama-small", **kwargs)


@pytest.mark.parametrize("remote, named", [
    (dict(block_size=32), "block_size: 16 here, 32 on decode"),
    (dict(dtype=torch.bfloat16), "layer model.layers.0.attn: [row shape, dtype] per tensor"),
    (dict(kind="mla"), "layer model.layers.0.attn"),
    (dict(tp_size=2), "tp_size: 1 here, 2 on decode"),
])
def test_a_mismatched_pair_is_refused_naming_the_difference(remote, named):
    with pytest.raises(ConfigError, match="refuses to move KV blocks with decode") as error:
        check_compatible(fingerprint(), fingerprint(**remote), "decode")
    assert named in str(error.value)


def test_a_pair_on_a_device_no_backend_serves_is_refused_naming_the_device():
    import datetime

    import torch.distributed as dist

    with pytest.raises(ValueError, match="cpu, cuda or npu devices, not 'xpu'"):
        pair_group("xpu", dist.HashStore(), 0, datetime.timedelta(seconds=1))


def test_a_model_or_layer_count_difference_is_named():
    other = fingerprint()
    other["model_key"] = "llama-8b"
    other["layers"] = other["layers"][:2]
    with pytest.raises(ConfigError) as error:
        check_compatible(fingerprint(), other, "prefill")
    message = str(error.value)
    assert "model_key: 'llama-small' here, 'llama-8b' on prefill" in message
    assert "layers: 3 here, 2 on prefill (only one side has ['model.layers.2.attn'])" in message


def test_a_matching_pair_passes():
    check_compatible(fingerprint(), json.loads(json.dumps(fingerprint())), "decode")


@pytest.mark.parametrize("kind", ["standard", "mla"])
def test_mooncake_reads_each_run_straight_from_one_cache_into_the_other(kind):
    require_mooncake()
    from kvgraph.kv_transfer.mooncake import MooncakeTransport

    sender, receiver = caches(kind, seed=1), caches(kind, seed=2)
    before = {n: tuple(t.clone() for t in cache) for n, cache in receiver.items()}
    prefill, decode = (MooncakeTransport(c, "127.0.0.1") for c in (sender, receiver))
    reads = []
    decode.engine = RecordingEngine(decode.engine, reads)
    src, dst = [3, 4, 5, 9, 12], [10, 11, 2, 3, 0]
    decode.pull(decode.connect(prefill.offer()), src, dst)
    assert_moved(sender, receiver, before, src, dst)
    # One read per run and tensor, each range inside a tensor of the caches: nothing staged.
    (local, remote, lengths), = reads
    assert len(local) == len(paired_runs(src, dst)) * 6
    assert all(within(address, length, receiver) for address, length in zip(local, lengths))
    assert all(within(address, length, sender) for address, length in zip(remote, lengths))
    prefill.close(), decode.close()


class RecordingEngine:
    """Mooncake's engine (its methods cannot be patched), recording each batch read."""

    def __init__(self, engine, reads: list):
        self.engine, self.reads = engine, reads

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def batch_transfer_sync_read(self, session, local, remote, lengths):
        self.reads.append((local, remote, lengths))
        return self.engine.batch_transfer_sync_read(session, local, remote, lengths)


def assert_moved(sender: dict, receiver: dict, before: dict, src: list, dst: list) -> None:
    """The receiver's blocks `dst` hold the sender's `src`; its other blocks are as `before`."""
    for name in sender:
        for got, sent, old in zip(receiver[name], sender[name], before[name]):
            assert torch.equal(got[dst], sent[src])
            untouched = [b for b in range(got.shape[0]) if b not in dst]
            assert torch.equal(got[untouched], old[untouched])


def within(address: int, length: int, kv_caches: dict) -> bool:
    return any(t.data_ptr() <= address and address + length <= t.data_ptr() + t.numel()
               * t.element_size() for cache in kv_caches.values() for t in cache)


def test_an_idle_nixl_transport_takes_no_cpu():
    # NIXL's progress thread, on by default, polled a whole core idle (1.0 s of CPU a second).
    require_nixl()
    from kvgraph.kv_transfer.nixl import NixlTransport

    transport = NixlTransport(caches("standard", seed=1), 30)
    start = time.process_time()
    time.sleep(1.0)
    used = time.process_time() - start
    transport.close()
    assert used < 0.25, f"an idle NIXL agent used {used:.2f} s of CPU in 1 s"


@pytest.mark.parametrize("kind", ["standard", "mla"])
def test_nixl_reads_each_run_into_place(kind):
    require_nixl()
    from kvgraph.kv_transfer.nixl import NixlTransport

    sender, receiver = caches(kind, seed=1), caches(kind, seed=2)
    before = {n: tuple(t.clone() for t in cache) for n, cache in receiver.items()}
    prefill, decode = NixlTransport(sender, 30), NixlTransport(receiver, 30)
    src, dst = [3, 4, 5, 9, 12], [10, 11, 2, 3, 0]
    # P's agent has no progress thread: P progresses it until D says done, as it serves a pull.
    p_end, d_end = socket.socketpair()
    serving = threading.Thread(target=prefill.until_readable, args=(p_end,))
    serving.start()
    decode.pull(decode.connect(prefill.offer()), src, dst)
    d_end.send(b"done")
    serving.join(30)
    assert not serving.is_alive()
    assert_moved(sender, receiver, before, src, dst)
    prefill.close(), decode.close()
