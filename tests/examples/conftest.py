"""Fixtures shared by the example tests' directories (the engine's and the server's)."""

import pytest

from tests.support.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama checkpoint dir (`write_checkpoint`), one per test module."""
    return write_checkpoint(tmp_path_factory.mktemp("checkpoint"))
