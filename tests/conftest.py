"""Shared test setup: the `cuda` marker skips without a GPU."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def compile_cache_dir(tmp_path_factory):
    """One kvgraph (and so inductor) cache dir for the whole run: cold compiles happen once."""
    return str(tmp_path_factory.mktemp("kvgraph-cache"))


@pytest.fixture
def inductor_config(compile_cache_dir):
    from kvgraph import CompilationConfig

    return CompilationConfig(piece_compiler="inductor", compile_sizes=(4,), cache_dir=compile_cache_dir)


@pytest.fixture
def fresh_compile_state():
    """Dynamo's caches and kvgraph's counters cleared before and after the test."""
    import kvgraph

    torch._dynamo.reset()
    kvgraph.compile_counters.reset()
    kvgraph.graph_counters.reset()
    yield
    torch._dynamo.reset()
