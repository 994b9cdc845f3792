"""Prefix caching (issue 18): the allocator's hashes, reference counts and LRU eviction; the
batch rule that lets requests share the blocks they only read; and the engine, whose requests
with a common prompt prefix give the tokens each gives alone, with the prefill they skip counted.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvgraph
from examples.engine import LLMEngine, SamplingParams
from examples.engine.block_allocator import BlockAllocator
from examples.engine.detokenizer import Detokenizer
from examples.engine.request import Request
from examples.engine.scheduler import Scheduler
from examples.engine.tokenizer import ByteTokenizer
from kvgraph.kv_transfer import chain_hashes
from examples.models.llama import Llama
from kvgraph import RequestChunk
from tests.support.scenario import make_runner

BLOCK_SIZE = 4
MAX_MODEL_LEN = 96
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PREFIX = [(11 * j + 5) % 256 for j in range(40)]  # ten full blocks
# Suffixes of 0 (the prefix alone: its last block is computed again, for its last token's
# logits), 1, 3 and 6 tokens; the last prompt repeats the second.
PROMPTS = [PREFIX, PREFIX + [1], PREFIX + [2, 3, 4], PREFIX + [9, 8, 7, 6, 5, 4], PREFIX + [1]]


def hashes(*blocks: int) -> list[bytes]:
    """Chain hashes of blocks of `BLOCK_SIZE` tokens, each filled with one token id."""
    return chain_hashes([t for t in blocks for _ in range(BLOCK_SIZE)], BLOCK_SIZE)


# --- chain hashes --------------------------------------------------------------------------

def test_a_block_hash_names_its_whole_prefix():
    tokens = list(range(10))
    full = chain_hashes(tokens, BLOCK_SIZE)
    assert len(full) == 2  # the third block is not full
    assert chain_hashes(tokens[:8] + [99], BLOCK_SIZE) == full
    assert chain_hashes(tokens, BLOCK_SIZE, known=full[:1]) == full
    changed_first = chain_hashes([7] + tokens[1:], BLOCK_SIZE)
    assert changed_first[0] != full[0] and changed_first[1] != full[1]  # same second block
    assert len(set(hashes(1, 1))) == 2  # equal blocks at different depths differ


# --- allocator: sharing, reference counts, eviction ------------------------------------------

def test_a_freed_registered_block_stays_cached_and_is_shared_by_count():
    allocator = BlockAllocator(4)
    blocks = allocator.allocate(2)
    for block, block_hash in zip(blocks, hashes(1, 2)):
        allocator.register(block, block_hash)
    allocator.free(blocks)
    assert allocator.num_free == 4 and allocator.num_cached == 2
    first, second = allocator.share(hashes(1, 2, 3)), allocator.share(hashes(1))
    assert first == blocks and second == blocks[:1]  # the longest cached run from the start
    assert allocator.num_free == 2
    allocator.free(first)
    assert allocator.num_free == 3  # blocks[0] is still held by the second request
    assert allocator.allocate(4) is None  # never a held block
    allocator.free(second)
    assert allocator.num_free == 4 and allocator.num_cached == 2
    with pytest.raises(ValueError, match=rf"not held: \[{blocks[0]}\]"):
        allocator.free(second)


def test_an_allocation_evicts_the_least_recently_freed_cached_block_last():
    allocator = BlockAllocator(4)
    a, b = allocator.allocate(2), allocator.allocate(2)
    for block, block_hash in zip(a + b, hashes(1, 2) + hashes(5, 6)):
        allocator.register(block, block_hash)
    allocator.free(a)
    allocator.free(b)
    # A request's deepest block goes first (its parent may serve a shorter prefix), then the
    # next request's.
    allocator.allocate(1)
    assert allocator.share(hashes(1, 2)) == a[:1] and allocator.stats() == {
        "prefix_cache_blocks": 3, "prefix_cache_evictions": 1}
    allocator.free(a[:1])
    allocator.allocate(2)
    assert allocator.share(hashes(5, 6)) == [] and allocator.share(hashes(1)) == a[:1]


def test_never_cached_free_blocks_are_allocated_before_any_eviction():
    allocator = BlockAllocator(3)
    block = allocator.allocate(1)
    allocator.register(block[0], hashes(1)[0])
    allocator.free(block)
    assert allocator.allocate(2) is not None
    assert allocator.stats()["prefix_cache_evictions"] == 0
    assert allocator.share(hashes(1)) == block


def test_a_hash_already_cached_stays_with_its_first_block():
    allocator = BlockAllocator(4)
    first, second = allocator.allocate(1), allocator.allocate(1)
    allocator.register(first[0], hashes(1)[0])
    allocator.register(second[0], hashes(1)[0])
    allocator.free(first + second)
    assert allocator.num_cached == 1 and allocator.share(hashes(1)) == first


def test_with_prefix_caching_off_nothing_is_cached_or_shared():
    allocator = BlockAllocator(4, enable_prefix_caching=False)
    blocks = allocator.allocate(2)
    for block, block_hash in zip(blocks, hashes(1, 2)):
        allocator.register(block, block_hash)
    allocator.free(blocks)
    assert allocator.num_cached == 0 and allocator.share(hashes(1, 2)) == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "share", "free"]), st.integers(0, 5),
                          st.integers(0, 6)), max_size=60))
def test_a_block_is_written_by_one_holder_and_counted_by_all(operations):
    """Fresh blocks are never held by anyone; every hold is freed once; counts add up."""
    allocator = BlockAllocator(12)
    held: dict[int, list[int]] = {}  # owner -> its blocks, shared ones first
    for operation, owner, count in operations:
        if operation == "free" or owner in held:
            allocator.free(held.pop(owner, []))
            continue
        shared = allocator.share(hashes(*range(count))) if operation == "share" else []
        fresh = allocator.allocate(2)
        if fresh is None:
            allocator.free(shared)
            continue
        assert not {b for blocks in held.values() for b in blocks} & set(fresh)
        held[owner] = shared + fresh
        for block, block_hash in zip(held[owner], hashes(*range(len(held[owner])))):
            allocator.register(block, block_hash)
        every = {b for blocks in held.values() for b in blocks}
        assert len(every) + allocator.num_free == 12


# --- scheduler: what it asks of the allocator ------------------------------------------------

def make_request(prompt: list[int]) -> Request:
    return Request("r", prompt, GREEDY, Detokenizer(ByteTokenizer(), ()), 0.0)


def run_step(scheduler: Scheduler) -> list[Request]:
    """Schedule a step and do what the engine does after it: count its tokens computed."""
    output = scheduler.schedule()
    for chunk in output.chunks:
        chunk.request.num_computed_tokens += chunk.num_tokens
        if chunk.request.num_uncomputed_tokens == 0:
            chunk.request.output_token_ids.append(0)
    return [chunk.request for chunk in output.chunks]


@pytest.mark.parametrize("enabled", [True, False])
def test_an_admitted_request_shares_the_cached_prefix_but_computes_its_last_token(enabled):
    allocator = BlockAllocator(32, enable_prefix_caching=enabled)
    scheduler = Scheduler(allocator, BLOCK_SIZE, max_num_seqs=4, token_budget=64)
    first, second = make_request(PREFIX), make_request(PREFIX)
    scheduler.add(first)
    run_step(scheduler)
    scheduler.add(second)
    run_step(scheduler)
    shared = 9 if enabled else 0  # the tenth block holds the last token: it is computed
    assert second.block_ids[:shared] == first.block_ids[:shared]
    assert second.block_ids[shared] not in first.block_ids
    assert scheduler.stats()["prefix_cache_hit_tokens"] == shared * BLOCK_SIZE
    assert scheduler.stats()["prefix_cache_queried_tokens"] == 2 * len(PREFIX)
    scheduler.remove(first)
    scheduler.remove(second)
    assert allocator.num_free == 32


def test_a_request_that_cannot_be_admitted_waits_holding_no_blocks():
    allocator = BlockAllocator(12)
    scheduler = Scheduler(allocator, BLOCK_SIZE, max_num_seqs=4, token_budget=64)
    first = make_request(PREFIX)
    scheduler.add(first)
    run_step(scheduler)
    second = make_request(PREFIX + [1] * 8)  # would share 10 and need 2, with 1 left free
    scheduler.add(second)
    assert run_step(scheduler) == [first]
    assert second.block_ids == [] and second.num_computed_tokens == 0
    assert scheduler.stats()["prefix_cache_queried_tokens"] == len(PREFIX)
    scheduler.remove(first)
    assert run_step(scheduler) == [second]
    assert second.num_computed_tokens == len(second.prompt_token_ids)
    assert scheduler.stats()["prefix_cache_hit_tokens"] == len(PREFIX)


# --- kvgraph's batch rule: shared blocks are read-only (refusals: test_batch_validation.py) ---


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_requests_may_share_a_block_they_only_read(mode):
    runner, reference = make_runner("llama", mode), make_runner("llama", mode)
    for r, blocks in ((runner, [5]), (reference, [5, 8])):
        r.capture()
        for block in blocks:  # one at a time: the copies' values are the shared block's bits
            r.execute([RequestChunk([3, 1, 4, 1], 0, [block])])
    shared = runner.execute([RequestChunk([5, 9], 4, [5, 6]), RequestChunk([2], 4, [5, 7])])
    copies = reference.execute([RequestChunk([5, 9], 4, [5, 6]), RequestChunk([2], 4, [8, 7])])
    torch.testing.assert_close(shared, copies, atol=0, rtol=0)


# --- the engine --------------------------------------------------------------------------------

def make_engine(mode: str, num_blocks: int = 96, max_num_seqs: int = 5,
                enable_prefix_caching: bool = True) -> LLMEngine:
    config = kvgraph.CompilationConfig(graph_mode=mode, piece_compiler="eager", max_num_tokens=32,
                                       capture_sizes=[1, 2, 4, 8, 16])
    runner = kvgraph.ModelRunner(Llama.from_preset("tiny", seed=1), config,
                                 num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                 max_num_seqs=max_num_seqs, max_model_len=MAX_MODEL_LEN)
    runner.capture()
    return LLMEngine(runner, ByteTokenizer(), enable_prefix_caching=enable_prefix_caching)


def tokens(completions) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]


@pytest.fixture(scope="module")
def alone() -> list[tuple[int, ...]]:
    """Each prompt's greedy tokens, alone in a fresh engine: nothing cached to share."""
    return [make_engine("eager").generate([p], GREEDY)[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("mode", ["eager", "piecewise", "full_and_piecewise"])
def test_a_shared_prefix_gives_each_prompt_its_tokens_alone_and_saves_its_prefill(mode, alone):
    engine = make_engine(mode)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == alone
    assert engine.scheduler.stats()["prefix_cache_hit_tokens"] > 0  # later admissions shared
    before = engine.scheduler.stats()
    steps = engine.num_steps
    assert tokens(engine.generate(PROMPTS, GREEDY)) == alone
    after = engine.scheduler.stats()
    shareable = sum((len(p) - 1) // BLOCK_SIZE * BLOCK_SIZE for p in PROMPTS)
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] == shareable
    assert (after["prefix_cache_queried_tokens"] - before["prefix_cache_queried_tokens"]
            == sum(map(len, PROMPTS)))
    assert engine.num_steps - steps == GREEDY.max_tokens  # every prompt's rest fit one step
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_request_asking_for_prompt_logprobs_computes_its_whole_prompt():
    scored = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1)
    fresh = make_engine("eager")
    reference = fresh.add_request(PREFIX, scored)
    while fresh.has_unfinished:
        fresh.step()
    engine = make_engine("eager")
    engine.generate([PREFIX], GREEDY)
    hits = engine.scheduler.stats()["prefix_cache_hit_tokens"]
    request = engine.add_request(PREFIX, scored)
    while engine.has_unfinished:
        engine.step()
    assert engine.scheduler.stats()["prefix_cache_hit_tokens"] == hits
    assert len(request.prompt_logprobs) == len(PREFIX)
    assert request.prompt_logprobs == reference.prompt_logprobs


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
def test_preempted_and_aborted_sharers_free_only_their_own_holds(mode):
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = PROMPTS[1:]
    reference = [make_engine("eager").generate([p], long)[0].token_ids for p in prompts]
    # 26 blocks: the shared prefix (10) and three requests' own 11 or 12 blocks do not fit.
    engine = make_engine(mode, num_blocks=26)
    engine.generate(PROMPTS[:1], GREEDY)
    requests = [engine.add_request(p, long) for p in prompts]
    engine.step()
    assert requests[0].block_ids[:10] == requests[1].block_ids[:10]
    assert engine.abort(requests[1].request_id)
    while engine.has_unfinished:
        engine.step()
    kept = [0, 2, 3]
    assert [tuple(requests[i].output_token_ids) for i in kept] == [reference[i] for i in kept]
    assert engine.scheduler.num_preemptions > 0
    assert engine.allocator.num_free == 26


@pytest.mark.parametrize("mode", ["eager", "none", "piecewise", "full", "full_decode_only",
                                  "full_and_piecewise"])
def test_caching_on_gives_the_tokens_of_caching_off_and_the_engine_counts_what_it_saved(mode):
    off, on = make_engine(mode, enable_prefix_caching=False), make_engine(mode)
    for _ in range(2):  # the second round finds every prompt's prefix cached
        assert tokens(on.generate(PROMPTS, GREEDY)) == tokens(off.generate(PROMPTS, GREEDY))
    assert off.stats()["prefix_cache_hit_tokens"] == 0 and off.num_steps > on.num_steps
    stats = on.stats()
    assert 0 < stats["prefix_cache_hit_tokens"] < stats["prefix_cache_queried_tokens"]
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
