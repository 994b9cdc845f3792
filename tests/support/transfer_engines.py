"""Mooncake's Transfer Engine and NIXL, for the tests that move KV blocks with them.

`require_mooncake()` and `require_nixl()` skip the test where the engine does not import (the
README's test command does not install them), unless KVGRAPH_REQUIRE_TRANSFER_ENGINES=1 (set by
.ci/run, which installs both wheels and the Debian libraries Mooncake needs), where a missing
engine fails the test instead.
"""

from __future__ import annotations

import os

import pytest

REQUIRE = "KVGRAPH_REQUIRE_TRANSFER_ENGINES"


def _require(check, install: str) -> None:
    try:
        check()
    except Exception as error:  # noqa: BLE001 - ImportError, or kvgraph's ConfigError saying so
        reason = f"{error} ({install})"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1, but {reason}")
        pytest.skip(reason)


def require_mooncake() -> None:
    def check():
        from mooncake.engine import TransferEngine
        return TransferEngine
    _require(check, "pip install mooncake-transfer-engine-non-cuda; apt install libibverbs1 "
             "librdmacm1 liburing2")


def require_nixl() -> None:
    from kvgraph.kv_transfer.nixl import _import_agent

    _require(_import_agent, "pip install nixl-cu12")
