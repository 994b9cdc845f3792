"""TorchDistributedConnector: disaggregated prefill (pair_connector.py) over torch.distributed:
each D that pulls from a P joins it in a process group of two (a BlockPair: gloo on the CPU,
NCCL on CUDA, HCCL on Ascend), and P sends each pulled request's blocks straight from its cache
into D's, pulled by D once P prefilled a request or, with `push: true` on P, pushed by P layer
by layer as it computes (layer_push.py)."""

from __future__ import annotations

from typing import Any

from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.block_pair import RECEIVER, SENDER, BlockPair, host_pair_store
from kvgraph.kv_transfer.layer_push import LayerPushConnector
from kvgraph.kv_transfer.pair_transport import PairTransport


class PointToPointTransport:
    """Two-sided: P sends, D receives, over a BlockPair per D (see PairTransport)."""

    def __init__(self, kv_caches: dict[str, KVCache], host: str, timeout_s: float):
        self.kv_caches, self.host, self.timeout_s = kv_caches, host, timeout_s
        self.pairs: list[BlockPair] = []
        self._stores: dict[int, Any] = {}  # offered, by port: each pair's, until accepted

    def offer(self) -> dict[str, Any]:
        store = host_pair_store(self.host, self.timeout_s)
        self._stores[store.port] = store
        return {"kind": "torch.distributed", "host": self.host, "port": store.port}

    def accept(self, offer: dict[str, Any]) -> BlockPair:
        pair = self.sender(offer)
        self.pairs.append(pair)
        return pair

    def sender(self, offer: dict[str, Any]) -> BlockPair:
        """P: its end of the pair it offered (`offer`), for the caller to close."""
        return BlockPair(self.kv_caches, offer["host"], offer["port"], SENDER, self.timeout_s,
                         store=self._stores.pop(offer["port"]))

    def serve_pull(self, handle: BlockPair, src: list[int], dst: list[int]) -> None:
        handle.send(src, dst)

    def until_readable(self, conn: Any) -> None:
        return None

    def connect(self, offer: dict[str, Any]) -> BlockPair:
        pair = BlockPair(self.kv_caches, offer["host"], offer["port"], RECEIVER, self.timeout_s)
        self.pairs.append(pair)
        return pair

    def pull(self, handle: BlockPair, src: list[int], dst: list[int]) -> None:
        handle.recv(src, dst)

    def close(self) -> None:
        for pair in self.pairs:
            pair.close()
        self.pairs.clear()
        self._stores.clear()


class TorchDistributedConnector(LayerPushConnector):
    """Disaggregated prefill over torch.distributed (see the module docstring,
    pair_connector.py and layer_push.py)."""

    def new_transport(self, kv_caches: dict[str, KVCache]) -> PairTransport:
        return PointToPointTransport(kv_caches, self.host, self.timeout_s)
