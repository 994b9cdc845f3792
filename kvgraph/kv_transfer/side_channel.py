"""The side channel of a disaggregated pair: small JSON messages over TCP (a handshake, then one
message per pulled request), beside the transport that moves the blocks themselves.

A message is a 4-byte big-endian length and that many bytes of UTF-8 JSON, at most MAX_MESSAGE
bytes: a peer that sends more, or not JSON, is dropped.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)

MAX_MESSAGE = 16 * 2**20


def no_delay(sock: socket.socket) -> socket.socket:
    """`sock` sending each message at once: with Nagle's algorithm on, a pull's small messages
    waited for the peer's delayed ACK (~40 ms each, measured by the disaggregation benchmark)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_message(sock: socket.socket) -> dict[str, Any]:
    """The next message; ConnectionError when the peer closed or sent something else."""
    (length,) = struct.unpack(">I", _recv_exactly(sock, 4))
    if length > MAX_MESSAGE:
        raise ConnectionError(f"side channel: a {length}-byte message, over {MAX_MESSAGE}")
    try:
        message = json.loads(_recv_exactly(sock, length))
    except ValueError as error:
        raise ConnectionError(f"side channel: not JSON ({error})") from None
    if not isinstance(message, dict):
        raise ConnectionError("side channel: a message that is not an object")
    return message


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("side channel: the peer closed the connection")
        data += chunk
    return bytes(data)


class SideChannelServer:
    """Accepts connections on `host:port` in a thread; each is served by `serve(sock)` in a
    thread of its own, and closed when it returns or raises."""

    def __init__(self, host: str, port: int, serve: Callable[[socket.socket], None]):
        self.serve = serve
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="kvgraph-kv-side-channel",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn = no_delay(self.sock.accept()[0])
            except OSError:  # closed
                return
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True,
                             name="kvgraph-kv-peer").start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.serve(conn)
            except ConnectionError as error:
                logger.info("kvgraph: a KV transfer peer left: %s", error)
            except Exception:  # noqa: BLE001 - one peer's fault must not stop the others
                logger.exception("kvgraph: serving a KV transfer peer failed")

    def close(self) -> None:
        self._closed = True
        self.sock.close()
