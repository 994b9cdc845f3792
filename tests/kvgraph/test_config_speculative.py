"""CompilationConfig.num_speculative_tokens: validation, and capture sizes rounded to whole verify
steps (multiples of 1 + K) in every graph mode, bounded as the lists without speculation are."""

from __future__ import annotations

import pytest

from kvgraph import CompilationConfig
from kvgraph.config import MAX_DEFAULT_CAPTURE_SIZE, multiples_of
from kvgraph.errors import ConfigError

ALL_MODES = ["eager", "none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]


def make(**kwargs) -> CompilationConfig:
    kwargs.setdefault("cache_dir", "/tmp/kvgraph-test-cache")
    return CompilationConfig(**kwargs)


def test_no_speculation_by_default_leaves_the_sizes_as_they_were():
    config = make(max_num_tokens=64)
    assert (config.num_speculative_tokens, config.uniform_decode_query_len) == (0, 1)
    assert config.capture_size_list == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert make(capture_sizes=(5, 3)).capture_size_list == (3, 5)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2", None])
def test_num_speculative_tokens_must_be_an_int_of_at_least_zero(value):
    with pytest.raises(ConfigError, match="num_speculative_tokens: expected an int >= 0"):
        make(num_speculative_tokens=value)


def test_strings_are_parsed_by_options_and_the_environment():
    cache_dir = "/tmp/kvgraph-test-cache"
    assert CompilationConfig.from_options(
        {"num_speculative_tokens": "3"}, cache_dir=cache_dir).uniform_decode_query_len == 4
    environ = {"KVGRAPH_NUM_SPECULATIVE_TOKENS": "2"}
    assert CompilationConfig.from_env(environ, cache_dir=cache_dir).num_speculative_tokens == 2


def test_a_verify_step_must_fit_max_num_tokens():
    make(max_num_tokens=4, num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="verify step of one request has 5 tokens"):
        make(max_num_tokens=4, num_speculative_tokens=4)


@pytest.mark.parametrize("mode", ALL_MODES)
def test_user_sizes_are_rounded_up_to_multiples_of_one_plus_k_in_every_mode(mode):
    config = make(graph_mode=mode, capture_sizes=(1, 2, 4, 8, 16), max_num_tokens=32,
                  num_speculative_tokens=2)
    assert config.capture_size_list == (3, 6, 9, 18)
    # A rounded size above max_num_tokens becomes the largest multiple within it.
    config = make(graph_mode=mode, capture_sizes=(4, 30), max_num_tokens=30,
                  num_speculative_tokens=3)
    assert config.capture_size_list == (4, 28)


def test_rounding_is_one_function_of_the_query_length():
    assert multiples_of((1, 2, 4), 1, 4) == (1, 2, 4)
    assert multiples_of((1, 2, 4, 5, 8), 4, None) == (4, 8)
    assert multiples_of((1, 7), 3, 7) == (3, 6)
    assert multiples_of((1,), 5, 3) == (5,)  # never below one verify step


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("k, max_num_tokens", [(1, None), (2, None), (3, 100), (7, 64),
                                               (4, 2048), (2, 3)])
def test_the_default_list_stays_bounded_and_whole_in_every_mode(mode, k, max_num_tokens):
    plain = make(graph_mode=mode, max_num_tokens=max_num_tokens)
    config = make(graph_mode=mode, max_num_tokens=max_num_tokens, num_speculative_tokens=k)
    q = config.uniform_decode_query_len
    sizes = config.capture_size_list
    assert sizes == tuple(sorted(set(sizes)))
    assert all(size % q == 0 for size in sizes)
    # The largest size never grows past the list without speculation (nor max_num_tokens),
    # and only the rounding down at the top takes less than q - 1 tokens off it.
    largest = max(plain.capture_size_list)
    assert largest - q < max(sizes) <= min(largest, MAX_DEFAULT_CAPTURE_SIZE)
    # Rounding merges sizes: never more graphs than without speculation.
    assert len(sizes) <= len(plain.capture_size_list)
    # Every size of the plain list has a size at least as large, up to the top.
    assert all(any(s >= p for s in sizes) for p in plain.capture_size_list if p <= max(sizes))
