"""The shared-storage KV connector on two tensor-parallel ranks (this process is rank 0): each
rank saves and loads its own shard's files, and their reports are merged on rank 0.

Reference: the greedy tokens of a TP=1 engine with no connector (fp32; TP=2 gives the same).
A second engine must load what the first saved and give them; a block missing on one rank only
must be computed, and the step that computed on it must save nothing (every rank's hidden
states passed through the rank whose load failed).
"""

from __future__ import annotations

import json

import pytest
import torch

from examples.engine import build_engine
from examples.engine.kv_transfer_args import model_key
from examples.engine.preflight import check_start
from examples.generate import MODELS, parse_args
from kvgraph.kv_transfer.block_hashes import chain_hashes
from kvgraph.kv_transfer.block_store import BlockStore, StoreLayout
from tests.support.kv_engines import GREEDY, PROMPTS
from tests.support.tp_engines import EAGER, FLAGS, threads_kept, tp_engine

BLOCK = 4
# PROMPTS[0] and 10 more tokens: its blocks 9-11 are computed after 9 loaded ones.
LONGER = PROMPTS[0] + [(7 * j + 3) % 256 for j in range(10)]


def storage(store) -> list[str]:
    return ["--block-size", str(BLOCK), "--kv-transfer-config", json.dumps(
        {"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
         "kv_connector_extra_config": {"shared_storage_path": str(store)}})]


def generate(engine, prompts) -> list[tuple[int, ...]]:
    """Each prompt alone, in turn."""
    return [engine.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]


def rank_store(store, rank: int) -> BlockStore:
    """The files TP rank `rank` of two keeps under `store`."""
    key = model_key(parse_args([*FLAGS, *EAGER]), MODELS)
    return BlockStore(store, StoreLayout(key, BLOCK, rank, 2), None)


@pytest.fixture(scope="module")
def reference():
    """The greedy tokens of PROMPTS and LONGER with TP=1 and no connector."""
    with threads_kept():
        engine, _ = build_engine(parse_args([*FLAGS, *EAGER, "--block-size", str(BLOCK)]),
                                 MODELS)
    try:
        return generate(engine, [*PROMPTS, LONGER])
    finally:
        engine.runner.close()


def test_the_server_takes_a_connector_with_tensor_parallelism(tmp_path):
    check_start(parse_args([*FLAGS, "--tensor-parallel-size", "2", *storage(tmp_path)]), MODELS)


def test_a_second_engine_loads_what_the_first_saved_on_each_rank(tmp_path, reference):
    with tp_engine(*EAGER, *storage(tmp_path)) as first:
        assert generate(first, PROMPTS) == reference[:2]
        assert first.stats()["kv_connector_loaded_tokens"] == 0
    files = [sorted(p.name for p in rank_store(tmp_path, rank).directory.rglob("*.kvblock"))
             for rank in (0, 1)]
    assert files[0] and files[0] == files[1]  # each rank saved its shard of every block
    with tp_engine(*EAGER, *storage(tmp_path)) as second:
        assert generate(second, PROMPTS) == reference[:2]
        stats = second.stats()
    # All but the last token of the first prompt's blocks; of the second's, the blocks after
    # the common prefix (6 blocks) the in-memory prefix cache had.
    full = [(len(p) - 1) // BLOCK for p in PROMPTS]
    assert stats["kv_connector_loaded_tokens"] == (full[0] + full[1] - 6) * BLOCK
    assert stats["kv_connector_failed_blocks"] == 0


def run(engine, prompt) -> tuple[tuple[int, ...], list[int]]:
    """`prompt` run to its end alone: its greedy tokens and the blocks it held."""
    request = engine.add_request(prompt, GREEDY)
    blocks: list[int] = []
    while engine.has_unfinished:
        engine.step()
        blocks = list(request.block_ids) or blocks
    return tuple(request.output_token_ids), blocks


def test_a_block_missing_on_one_rank_is_computed_and_nothing_wrong_is_saved(tmp_path, reference):
    with tp_engine(*EAGER, *storage(tmp_path)) as first:
        assert generate(first, PROMPTS[:1]) == reference[:1]
    hashes = chain_hashes(LONGER, BLOCK)
    rank_store(tmp_path, 1).path(hashes[2]).unlink()
    with tp_engine(*EAGER, *storage(tmp_path), "--no-enable-prefix-caching") as second:
        # Rank 0 loads LONGER's first 9 blocks, rank 1 fails the third: every rank computes
        # from it on, and the step that first computed blocks 9-11 (on rank 1's missing one)
        # saves none of them.
        tokens, blocks = run(second, LONGER)
        assert tokens == reference[2]
        assert second.stats()["kv_connector_failed_blocks"] == 9 - 2
        # So rank 0's files of blocks 9-11 hold what its cache holds: the recomputed rows.
        caches, store = second.runner.kv_caches, rank_store(tmp_path, 0)
        for index in (9, 10, 11):
            scratch = {name: tuple(t[:1].clone() for t in cache) for name, cache in caches.items()}
            store.load(hashes[index], 0, scratch)
            for name, cache in caches.items():
                for saved, held in zip(scratch[name], cache):
                    assert torch.equal(saved[0], held[blocks[index]]), (index, name)
        # And the next request loads blocks 0-10 from both ranks' files.
        assert run(second, LONGER)[0] == reference[2]
        assert second.stats()["kv_connector_failed_blocks"] == 9 - 2
