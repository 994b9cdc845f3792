"""NixlConnector: disaggregated prefill (pair_connector.py) over NVIDIA's NIXL (UCX inside).

Every tensor of every layer's tuple is registered with a NIXL agent once, on both sides; P's
agent metadata and each tensor's base address and block stride travel in the handshake; a D
that pulls reads each run of P's blocks as one byte range straight into its own cache
(`initialize_xfer("READ", ...)`): zero copies. On the CPU the memory is "DRAM" and UCX moves it
over shared memory or TCP; on a GPU, "VRAM" over NVLink or RDMA, through the same code.

The agents run without NIXL's progress thread, which polls a whole core from the moment an
agent exists, busy or idle: D's agent progresses while D waits for its read, P's only while a D
reads from it (P's side-channel thread asks it for notifications until D says done: UCX over
TCP needs the target to progress). Needs `pip install nixl-cu12` (its CUDA build runs on a CPU-only
machine too: checked 2026-12-05, nixl-cu12 1.5.1).
"""

from __future__ import annotations

import base64
import select
import threading
import time
import uuid
from typing import Any

from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.block_pair import paired_runs
from kvgraph.kv_transfer.config import KVTransferConfig
from kvgraph.kv_transfer.pair_connector import PairConnector
from kvgraph.kv_transfer.pair_transport import PairTransport, ReadingTransport, block_bytes

PROGRESS_S = 0.0005  # between progress calls while a read is under way (either side)


def _import_agent():
    for module in ("nixl._api", "nixl_cu12._api", "nixl_cu13._api"):
        try:
            api = __import__(module, fromlist=["nixl_agent"])
            return api.nixl_agent, api.nixl_agent_config
        except ImportError:
            continue
    raise ConfigError("kv_connector", "NixlConnector needs NIXL: pip install nixl-cu12 (or "
                      "nixl-cu13; the CUDA builds run on the CPU too)")


class NixlTransport(ReadingTransport):
    """One-sided NIXL reads of registered caches (see PairTransport)."""

    kind = "nixl"

    def __init__(self, kv_caches: dict[str, KVCache], timeout_s: float):
        agent, config = _import_agent()
        self.agent = agent(f"kvgraph-{uuid.uuid4().hex[:12]}",
                           config(enable_prog_thread=False, backends=["UCX"]))
        self._progress = threading.Lock()  # one thread drives the agent's workers at a time
        self.timeout_s = timeout_s
        self.tensors = [t for _, cache in sorted(kv_caches.items()) for t in cache]
        self.memory = "VRAM" if self.tensors and self.tensors[0].is_cuda else "DRAM"
        self.registered = self.agent.register_memory(self.tensors)

    def offer(self) -> dict[str, Any]:
        return {"kind": "nixl", "agent": base64.b64encode(self.agent.get_agent_metadata()).decode(),
                "tensors": [[t.data_ptr(), block_bytes(t), _device(t)] for t in self.tensors]}

    def until_readable(self, conn: Any) -> None:
        while not select.select([conn], [], [], PROGRESS_S)[0]:
            with self._progress:
                self.agent.get_new_notifs()  # progresses the agent's UCX workers

    def connect(self, offer: dict[str, Any]) -> dict[str, Any]:
        self.check_offer(offer)
        name = self.agent.add_remote_agent(base64.b64decode(offer["agent"]))
        return {**offer, "name": name}

    def pull(self, handle: dict[str, Any], src: list[int], dst: list[int]) -> None:
        local, remote = [], []
        for first_src, first_dst, count in paired_runs(src, dst):
            for (base, stride, device), tensor in zip(handle["tensors"], self.tensors):
                size = count * block_bytes(tensor)
                local.append((tensor.data_ptr() + first_dst * block_bytes(tensor), size,
                              _device(tensor)))
                remote.append((base + first_src * stride, size, device))
        xfer = self.agent.initialize_xfer(
            "READ", self.agent.get_xfer_descs(local, self.memory),
            self.agent.get_xfer_descs(remote, self.memory), handle["name"])
        try:
            state = self.agent.transfer(xfer)
            deadline = time.monotonic() + self.timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise ConnectionError(f"NIXL read from {handle['name']} timed out")
                time.sleep(PROGRESS_S)
                with self._progress:
                    state = self.agent.check_xfer_state(xfer)
            if state == "ERR":
                raise ConnectionError(f"NIXL read from {handle['name']} failed")
        finally:
            self.agent.release_xfer_handle(xfer)

    def close(self) -> None:
        if self.registered is not None:
            self.agent.deregister_memory(self.registered)
            self.registered = None


def _device(tensor) -> int:
    return tensor.device.index or 0 if tensor.is_cuda else 0


class NixlConnector(PairConnector):
    """Disaggregated prefill over NIXL (see the module docstring and pair_connector.py)."""

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        super().check_config(config)
        _import_agent()  # a server without it refuses to start, saying how to install it

    def new_transport(self, kv_caches: dict[str, KVCache]) -> PairTransport:
        return NixlTransport(kv_caches, self.timeout_s)
