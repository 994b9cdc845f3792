"""Devices compare by type and index; an index-less device is the current one of its type."""

import pytest
import torch

import kvgraph
from kvgraph.devices import canonical_device, same_device
from tests.support.scenario import assert_matches_eager, make_model


def test_same_device_compares_type_and_index():
    assert same_device("cpu", "cpu:0") and same_device(torch.device("cpu:0"), "cpu")
    assert canonical_device("cpu") == torch.device("cpu", 0)
    assert not same_device("cpu", "meta")
    assert not same_device("cpu:0", "cpu:1")


def bind_llama_caches(cache_device, expected_device):
    model = make_model("llama")
    specs = kvgraph.kv_cache_specs(model, 4, torch.float32)
    caches = kvgraph.allocate_kv_caches(specs, 8, cache_device)
    return kvgraph.bind_kv_cache(kvgraph.attention_layers(model), caches, device=expected_device)


def test_bind_accepts_the_same_device_spelled_with_or_without_an_index():
    assert bind_llama_caches("cpu", "cpu:0")
    assert bind_llama_caches("cpu:0", "cpu")


def test_bind_still_rejects_another_device():
    with pytest.raises(kvgraph.KVCacheError, match="key_cache: expected device cpu, got meta"):
        bind_llama_caches("meta", "cpu")


def test_runner_on_cpu_0_matches_eager():
    runner = assert_matches_eager("llama", "full_and_piecewise", device="cpu:0")
    assert runner.device == torch.device("cpu", 0)


@pytest.mark.cuda
def test_bind_on_cuda_accepts_cuda_and_cuda_with_the_current_index():
    assert bind_llama_caches("cuda", "cuda")
    assert bind_llama_caches("cuda", f"cuda:{torch.cuda.current_device()}")
