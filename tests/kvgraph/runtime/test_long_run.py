"""A long run: 10,000 graph replays over changing batches keep resident memory flat and the
dispatcher's counts exact (every count recomputed here from the batches alone)."""

import collections
import os
import random

import pytest

import kvgraph
from kvgraph import RequestChunk
from tests.support.scenario import CAPTURE_SIZES, make_runner

STEPS = 10_000
REQUESTS = 8
MAX_LEN = 40  # a request restarts from a short prompt when it reaches this length


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def padded(n: int) -> int:
    return min(size for size in CAPTURE_SIZES if size >= n)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc/self/statm")
def test_ten_thousand_replays_keep_memory_flat_and_counts_exact():
    runner = make_runner("llama", "full_and_piecewise")
    runner.capture()
    rng = random.Random(0)
    lengths = [0] * REQUESTS
    blocks = [list(range(r * 10, r * 10 + 10)) for r in range(REQUESTS)]
    expected = collections.Counter()
    expected_padding, expected_fallbacks, baseline = 0, 0, None
    for step in range(STEPS):
        reqs = rng.sample(range(REQUESTS), rng.randint(1, REQUESTS))
        prefill = rng.random() < 0.1
        chunks = []
        for r in reqs:
            n = rng.randint(1, 3) if prefill or lengths[r] == 0 else 1
            if lengths[r] + n > MAX_LEN:
                lengths[r] = 0  # the request finished; a new one takes its blocks
            chunks.append(RequestChunk([rng.randrange(256) for _ in range(n)], lengths[r],
                                       blocks[r]))
            lengths[r] += n
        tokens = sum(len(c.token_ids) for c in chunks)
        if tokens > max(CAPTURE_SIZES):  # above every graph: runs without one
            size, key = tokens, f"none:{kvgraph.BatchDescriptor(tokens)}"
            expected_fallbacks += 1
        elif tokens == len(chunks):
            size = padded(tokens)
            key = f"full:{kvgraph.BatchDescriptor(size, size, True)}"
        else:
            size = padded(tokens)
            key = f"piecewise:{kvgraph.BatchDescriptor(size)}"
        expected[key] += 1
        expected_padding += size - tokens
        runner.execute(chunks)
        if step == 1_000:  # warmed up: allocator pools and caches have their working size
            baseline = resident_bytes()
    growth = resident_bytes() - baseline
    assert growth < 16 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB"
    stats = runner.stats()
    assert stats["hits"] == dict(expected)
    assert stats["padded_tokens"] == expected_padding
    assert stats["fallbacks"] == expected_fallbacks and stats["uncaptured"] == 0
    assert stats["graphs"]["replays"] >= STEPS - expected_fallbacks
