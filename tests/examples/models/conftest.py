"""Fixtures shared by the example models' tests."""

import pytest

import kvgraph
from tests.support.model_reference import dense_attention, dense_mla_attention


@pytest.fixture
def no_cache(monkeypatch):
    """Both kvgraph attention layers replaced by the dense reference for the rest of the test."""
    def use():
        monkeypatch.setattr(kvgraph.Attention, "forward", dense_attention)
        monkeypatch.setattr(kvgraph.MLAAttention, "forward", dense_mla_attention)
    return use
