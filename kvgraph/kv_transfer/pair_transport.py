"""What a disaggregated pair's connector hands its transport, and the metadata of one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgraph.kv_transfer.base import KVConnectorMetadata


@dataclass(frozen=True)
class RemotePull:
    """D's blocks `local_block_ids` to fill from P's `remote_block_ids` of one request."""

    request_id: str
    remote_request_id: str
    remote_host: str
    remote_port: int
    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]


@dataclass
class PairMetadata(KVConnectorMetadata):
    pulls: list[RemotePull] = field(default_factory=list)  # D: start these
    held: dict[str, float] = field(default_factory=dict)  # P: request -> deadline to free by


class PairTransport(Protocol):
    """How blocks move between one P and the D's that pull from it (one instance per worker)."""

    def offer(self) -> dict[str, Any]:
        """P: what a D needs to connect, sent in the handshake."""

    def accept(self, offer: dict[str, Any]) -> Any:
        """P: after answering a D's handshake with `offer`, its handle for that D."""

    def serve_pull(self, handle: Any, src: list[int], dst: list[int]) -> None:
        """P: its part of moving blocks `src` into the D's `dst` (nothing, for one-sided)."""

    def connect(self, offer: dict[str, Any]) -> Any:
        """D: its handle for the P that offered `offer`."""

    def pull(self, handle: Any, src: list[int], dst: list[int]) -> None:
        """D: move P's blocks `src` into this cache's `dst`; returns once they are written."""

    def close(self) -> None: ...
