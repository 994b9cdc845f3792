"""Mooncake's Transfer Engine for the tests that move KV blocks with it.

`require_mooncake()` skips the test where `mooncake` does not import (the README's test command
does not install it), unless KVGRAPH_REQUIRE_MOONCAKE=1 (set by .ci/run, which installs the
wheel and the Debian libraries it needs), where a missing engine fails the test instead.
"""

from __future__ import annotations

import os

import pytest

REQUIRE = "KVGRAPH_REQUIRE_MOONCAKE"


def require_mooncake() -> None:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as error:
        reason = (f"Mooncake's Transfer Engine does not import ({error}): pip install "
                  "mooncake-transfer-engine-non-cuda; apt install libibverbs1 librdmacm1 "
                  "liburing2")
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1, but {reason}")
        pytest.skip(reason)
