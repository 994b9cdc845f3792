"""The side channel of a disaggregated pair: messages framed and checked, and sent at once on
both ends (TCP_NODELAY: with Nagle's algorithm a pull's small messages each waited ~40 ms for
the peer's delayed ACK)."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from kvgraph.kv_transfer.side_channel import (
    SideChannelServer,
    no_delay,
    recv_message,
    send_message,
)


def nodelay(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


def test_both_ends_send_at_once_and_messages_round_trip():
    seen = {}
    done = threading.Event()

    def serve(conn):
        seen["nodelay"] = nodelay(conn)
        send_message(conn, {"echo": recv_message(conn)})
        done.set()

    server = SideChannelServer("127.0.0.1", 0, serve)
    try:
        with no_delay(socket.create_connection(("127.0.0.1", server.port), timeout=30)) as conn:
            assert nodelay(conn)
            send_message(conn, {"pull": [1, 2, 3]})
            assert recv_message(conn) == {"echo": {"pull": [1, 2, 3]}}
        assert done.wait(30) and seen["nodelay"]
    finally:
        server.close()


@pytest.mark.parametrize("payload, error", [
    (b"[1, 2]", "not an object"),
    (b"{not json", "not JSON"),
])
def test_a_message_that_is_not_a_json_object_is_refused(payload, error):
    left, right = socket.socketpair()
    with left, right:
        left.sendall(struct.pack(">I", len(payload)) + payload)
        with pytest.raises(ConnectionError, match=error):
            recv_message(right)
