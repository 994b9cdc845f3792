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


@dataclass(frozen=True)
class RemotePush:
    """D's blocks `local_block_ids`, from its block `first_block` on, that P is to push its
    blocks of transfer `transfer_id` into (none: D needs nothing of them, P may free them)."""

    request_id: str
    transfer_id: str
    remote_host: str
    remote_port: int
    first_block: int
    local_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PushChunk:
    """P: a chunk of a pushed request's prompt that runs in this step: its tokens
    `[start, end)`, the request's blocks so far, and the prompt's length."""

    request_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    start: int
    end: int
    prompt_len: int

    def written_blocks(self, block_size: int) -> int:
        """How many of the request's blocks hold every token they will once the chunk ran
        (the last, partial block too, once the prompt's last chunk did)."""
        if self.end >= self.prompt_len:
            return -(-self.prompt_len // block_size)
        return self.end // block_size


@dataclass
class PairMetadata(KVConnectorMetadata):
    pulls: list[RemotePull] = field(default_factory=list)  # D: start these
    held: dict[str, float] = field(default_factory=dict)  # P: request -> deadline to free by
    pushes: list[RemotePush] = field(default_factory=list)  # D: register, then receive these
    push_chunks: list[PushChunk] = field(default_factory=list)  # P: push these as they run


class PairTransport(Protocol):
    """How blocks move between one P and the D's that pull from it (one instance per worker)."""

    def offer(self) -> dict[str, Any]:
        """P: what a D needs to connect, sent in the handshake."""

    def accept(self, offer: dict[str, Any]) -> Any:
        """P: after answering a D's handshake with `offer`, its handle for that D."""

    def serve_pull(self, handle: Any, src: list[int], dst: list[int]) -> None:
        """P: its part of moving blocks `src` into the D's `dst` (nothing, for one-sided)."""

    def until_readable(self, conn: Any) -> None:
        """P: return once D's next message is on `conn` (D's pull is done), doing meanwhile what
        D's reads need of this side (nothing for most transports)."""

    def connect(self, offer: dict[str, Any]) -> Any:
        """D: its handle for the P that offered `offer`."""

    def pull(self, handle: Any, src: list[int], dst: list[int]) -> None:
        """D: move P's blocks `src` into this cache's `dst`; returns once they are written."""

    def close(self) -> None: ...


def block_bytes(tensor: Any) -> int:
    """Bytes of one block of a cache tensor (`[num_blocks, ...]`, blocks contiguous)."""
    return tensor.stride(0) * tensor.element_size()


class ReadingTransport:
    """The part every one-sided transport shares: D reads P's registered cache, so P's part of a
    pull is nothing, and D checks P offers the same transport over as many tensors. A subclass
    sets `kind` and `tensors` (this side's cache tensors, in the pair's order)."""

    kind = ""
    tensors: list

    def accept(self, offer: dict[str, Any]) -> None:
        return None

    def serve_pull(self, handle: None, src: list[int], dst: list[int]) -> None:
        return None

    def until_readable(self, conn: Any) -> None:
        return None

    def check_offer(self, offer: dict[str, Any]) -> None:
        """A ConnectionError unless P offers this transport over as many tensors."""
        if offer.get("kind") != self.kind or len(offer["tensors"]) != len(self.tensors):
            raise ConnectionError(f"the prefill engine offers {offer.get('kind')!r} with "
                                  f"{len(offer.get('tensors', []))} tensors; this side reads "
                                  f"with {self.kind} into {len(self.tensors)}")
