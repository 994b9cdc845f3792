"""Bad batches are refused at `execute()`'s edge: a BatchError naming the field, the chunk and
the limit, before anything runs, is written or is counted.

Each case is one an adversarial user tried (issue 12); the check after each is the same: the
caches are bit-identical, the dispatcher counted nothing, and the next good step matches a
runner that never saw the bad one.
"""

import numpy as np
import pytest
import torch

import kvgraph
from kvgraph import RequestChunk
from tests.support.scenario import make_runner

VOCAB = 256  # the tiny preset's


def good_step():
    return [RequestChunk([1, 2, 3], 0, [5]), RequestChunk([4], 7, [9, 11])]


BAD_BATCHES = {
    "token id = vocab_size": ([RequestChunk([1, VOCAB], 0, [5])], r"chunk 0: token_ids must lie "
                              rf"in \[0, vocab_size={VOCAB}\), got {VOCAB}"),
    "negative token id": ([RequestChunk([1], 0, [5]), RequestChunk([-1], 0, [6])],
                          "chunk 1: token_ids must lie in"),
    "float token ids": ([RequestChunk([1.7, 2.2], 0, [5])],
                        r"chunk 0: token_ids must be a list of ints .*got \[1.7, 2.2\]"),
    "float block ids": ([RequestChunk([1], 0, [5.0])], "chunk 0: block_ids must be a list of ints"),
    "float num_computed_tokens": ([RequestChunk([1], 2.0, [5])],
                                  "chunk 0: num_computed_tokens must be an int .*got float 2.0"),
    # Issue 17: every shape and type a chunk's fields were given.
    "nested token ids": ([RequestChunk([[1, 2]], 0, [5])],
                         r"chunk 0: token_ids must be a list of ints .*got \[\[1, 2\]\]"),
    "ragged token ids": ([RequestChunk([4], 0, [6]), RequestChunk([[1, 2], [3]], 0, [5])],
                         "chunk 1: token_ids must be a list of ints"),
    "2-D token tensor": ([RequestChunk(torch.tensor([[1, 2]]), 0, [5])],
                         r"chunk 0: token_ids must be a 1-D integer array, got one of shape "
                         r"\(1, 2\)"),
    "2-D token array": ([RequestChunk(np.array([[1, 2]]), 0, [5])],
                        r"chunk 0: token_ids must be a 1-D integer array.*\(1, 2\)"),
    "float token tensor": ([RequestChunk(torch.tensor([1.0]), 0, [5])],
                           "chunk 0: token_ids must be a 1-D integer array.*torch.float32"),
    "token ids None": ([RequestChunk(None, 0, [5])],
                       "chunk 0: token_ids must be a list of ints, got None"),
    "token ids an int": ([RequestChunk(3, 0, [5])],
                         "chunk 0: token_ids must be a list of ints, got int 3"),
    "block ids None": ([RequestChunk([1], 0, None)],
                       "chunk 0: block_ids must be a list of ints, got None"),
    "nested block ids": ([RequestChunk([1], 0, [[5]])], "chunk 0: block_ids must be a list of ints"),
    "a chunk that is a tuple": ([([1], 0, [5])], "chunk 0: expected a RequestChunk"),
    "a chunk that is None": ([RequestChunk([1], 0, [5]), None],
                             "chunk 1: expected a RequestChunk.*got None"),
    "chunks=None": (None, "chunks must be a list of RequestChunk, got None"),
    "bool token ids": ([RequestChunk([True, 2], 0, [5])],
                       "chunk 0: token_ids must be a list of ints .not bools"),
    "bool block ids": ([RequestChunk([1], 0, [True])], "chunk 0: block_ids must be a list of ints"),
    "bool num_computed_tokens": ([RequestChunk([1], True, [5, 6])],
                                 "chunk 0: num_computed_tokens must be an int .*got bool True"),
    "num_computed_tokens at int64's max": (
        [RequestChunk([1, 2], 2**63 - 1, [5])],
        r"chunk 0: num_computed_tokens must lie in \[0, 2147483647\], got 9223372036854775807"),
    "num_computed_tokens past int64": ([RequestChunk([1], 2**64, [5])],
                                       "chunk 0: num_computed_tokens must be an int .*int64"),
    "a token id past int64": ([RequestChunk([2**63], 0, [5])],
                              "chunk 0: token_ids must be a list of ints .*int64"),
    "a sequence past int32": ([RequestChunk([1, 2], 2**31 - 2, [5])],
                              "chunk 0: num_computed_tokens . len.token_ids. must be at most "
                              "2147483647"),
    # Issue 18: blocks only read may be shared (prefix caching); a block written may not.
    "a block two requests write": (
        [RequestChunk([1], 0, [5]), RequestChunk([2], 0, [5])],
        r"block 5 is written by chunks \[0, 1\] and used by chunks \[0, 1\]"),
    "a block one request writes and another reads": (
        [RequestChunk([1], 0, [5]), RequestChunk([2], 4, [5, 6])],
        r"block 5 is written by chunks \[0\] and used by chunks \[0, 1\]"),
    "readers of a shared block and its writer": (
        [RequestChunk([2], 4, [5, 6]), RequestChunk([2], 4, [5, 7]), RequestChunk([9], 3, [5])],
        r"block 5 is written by chunks \[2\] and used by chunks \[0, 1, 2\]"),
    "a block written twice in one request": (
        [RequestChunk([1] * 5, 0, [6, 6])],
        r"block 6 is written by chunks \[0\] and used by chunks \[0, 0\]"),
    "an empty batch": ([], "at least one RequestChunk"),
    "a chunk with no tokens": ([RequestChunk([], 0, [5])], "chunk 0 has no new tokens"),
    "too few blocks": ([RequestChunk([1] * 5, 0, [5])], "needs 2 blocks of size 4"),
    "a block id past the cache": ([RequestChunk([1], 0, [10_000])], "num_blocks=96"),
}


