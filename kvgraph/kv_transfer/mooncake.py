"""MooncakeConnector: disaggregated prefill (pair_connector.py) over Mooncake's Transfer Engine.

Every tensor of every layer's tuple is registered with the engine once, on both sides; a D that
pulls reads each run of P's blocks as one byte range, `base + block_id * stride(0)`, straight
into its own cache (`batch_transfer_sync_read`): zero copies, P's Python not involved. The
engine starts in its two-process mode without a metadata server (`P2PHANDSHAKE`) over
`protocol` (`kv_connector_extra_config.protocol`: "tcp" by default; "rdma" and the device
transports on clusters that have them, through the same code). Needs the optional extra
`pip install "kvgraph[mooncake]"` (PyPI `mooncake-transfer-engine-non-cuda`, whose library
needs the Debian packages libibverbs1, librdmacm1 and liburing2).
"""

from __future__ import annotations

from typing import Any

from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.block_pair import paired_runs
from kvgraph.kv_transfer.config import KVTransferConfig
from kvgraph.kv_transfer.pair_connector import SETTINGS, PairConnector
from kvgraph.kv_transfer.pair_transport import PairTransport, ReadingTransport, block_bytes


def _import_engine():
    try:
        from mooncake.engine import TransferEngine
    except ImportError as error:
        raise ConfigError("kv_connector", "MooncakeConnector needs Mooncake's Transfer "
                          "Engine: pip install mooncake-transfer-engine-non-cuda (and, on "
                          "Debian, apt install libibverbs1 librdmacm1 liburing2): "
                          f"{error}") from error
    return TransferEngine


# Reads per batch: Mooncake 0.3.13 fails a batch of 4,096 (2,048 pass); runs of many layers'
# tensors reach that with a few hundred scattered blocks.
MAX_BATCH = 1024


class MooncakeTransport(ReadingTransport):
    """One-sided reads of registered caches (see PairTransport and the module docstring)."""

    kind = "mooncake"

    def __init__(self, kv_caches: dict[str, KVCache], host: str, protocol: str = "tcp"):
        self.engine = _import_engine()()
        if self.engine.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise ConnectionError(f"Mooncake's Transfer Engine did not start on {host} over "
                                  f"{protocol}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self.tensors = [t for _, cache in sorted(kv_caches.items()) for t in cache]
        self.registered = []
        for tensor in self.tensors:
            if self.engine.register_memory(tensor.data_ptr(), _nbytes(tensor)) != 0:
                raise ConnectionError("Mooncake could not register a KV cache tensor of "
                                      f"{_nbytes(tensor)} bytes")
            self.registered.append(tensor.data_ptr())

    def offer(self) -> dict[str, Any]:
        return {"kind": "mooncake", "session": self.session,
                "tensors": [[t.data_ptr(), block_bytes(t)] for t in self.tensors]}

    def connect(self, offer: dict[str, Any]) -> dict[str, Any]:
        self.check_offer(offer)
        return offer

    def pull(self, handle: dict[str, Any], src: list[int], dst: list[int]) -> None:
        local, remote, lengths = [], [], []
        for first_src, first_dst, count in paired_runs(src, dst):
            for (base, stride), tensor in zip(handle["tensors"], self.tensors):
                local.append(tensor.data_ptr() + first_dst * block_bytes(tensor))
                remote.append(base + first_src * stride)
                lengths.append(count * block_bytes(tensor))
        for start in range(0, len(local), MAX_BATCH):
            part = slice(start, start + MAX_BATCH)
            status = self.engine.batch_transfer_sync_read(handle["session"], local[part],
                                                          remote[part], lengths[part])
            if status != 0:
                raise ConnectionError(f"Mooncake's read from {handle['session']} failed "
                                      f"({status})")

    def close(self) -> None:
        for address in self.registered:
            self.engine.unregister_memory(address)
        self.registered.clear()


def _nbytes(tensor) -> int:
    return tensor.shape[0] * block_bytes(tensor)


class MooncakeConnector(PairConnector):
    """Disaggregated prefill over Mooncake (see the module docstring and pair_connector.py)."""

    settings = (*SETTINGS, "protocol")

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        super().check_config(config)
        _import_engine()  # a server without it refuses to start, saying how to install it

    def new_transport(self, kv_caches: dict[str, KVCache]) -> PairTransport:
        return MooncakeTransport(kv_caches, self.host, self.config.extra("protocol", "tcp"))
