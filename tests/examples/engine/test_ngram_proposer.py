"""NgramProposer: each proposal equals a plain brute-force prompt lookup (every n-gram length,
every earlier position), on random sequences with planted repeats and on the edge cases."""

from __future__ import annotations

import random

import numpy as np
import pytest

from examples.engine.ngram_proposer import NgramProposer
from examples.engine.speculative_config import SpeculativeConfig
from kvgraph.errors import ConfigError


def reference(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The longest n in [low, high] whose last n tokens occurred at an earlier start (not the
    suffix itself), its earliest occurrence, and the up to k tokens after it."""
    length = len(tokens)
    for n in range(high, low - 1, -1):
        if n >= length:
            continue
        suffix = tokens[length - n:]
        for start in range(0, length - n):  # every start before the suffix's own
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def proposer(low: int, high: int, k: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=k,
                                           prompt_lookup_min=low, prompt_lookup_max=high))


def planted(rng: random.Random, length: int, vocab: int) -> list[int]:
    """Random tokens, with some earlier stretches copied to the end so long matches exist."""
    tokens = [rng.randrange(vocab) for _ in range(length)]
    for _ in range(rng.randrange(3)):
        if len(tokens) < 2:
            break
        size = rng.randrange(1, min(12, len(tokens)) + 1)
        start = rng.randrange(len(tokens) - size + 1)
        tokens += tokens[start:start + size]
    return tokens


@pytest.mark.parametrize("seed", range(20))
def test_proposals_match_the_brute_force_lookup(seed):
    rng = random.Random(seed)
    for _ in range(100):
        low = rng.randrange(1, 5)
        high = low + rng.randrange(0, 4)
        k = rng.randrange(1, 8)
        # A small vocabulary makes many competing matches; a large one makes the planted
        # repeats the only ones.
        tokens = planted(rng, rng.randrange(0, 80), rng.choice([2, 3, 5, 50, 32000]))
        expected = reference(tokens, low, high, k)
        assert proposer(low, high).propose(tokens, k) == expected, (tokens, low, high, k)
        assert proposer(low, high).propose(np.array(tokens, dtype=np.int32), k) == expected


def test_the_longest_match_wins_over_an_earlier_shorter_one():
    tokens = [2, 3, 7, 1, 2, 3, 8, 1, 2, 3]
    assert proposer(1, 3).propose(tokens, 4) == [8, 1, 2, 3]
    assert proposer(1, 2).propose(tokens, 4) == [7, 1, 2, 3]


def test_of_equally_long_matches_the_earliest_is_followed():
    tokens = [1, 2, 9, 5, 1, 2, 7, 1, 2]
    assert proposer(2, 2).propose(tokens, 2) == [9, 5]


def test_vllms_documented_example():
    # vLLM's NgramProposer.propose docstring: [4, 2, 3] has no earlier match, [2, 3] does,
    # and only three tokens follow it.
    assert proposer(2, 3).propose([1, 2, 3, 4, 2, 3], 4) == [4, 2, 3]


def test_no_match_proposes_nothing():
    assert proposer(1, 5).propose(list(range(100)), 4) == []


def test_a_match_near_the_end_proposes_fewer_than_k():
    assert proposer(2, 2).propose([1, 2, 3, 1, 2], 5) == [3, 1, 2]
    # An occurrence may overlap the suffix: [7, 7] first ends at index 1.
    assert proposer(2, 2).propose([7, 7, 7, 7], 4) == [7, 7]


def test_with_min_equal_to_max_only_that_length_matches():
    tokens = [4, 5, 6, 9, 5, 6]  # [5, 6] repeats, [9, 5, 6] does not
    assert proposer(3, 3).propose(tokens, 3) == []
    assert proposer(2, 2).propose(tokens, 3) == [9, 5, 6]


def test_a_match_shorter_than_min_is_not_used():
    assert proposer(2, 4).propose([1, 8, 2, 1], 3) == []
    assert proposer(1, 4).propose([1, 8, 2, 1], 3) == [8, 2, 1]


@pytest.mark.parametrize("tokens", [[], [1], [1, 1], [1, 1, 1]])
def test_a_sequence_no_longer_than_min_proposes_nothing(tokens):
    assert proposer(3, 5).propose(tokens, 4) == []


def test_k_defaults_to_num_speculative_tokens_and_zero_proposes_nothing():
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer(2, 2, k=3).propose(tokens) == [3, 4, 5]
    assert proposer(2, 2).propose(tokens, 0) == []


def test_numpy_input_gives_python_ints():
    proposal = proposer(2, 2).propose(np.array([1, 2, 3, 1, 2], dtype=np.int32), 2)
    assert proposal == [3, 1] and all(type(token) is int for token in proposal)


def test_long_sequences_match_the_brute_force_lookup():
    rng = random.Random(7)
    base = [rng.randrange(32000) for _ in range(4000)]
    tokens = base + base[1234:1240]  # a 6-gram from the middle, at the end
    assert proposer(1, 5).propose(tokens, 4) == reference(tokens, 1, 5, 4) == base[1240:1244]
    same = [3] * 4096  # every position matches every length: the scan's worst case
    assert proposer(1, 64).propose(same, 8) == [3] * 8


def test_a_batch_proposes_for_each_sequence():
    sequences = [[1, 2, 3, 1, 2], [5, 6, 7], [9, 9, 9, 9, 9], []]
    batch = proposer(1, 3)
    assert batch.propose_batch(sequences, 2) == [[3, 1], [], [9, 9], []]
    assert batch.propose_batch(sequences, [1, 2, 3, 4]) == [[3], [], [9, 9], []]
    with pytest.raises(ValueError, match="one count per sequence"):
        batch.propose_batch(sequences, [1, 2])


def test_a_draft_model_config_is_refused():
    config = SpeculativeConfig(method="draft_model", model="/models/small",
                               num_speculative_tokens=2)
    with pytest.raises(ConfigError) as error:
        NgramProposer(config)
    assert error.value.field == "method"