@pytest.mark.parametrize("mode", ["eager", "full_and_piecewise"])
@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_a_bad_batch_is_refused_before_anything_runs_or_is_counted(case, mode):
    chunks, message = BAD_BATCHES[case]
    runner = make_runner("llama", mode)
    runner.capture()
    runner.execute(good_step())
    caches = {name: [t.clone() for t in cache] for name, cache in runner.kv_caches.items()}
    stats = runner.stats()
    with pytest.raises(kvgraph.BatchError, match=message):
        runner.execute(chunks)
    for name, cache in runner.kv_caches.items():
        assert all(torch.equal(got, want) for got, want in zip(cache, caches[name])), name
    after = runner.stats()
    for key in ("hits", "padded_tokens", "fallbacks", "uncaptured"):
        assert after[key] == stats[key], f"a refused batch was counted in {key}"


def test_numpy_integers_of_any_kind_are_token_and_block_ids():
    # NumPy infers float64 for uint64 mixed with Python ints: they must still be read exactly.
    chunks = [RequestChunk([np.uint64(3), 2**40 % VOCAB], np.int32(0), [np.uint64(5)]),
              RequestChunk(np.array([7, 9], dtype=np.uint16), 0, torch.tensor([6]))]
    input_ids, positions = kvgraph.build_model_inputs(chunks)
    assert input_ids.dtype == torch.int64 and input_ids.tolist() == [3, 2**40 % VOCAB, 7, 9]
    assert positions.tolist() == [0, 1, 0, 1]
    metadata = kvgraph.build_attention_metadata(chunks, 4)
    assert metadata.block_table.tolist() == [[5], [6]]


def test_the_step_after_a_refused_batch_matches_a_runner_that_never_saw_it():
    runner, reference = make_runner("llama", "piecewise"), make_runner("llama", "piecewise")
    for r in (runner, reference):
        r.capture()
        r.execute(good_step())
    with pytest.raises(kvgraph.BatchError):
        runner.execute([RequestChunk([3, VOCAB + 5], 3, [5])])
    decode = [RequestChunk([7], 3, [5]), RequestChunk([8], 8, [9, 11, 13])]
    torch.testing.assert_close(runner.execute(decode), reference.execute(decode), atol=0, rtol=0)


def test_vocab_size_can_be_given_and_bounds_the_token_ids():
    model = make_runner("llama", "eager").model
    runner = kvgraph.ModelRunner(model, kvgraph.CompilationConfig(graph_mode="eager"),
                                 num_blocks=16, block_size=4, max_num_tokens=8, max_num_seqs=2,
                                 vocab_size=10)
    with pytest.raises(kvgraph.BatchError, match="vocab_size=10"):
        runner.execute([RequestChunk([10], 0, [0])])
    assert runner.execute([RequestChunk([9], 0, [0])]).shape == (1, VOCAB)


def test_a_shared_dummy_block_is_still_fine_below_the_runner():
    # Metadata for cache-less (encoder) attention may give every request the same block.
    metadata = kvgraph.build_attention_metadata([RequestChunk([1], 0, [0])] * 3, 4)
    assert metadata.block_table.tolist() == [[0], [0], [0]]
