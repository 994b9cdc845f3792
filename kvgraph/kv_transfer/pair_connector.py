"""PairConnector: prefill on one engine (P, `kv_producer`), decode on another (D,
`kv_consumer`), the prompt's blocks pulled by D from P's cache over a transport.

vLLM's protocol, so a router written for it drives this: a request sent to P with
`kv_transfer_params = {"do_remote_decode": true}` is prefilled there; when it ends, P keeps its
blocks held and answers with `{"do_remote_prefill": true, "remote_engine_id", "remote_block_ids",
"remote_host", "remote_port", "remote_request_id"}`; the same request sent to D with those
parameters loads the prompt's blocks from P (asynchronously: D's other requests step on)
instead of computing them. P frees the blocks once D has them, or after `timeout_s`. P's answer
also carries the token(s) it generated (`first_token_ids`, a key of kvgraph's that a vLLM router
passes through): D continues from them and computes no prompt token; without them D computes
the prompt's last token, as vLLM's D does.

D's worker joins P's side channel (`remote_host:remote_port`, P's `port` setting; with tensor
parallelism rank r's is `port + r`) once: the two compare cache fingerprints (a mismatched pair
is refused, naming the difference) and connect the subclass's transport, which moves each pulled
request's blocks from P's cache into D's (torch_distributed.py, mooncake.py, nixl.py). Per
pull, over the side channel: D asks for a request's blocks, P answers once it holds them, both
run the transport, D says done; P frees the blocks then, or after `timeout_s` if D never says
it (D gone mid-transfer included). Settings (`kv_connector_extra_config`): `host` (default
127.0.0.1) and `port` (P's side channel, required on P), `timeout_s` (default 120).
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import time
import uuid
from typing import Any, Sequence

from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.base import (
    ConnectorRequest, KVConnectorBase, KVConnectorRole, ScheduledChunk)
from kvgraph.kv_transfer.compatibility import check_compatible, kv_fingerprint
from kvgraph.kv_transfer.config import KVTransferConfig
from kvgraph.kv_transfer.pair_transport import PairMetadata, PairTransport, RemotePull
from kvgraph.kv_transfer.side_channel import (
    SideChannelServer, no_delay, recv_message, send_message)

logger = logging.getLogger(__name__)

SETTINGS = ("host", "port", "timeout_s", "model_key")
# How long P waits for a pulled request's blocks to be reported held: D may ask before P's
# next step has told its worker (the answer reached D through the router first).
HELD_WAIT_S = 5.0


class PairConnector(KVConnectorBase):
    """Both roles, on P and on D (see the module docstring); a subclass names its transport."""

    layerwise = False
    settings = SETTINGS  # a subclass adds its transport's

    def new_transport(self, kv_caches: dict[str, KVCache]) -> PairTransport:
        raise NotImplementedError

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                 model_key: str | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(config, role, block_size)
        self.check_config(config)
        self.host = config.extra("host", "127.0.0.1")
        self.port = config.extra("port", 0)
        self.timeout_s = float(config.extra("timeout_s", 120.0))
        self.model_key = model_key or config.extra("model_key") or ""
        self.engine_id = uuid.uuid4().hex
        self._tp = (tp_rank, tp_size)
        if self.config.is_producer and self.port + tp_size > 65536:
            raise ConfigError("port", f"port: tensor-parallel rank r serves its side channel on "
                              f"port + r, so with {tp_size} ranks port must be at most "
                              f"{65536 - tp_size}, got {self.port}")
        # Scheduler side.
        self._pending_pulls: list[RemotePull] = []
        self._released: set[str] = set()  # requests D told P it needs nothing of
        self._newly_held: dict[str, float] = {}
        # Worker side (P: the side channel and what it may send; D: its pairs and pulls).
        self._caches: dict[str, KVCache] = {}
        self._lock = threading.Condition()
        self._held: dict[str, float] = {}
        self._sent: set[str] = set()
        self._received: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._server: SideChannelServer | None = None
        self._peers: dict[tuple[str, int], tuple[socket.socket, Any]] = {}
        self._transport: PairTransport | None = None
        self._puller: concurrent.futures.ThreadPoolExecutor | None = None
        self.counts = {"sent_blocks": 0, "received_blocks": 0, "expired_requests": 0,
                       "failed_pulls": 0}

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        unknown = sorted(set(config.kv_connector_extra_config) - set(cls.settings))
        if unknown:
            raise ConfigError("kv_connector_extra_config", f"{config.kv_connector}: unknown "
                              f"setting(s) {unknown}; valid: {list(cls.settings)}")
        port = config.extra("port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ConfigError("port", f"port: expected a TCP port, got {port!r}")
        if config.is_producer and port == 0:
            raise ConfigError("port", f"{config.kv_connector}: a producer (kv_producer or "
                              "kv_both) needs a fixed side-channel port, which its answers "
                              "give the decode engine: set kv_connector_extra_config.port")
        timeout = config.extra("timeout_s", 120.0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ConfigError("timeout_s", f"timeout_s: expected seconds > 0, got {timeout!r}")

    # --- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if not (self.config.is_consumer and params.get("do_remote_prefill")):
            return 0, False
        # Every prompt token, partial block included, but the request's last token: that one
        # is computed here. With P's first token handed over (`first_token_ids`, appended by
        # the engine) it is that token, and no prompt token is computed here; without it, it
        # is the prompt's last, as vLLM's decode engine does, for the logits to sample from.
        usable = min(len(params.get("remote_block_ids", ())) * self.block_size,
                     len(request.prompt_token_ids), len(request.all_token_ids) - 1)
        tokens = usable - num_computed_tokens
        if tokens <= 0 or num_computed_tokens % self.block_size:
            self._release(request)  # nothing to pull (its own cache has it): P may free now
            return 0, False
        return tokens, True

    def _release(self, request: ConnectorRequest) -> None:
        """Tell P, with a pull of no blocks, that D needs none of `request`'s (once)."""
        if request.request_id in self._released:
            return
        self._released.add(request.request_id)
        params = request.kv_transfer_params
        self._pending_pulls.append(RemotePull(
            request.request_id, params.get("remote_request_id", request.request_id),
            params["remote_host"], int(params["remote_port"]), (), ()))

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self._released.add(request.request_id)  # the pull tells P when it may free
        params = request.kv_transfer_params
        first = request.num_computed_tokens // self.block_size
        last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
        self._pending_pulls.append(RemotePull(
            request.request_id, params.get("remote_request_id", request.request_id),
            params["remote_host"], int(params["remote_port"]),
            tuple(params["remote_block_ids"][first:last]), tuple(block_ids[first:last])))

    def has_pending_work(self) -> bool:
        return bool(self._pending_pulls or self._newly_held)

    def build_connector_meta(self, scheduled: Sequence[ScheduledChunk]) -> PairMetadata:
        metadata = PairMetadata(self._pending_pulls, self._newly_held)
        self._pending_pulls, self._newly_held = [], {}
        return metadata

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.config.is_consumer and params.get("do_remote_prefill"):
            self._release(request)  # ended before pulling (aborted): P need not wait
            self._released.discard(request.request_id)
        if not (self.config.is_producer and params.get("do_remote_decode")) or not block_ids:
            return False, None
        prompt_blocks = -(-len(request.prompt_token_ids) // self.block_size)
        self._newly_held[request.request_id] = time.monotonic() + self.timeout_s
        return True, {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                      "remote_block_ids": list(block_ids[:prompt_blocks]),
                      "remote_host": self.host,
                      "remote_port": self.port,
                      "first_token_ids": request.all_token_ids[len(request.prompt_token_ids):]}

    # --- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, KVCache]) -> None:
        self._caches = dict(kv_caches)
        self.fingerprint = kv_fingerprint(self._caches, self.block_size, self.model_key,
                                          *self._tp)
        self._transport = self.new_transport(self._caches)
        if self.config.is_producer:  # rank r on port + r: D's rank r pulls its shard there
            self._server = SideChannelServer(self.host, self.port + self._tp[0], self._serve_peer)

    def _serve_peer(self, conn: socket.socket) -> None:
        self._serve_pulls(conn, recv_message(conn))

    def _serve_pulls(self, conn: socket.socket, hello: dict[str, Any]) -> None:
        """P: one D's handshake, then its pulls, one at a time, until it leaves."""
        try:
            check_compatible(self.fingerprint, hello.get("fingerprint", {}), "the decode engine")
        except ConfigError as error:
            send_message(conn, {"error": str(error)})
            return
        offer = self._transport.offer()
        send_message(conn, {"fingerprint": self.fingerprint, "transport": offer})
        handle = self._transport.accept(offer)
        while True:
            pull = recv_message(conn)
            request_id = pull["remote_request_id"]
            with self._lock:
                held = self._lock.wait_for(lambda: request_id in self._held, HELD_WAIT_S)
            if not held:
                send_message(conn, {"error": f"request {request_id} holds no blocks here "
                                             "(freed after its timeout, or never prefilled)"})
                continue
            send_message(conn, {"ok": True})
            if pull["src"]:
                self._transport.serve_pull(handle, pull["src"], pull["dst"])
            self._transport.until_readable(conn)
            done = recv_message(conn)  # D has the blocks (or gave up): they may be freed
            with self._lock:
                self._held.pop(request_id, None)
                self._sent.add(request_id)
                self.counts["sent_blocks"] += len(pull["src"]) if done.get("ok") else 0

    def start_load_kv(self, attn_metadata: Any) -> None:
        metadata = self.connector_metadata
        now = time.monotonic()
        with self._lock:
            self._held.update(getattr(metadata, "held", {}))
            self._lock.notify_all()
            for request_id in [r for r, deadline in self._held.items() if deadline < now]:
                del self._held[request_id]  # D never came: free the blocks, counted
                self._sent.add(request_id)
                self.counts["expired_requests"] += 1
        for pull in getattr(metadata, "pulls", ()):
            if self._puller is None:
                self._puller = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="kvgraph-kv-pull")
            self._puller.submit(self._pull, pull)

    def _pull(self, pull: RemotePull) -> None:
        """D: fetch one request's blocks; on any failure its blocks are reported failed."""
        port = pull.remote_port + self._tp[0]  # P's rank r serves this rank r's shard
        try:
            conn, handle = self._peer(pull.remote_host, port)
            send_message(conn, {"remote_request_id": pull.remote_request_id,
                                "src": list(pull.remote_block_ids),
                                "dst": list(pull.local_block_ids)})
            answer = recv_message(conn)
            if "error" in answer:
                raise ConnectionError(answer["error"])
            pulled = False
            try:
                if pull.local_block_ids:
                    self._transport.pull(handle, list(pull.remote_block_ids),
                                         list(pull.local_block_ids))
                pulled = True
            finally:  # P frees the blocks either way: a failed pull is computed here
                send_message(conn, {"done": pull.remote_request_id, "ok": pulled})
            failed: set[int] = set()
        except (ConnectionError, OSError, ConfigError, RuntimeError) as error:
            self._peers.pop((pull.remote_host, port), None)
            logger.warning(
                "kvgraph: pulling request %s's KV blocks from %s:%d failed (%s); its prompt is "
                "computed here instead", pull.request_id, pull.remote_host, port, error)
            failed = set(pull.local_block_ids)
        with self._lock:
            self._received.add(pull.request_id)
            self._failed_blocks |= failed
            self.counts["received_blocks"] += len(pull.local_block_ids) - len(failed)
            self.counts["failed_pulls"] += bool(failed)

    def _peer(self, host: str, port: int) -> tuple[socket.socket, Any]:
        """D: the side channel and transport handle to P at `host:port`, joined (and checked)
        once."""
        peer = self._peers.get((host, port))
        if peer is None:
            conn, offer = self._join(host, port, {})
            peer = self._peers[(host, port)] = (conn, self._transport.connect(offer))
        return peer

    def _join(self, host: str, port: int, hello: dict[str, Any]
              ) -> tuple[socket.socket, dict[str, Any]]:
        """D: a new side-channel connection to P, fingerprints compared (`hello` added to
        D's); it and P's transport offer."""
        conn = no_delay(socket.create_connection((host, port), timeout=self.timeout_s))
        send_message(conn, {"fingerprint": self.fingerprint, **hello})
        answer = recv_message(conn)
        try:
            if "error" in answer:
                raise ConfigError("kv_transfer_config", answer["error"])
            check_compatible(self.fingerprint, answer["fingerprint"], "the prefill engine")
        except ConfigError:
            conn.close()
            raise
        return conn, answer["transport"]

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            sent, self._sent = self._sent, set()
            received, self._received = self._received, set()
        return sent or None, received or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.counts) if self.role is KVConnectorRole.WORKER else {}

    def close(self) -> None:
        if self._puller is not None:
            self._puller.shutdown(wait=True)
        if self._server is not None:
            self._server.close()
        for conn, _ in self._peers.values():
            conn.close()
        self._peers.clear()
        if self._transport is not None:
            self._transport.close()
