"""The engine with the shared-storage KV connector (issue 45): a prefix cache on disk that a
restart or another process on the host loads instead of computing.

References: greedy tokens of the same prompts on an engine without a connector (fp32), and the
cache blocks a fresh prefill writes. Damaged, truncated, foreign and vanished files must give
the reference tokens too: their tokens are recomputed, never served from the file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from kvgraph.kv_transfer import chain_hashes
from tests.support.kv_engines import BLOCK_SIZE, GREEDY, PROMPTS, generate, make_kv_engine

ROOT = Path(__file__).resolve().parents[3]
MODES = ["eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]


@pytest.fixture(scope="module", params=["llama", "mla"])
def written(request, tmp_path_factory):
    """(kind, store, reference tokens): the store filled by another process."""
    kind = request.param
    store = tmp_path_factory.mktemp(f"kv-{kind}")
    subprocess.run([sys.executable, "-m", "tests.support.kv_engines", kind, str(store)],
                   cwd=ROOT, check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    reference = make_kv_engine(kind)
    tokens = generate(reference)
    reference.runner.close()
    return kind, store, tokens


@pytest.mark.slow  # starts a process per model
@pytest.mark.parametrize("mode", MODES)
def test_blocks_from_another_process_give_the_same_greedy_tokens(written, mode):
    kind, store, reference = written
    engine = make_kv_engine(kind, mode, store)
    assert generate(engine) == reference
    stats = engine.stats()
    # Every full block but the one holding the last prompt token came from the store.
    expected = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS[:1])
    assert stats["kv_connector_loaded_tokens"] >= expected
    assert stats["runner"]["kv_connector"]["load_failures"] == 0
    assert stats["runner"]["graph_mode"] == mode  # a whole-request connector keeps full graphs
    engine.runner.close()


def run_until_first_token(engine, prompt):
    request = engine.add_request(prompt, GREEDY)
    outputs = []
    while not outputs:
        outputs = engine.step()
    return request, outputs[0]


def prompt_blocks(engine, request, num_blocks):
    """Every layer's rows of `request`'s first blocks, as bytes (a copy, in its block order)."""
    return [t[request.block_ids[:num_blocks]].view(torch.uint8).clone()
            for _, cache in sorted(engine.runner.kv_caches.items()) for t in cache]


@pytest.mark.parametrize("kind", ["llama", "mla"])
def test_loaded_blocks_are_byte_equal_to_what_a_fresh_prefill_writes(kind, tmp_path):
    prompt, full = PROMPTS[0], (len(PROMPTS[0]) - 1) // BLOCK_SIZE
    fresh = make_kv_engine(kind, "piecewise", tmp_path)
    request, first = run_until_first_token(fresh, prompt)
    written = prompt_blocks(fresh, request, full)
    assert first.num_cached_tokens == 0
    fresh.runner.close()

    restarted = make_kv_engine(kind, "piecewise", tmp_path)
    request, first = run_until_first_token(restarted, prompt)
    assert first.num_cached_tokens == full * BLOCK_SIZE
    got = prompt_blocks(restarted, request, full)
    assert len(got) == len(written) and all(torch.equal(g, w) for g, w in zip(got, written))
    restarted.runner.close()


def damage(path: Path, how: str, other: Path) -> None:
    blob = path.read_bytes()
    if how == "flipped":
        path.write_bytes(blob[:-5] + bytes([blob[-5] ^ 0x40]) + blob[-4:])
    elif how == "truncated":
        path.write_bytes(blob[:len(blob) // 2])
    elif how == "foreign":  # another block's whole, valid file under this block's name
        path.write_bytes(other.read_bytes())
    elif how == "vanished":
        path.unlink()


@pytest.mark.parametrize("load_async", [False, True])
@pytest.mark.parametrize("how", ["flipped", "truncated", "foreign", "vanished"])
def test_a_bad_block_file_is_recomputed_not_served(how, load_async, tmp_path, monkeypatch):
    writer = make_kv_engine("llama", "eager", tmp_path)
    reference = generate(writer, PROMPTS[:1])
    store = writer.external.connector.store
    writer.runner.close()
    hashes = chain_hashes(PROMPTS[0], BLOCK_SIZE)
    assert all(store.has(h) for h in hashes)
    bad = 3  # blocks before it load; it and every block after it are computed
    damage(store.path(hashes[bad]), how, store.path(hashes[0]))
    engine = make_kv_engine("llama", "piecewise", tmp_path, load_async=load_async)
    if how == "vanished":  # found when looked up, gone when loaded: a race with an eviction
        monkeypatch.setattr(engine.external.connector.store, "has", lambda block_hash: True)
    request, first = run_until_first_token(engine, PROMPTS[0])
    assert first.num_cached_tokens == bad * BLOCK_SIZE
    while engine.has_unfinished:
        engine.step()
    assert tuple(request.output_token_ids) == reference[0]
    stats = engine.stats()
    assert stats["kv_connector_loaded_tokens"] == bad * BLOCK_SIZE
    assert stats["runner"]["kv_connector"]["load_failures"] >= 1
    engine.runner.close()
    monkeypatch.undo()

    # The recomputed blocks were saved in place of the bad file: a restart loads them all.
    again = make_kv_engine("llama", "piecewise", tmp_path)
    assert generate(again, PROMPTS[:1]) == reference
    assert again.stats()["runner"]["kv_connector"]["load_failures"] == 0
    assert again.stats()["kv_connector_loaded_tokens"] == len(hashes) * BLOCK_SIZE
    again.runner.close()


def test_an_asynchronous_load_does_not_stall_the_other_requests(tmp_path, monkeypatch):
    writer = make_kv_engine("llama", "eager", tmp_path)
    reference = generate(writer)
    writer.runner.close()
    engine = make_kv_engine("llama", "piecewise", tmp_path, load_async=True)
    loader = engine.runner.kv_connector.connector
    release = threading.Event()
    real_load = loader.store.load

    def slow_load(*args):
        assert release.wait(60)
        return real_load(*args)
    monkeypatch.setattr(loader.store, "load", slow_load)

    cold = engine.add_request([9] * 10, GREEDY)  # in no store: computed, never parked
    waiting = engine.add_request(PROMPTS[1], GREEDY)
    for _ in range(4):
        engine.step()
    assert engine.stats()["kv_connector_waiting_for_load"] == 1
    assert waiting.num_computed_tokens == 0 and len(cold.output_token_ids) >= 3
    release.set()
    while engine.has_unfinished:
        engine.step()
    assert tuple(waiting.output_token_ids) == reference[1]
    assert engine.stats()["kv_connector_loaded_tokens"] > 0
    engine.runner.close()


def test_blocks_of_a_request_aborted_while_loading_are_freed_only_after_the_load(tmp_path,
                                                                                  monkeypatch):
    generate(make_kv_engine("llama", "eager", tmp_path), PROMPTS[:1])
    engine = make_kv_engine("llama", "eager", tmp_path, load_async=True)
    loader = engine.runner.kv_connector.connector
    release, real_load = threading.Event(), loader.store.load
    monkeypatch.setattr(loader.store, "load", lambda *a: (release.wait(60), real_load(*a)))
    free_before = engine.allocator.num_free
    request = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()
    held = list(request.block_ids)
    assert held and engine.abort(request.request_id)
    for _ in range(3):  # the loader still writes those blocks: no one may get them
        engine.step()
        assert engine.allocator.num_free == free_before - len(held)
    release.set()
    while engine.has_unfinished:
        engine.step()
    assert engine.allocator.num_free == free_before
    engine.runner.close()


def test_blocks_stay_held_until_the_connector_reports_them_sent(tmp_path, monkeypatch):
    engine = make_kv_engine("llama", "eager", tmp_path)
    sender = engine.runner.kv_connector.connector
    scheduler_side = engine.external.connector
    finish = scheduler_side.request_finished
    # A connector still sending a finished request's blocks: they stay held until it reports.
    monkeypatch.setattr(scheduler_side, "request_finished",
                        lambda request, block_ids: (finish(request, block_ids), (True, None))[1])
    reports_while_held = []

    def get_finished(finished_req_ids):  # done sending at the second report after it ended
        if "req-0" in engine.external.held:
            reports_while_held.append(None)
        return ({"req-0"} if len(reports_while_held) == 2 else set()), None
    monkeypatch.setattr(sender, "get_finished", get_finished)
    free_before = engine.allocator.num_free
    request = engine.add_request(PROMPTS[0], GREEDY)
    while not request.finished:
        engine.step()
    held = engine.external.held["req-0"]
    assert engine.allocator.num_free == free_before - len(held) and engine.has_unfinished
    while engine.has_unfinished:  # the empty steps collect the reports: the second frees them
        engine.step()
    assert engine.allocator.num_free == free_before and not engine.external.held
    assert len(reports_while_held) == 2
    engine.runner.close()


def test_blocks_evicted_from_memory_come_back_from_the_store(tmp_path):
    """In one process: the prefix cache gave the prompt's blocks to other requests, so the
    prompt asked again finds them on disk, not in memory."""
    engine = make_kv_engine("llama", "piecewise", tmp_path, num_blocks=24)
    reference = generate(engine, PROMPTS[:1])
    for i in range(4):  # other prompts of 80 tokens take every block back
        engine.generate([[(13 * j + i) % 256 for j in range(80)]], GREEDY)
    assert engine.stats()["prefix_cache_evictions"] > 0
    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    assert generate(engine, PROMPTS[:1]) == reference
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == hits_before  # nothing of it left in memory
    assert stats["kv_connector_loaded_tokens"] == (len(PROMPTS[0]) - 1) // BLOCK_SIZE * BLOCK_SIZE
    engine.runner.close()
