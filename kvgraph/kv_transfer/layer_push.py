"""LayerPushConnector: disaggregated prefill with P pushing each layer's blocks into D's cache as
soon as its attention wrote them, overlapping the next layers' compute (beside the pull of
pair_connector.py).

The router sends D the request first (`kv_transfer_params: {"do_remote_prefill": true, "push":
true, "remote_host", "remote_port", "remote_request_id": T}`, T a transfer id) and P its prefill
at the same time (`{"do_remote_decode": true, "push": true, "transfer_id": T}`). D allocates
blocks for every prompt token but the last (P's first token is not known to D: D computes the
last prompt token), joins P's side channel on a connection and BlockPair of its own for T, and
says which of its blocks to fill. P, with `kv_connector_extra_config.push: true` (`layerwise`:
its runner resolves full graph modes to piecewise), sends in `save_kv_layer` that layer's blocks
the step's chunk completed (the partial last one with the prompt's last chunk) from its cache
into D's, without waiting; `wait_for_save` waits for them all. Before each layer's sends P says
on the side channel which blocks and tags follow, so D posts exactly those receives. Blocks
written before D registered are sent when it does. Once every layer is sent P says done and
frees the blocks (after `timeout_s` when D never registers). D computes the prompt itself when
P refuses, fails, is gone or silent for `timeout_s`. Only torch.distributed's transport pushes.
"""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
from typing import Any, Sequence

from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.base import ConnectorRequest, KVConnectorRole, ScheduledChunk
from kvgraph.kv_transfer.block_pair import BlockPair
from kvgraph.kv_transfer.compatibility import check_compatible
from kvgraph.kv_transfer.config import KVTransferConfig
from kvgraph.kv_transfer.pair_connector import PairConnector
from kvgraph.kv_transfer.outgoing_push import OutgoingPush
from kvgraph.kv_transfer.pair_transport import PairMetadata, PushChunk, RemotePush
from kvgraph.kv_transfer.push_receiver import receive_pushed_blocks
from kvgraph.kv_transfer.side_channel import recv_message, send_message

logger = logging.getLogger(__name__)

TRANSFER_ERRORS = (ConnectionError, OSError, ConfigError, RuntimeError, ValueError, KeyError)


class LayerPushConnector(PairConnector):
    """A PairConnector that also pushes layer by layer (see the module docstring)."""

    settings = PairConnector.settings + ("push",)

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                 **context: Any):
        super().__init__(config, role, block_size, **context)
        self.push = bool(config.extra("push", False)) and config.is_producer
        self.layerwise = self.push  # P sends from inside the forward: no full graphs
        self._pending_pushes: list[RemotePush] = []
        self._outgoing: dict[str, OutgoingPush] = {}  # P: by transfer id
        self._pushed: set[str] = set()  # P: requests pushed whole, freed once held
        self._step_chunks: list[PushChunk] = []
        self._layers_written = 0
        self._receivers: concurrent.futures.ThreadPoolExecutor | None = None
        self.counts.update(layer_saves=0, pushed_messages=0, received_pushes=0, failed_pushes=0,
                           overlapped_messages=0)  # sent while later layers had yet to run

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        super().check_config(config)
        if not isinstance(config.extra("push", False), bool):
            raise ConfigError("push", f"push: expected true or false, got "
                              f"{config.extra('push')!r}")

    # --- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if not (self.config.is_consumer and params.get("do_remote_prefill")
                and params.get("push")):
            return super().get_num_new_matched_tokens(request, num_computed_tokens)
        # Every prompt token but the last, which D computes: P's first token is not known yet.
        tokens = len(request.prompt_token_ids) - 1 - num_computed_tokens
        if tokens <= 0 or num_computed_tokens % self.block_size:
            self._release(request)
            return 0, False
        return tokens, True

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        if not params.get("push"):
            return super().update_state_after_alloc(request, block_ids, num_external_tokens)
        if num_external_tokens > 0:
            self._released.add(request.request_id)
            first = request.num_computed_tokens // self.block_size
            last = -(-(request.num_computed_tokens + num_external_tokens) // self.block_size)
            self._expect(request, first, block_ids[first:last])

    def _release(self, request: ConnectorRequest) -> None:
        if not request.kv_transfer_params.get("push"):
            return super()._release(request)
        if request.request_id not in self._released:  # an expectation of nothing: P frees
            self._released.add(request.request_id)
            self._expect(request, 0, ())

    def _expect(self, request: ConnectorRequest, first_block: int, block_ids: Sequence[int]
                ) -> None:
        params = request.kv_transfer_params
        self._pending_pushes.append(RemotePush(
            request.request_id, params["remote_request_id"], params["remote_host"],
            int(params["remote_port"]), first_block, tuple(block_ids)))

    def has_pending_work(self) -> bool:
        return super().has_pending_work() or bool(self._pending_pushes)

    def build_connector_meta(self, scheduled: Sequence[ScheduledChunk]) -> PairMetadata:
        metadata = super().build_connector_meta(scheduled)
        metadata.pushes, self._pending_pushes = self._pending_pushes, []
        if self.push:
            metadata.push_chunks = [c for c in map(self._push_chunk, scheduled) if c]
        return metadata

    def _push_chunk(self, chunk: ScheduledChunk) -> PushChunk | None:
        request = chunk.request
        params = getattr(request, "kv_transfer_params", None) or {}
        start, prompt_len = request.num_computed_tokens, len(request.prompt_token_ids)
        if not (params.get("do_remote_decode") and params.get("push")
                and isinstance(params.get("transfer_id"), str)) or start >= prompt_len:
            return None
        return PushChunk(request.request_id, params["transfer_id"], tuple(request.block_ids),
                         start, min(start + chunk.num_tokens, prompt_len), prompt_len)

    # --- worker side: P ---------------------------------------------------------------------

    def _serve_peer(self, conn: socket.socket) -> None:
        hello = recv_message(conn)
        if "push" not in hello:
            return self._serve_pulls(conn, hello)
        try:
            check_compatible(self.fingerprint, hello.get("fingerprint", {}), "the decode engine")
            if not self.push:
                raise ConfigError("push", "this prefill engine does not push KV blocks "
                                  "(kv_connector_extra_config.push is not set)")
        except ConfigError as error:
            send_message(conn, {"error": str(error)})
            return
        offer = self._transport.offer() if hello["dst"] else None
        send_message(conn, {"fingerprint": self.fingerprint, "transport": offer})
        pair = offer and self._transport.sender(offer)
        try:
            source = self._register(conn, pair, hello)
            while not source.finished.wait(0.5):
                with self._lock:  # never prefilled here: D gets an error, not a wait
                    if source.request_id is None and time.monotonic() > source.deadline:
                        self._fail(source, f"no request of transfer {source.transfer_id} was "
                                   f"prefilled here in timeout_s ({self.timeout_s:g} s)")
            send_message(conn, {"done": source.transfer_id} if source.ok
                         else {"error": source.error})
        finally:
            if pair is not None:
                pair.close()

    def _register(self, conn: socket.socket, pair: BlockPair | None, hello: dict[str, Any]
                  ) -> OutgoingPush:
        """P: D's expectation for a transfer: where its blocks go (the sends follow in the
        engine's thread, at its next layer or step)."""
        with self._lock:
            transfer_id = str(hello["push"])
            source = self._outgoing.setdefault(
                transfer_id, OutgoingPush(transfer_id, time.monotonic() + self.timeout_s))
            if source.registered:
                raise ConnectionError(f"transfer {transfer_id} is registered twice")
            source.conn, source.pair = conn, pair
            source.first_block, source.dst = int(hello["first_block"]), list(hello["dst"])
            source.registered = True
        return source

    def start_load_kv(self, attn_metadata: Any) -> None:
        super().start_load_kv(attn_metadata)
        metadata = self.connector_metadata
        for push in getattr(metadata, "pushes", ()):
            self._receivers = self._receivers or concurrent.futures.ThreadPoolExecutor(
                16, thread_name_prefix="kvgraph-kv-push")  # each waits for its P's compute
            self._receivers.submit(self._receive_push, push)
        if not self.push:
            return
        now = time.monotonic()
        with self._lock:
            for source in list(self._outgoing.values()):
                if source.request_id in self._sent and not source.finished.is_set():
                    self._fail(source, "the prefill engine freed the blocks: decode did not "
                               f"register in timeout_s ({self.timeout_s:g} s)")  # expired
            self._step_chunks = list(getattr(metadata, "push_chunks", ()))
            for chunk in self._step_chunks:
                source = self._outgoing.setdefault(
                    chunk.transfer_id, OutgoingPush(chunk.transfer_id, now + self.timeout_s))
                source.request_id, source.block_ids = chunk.request_id, chunk.block_ids
            self._layers_written = 0
            self._send_written()  # what was written before D registered
            self._settle()

    def save_kv_layer(self, layer_name: str, kv_cache: KVCache, attn_metadata: Any) -> None:
        if not self._step_chunks:
            return
        with self._lock:
            self.counts["layer_saves"] += 1
            self._layers_written += 1
            for chunk in self._step_chunks:
                source = self._outgoing.get(chunk.transfer_id)
                if source is not None:
                    source.written[layer_name] = chunk.written_blocks(self.block_size)
                    self._send(source, layer_name)

    def wait_for_save(self) -> None:
        with self._lock:
            for chunk in self._step_chunks:  # every layer: a step without hooks sends here
                source = self._outgoing.get(chunk.transfer_id)
                if source is not None:
                    for layer in self._caches:
                        source.written[layer] = chunk.written_blocks(self.block_size)
                    source.prompt_done |= chunk.end >= chunk.prompt_len
            self._step_chunks = []
            self._send_written()
            for source in list(self._outgoing.values()):
                self._wait(source)
            self._settle()

    def _send(self, source: OutgoingPush, layer: str) -> None:
        """Post the sends of `layer`'s blocks written and wanted, after saying which on the
        side channel (under the lock: the engine's thread only)."""
        if not source.registered or source.finished.is_set():
            return
        src, dst = source.unsent(layer)
        if not src:
            return
        start = source.sent.get(layer, source.first_block)
        try:
            send_message(source.conn, {"layer": layer, "src": src, "dst": dst,
                                       "tag": source.tag})
            works = source.pair.post(src, dst, True, source.pair.layer_tensors[layer],
                                     source.tag)
        except TRANSFER_ERRORS as error:
            return self._fail(source, f"sending layer {layer} failed: {error}")
        source.tag += len(works)
        source.works += works
        source.sent[layer] = start + len(src)
        self.counts["pushed_messages"] += 1
        self.counts["overlapped_messages"] += 0 < self._layers_written < len(self._caches)

    def _send_written(self) -> None:
        for source in list(self._outgoing.values()):
            for layer in self._caches:
                self._send(source, layer)

    def _wait(self, source: OutgoingPush) -> None:
        works, source.works = source.works, []
        try:
            if works:
                source.pair.wait(works)
        except ConnectionError as error:
            self._fail(source, str(error))

    def _settle(self) -> None:
        """Say done for each transfer sent whole, and free its request's blocks once held."""
        now = time.monotonic()
        for transfer_id, source in list(self._outgoing.items()):
            if not source.finished.is_set() and source.complete(list(self._caches)):
                self._wait(source)
                if not source.finished.is_set():
                    source.ok = True
                    source.finished.set()
                    self.counts["sent_blocks"] += len(source.dst)
            if source.ok and (source.request_id is not None or now > source.deadline):
                del self._outgoing[transfer_id]
                if source.request_id is not None:
                    self._pushed.add(source.request_id)
        for request_id in self._pushed & set(self._held):
            del self._held[request_id]
            self._pushed.discard(request_id)
            self._sent.add(request_id)

    def _fail(self, source: OutgoingPush, why: str) -> None:
        logger.warning("kvgraph: pushing transfer %s's KV blocks failed (%s)",
                       source.transfer_id, why)
        source.ok, source.error = False, why
        source.finished.set()
        self._outgoing.pop(source.transfer_id, None)
        self.counts["failed_pushes"] += 1

    # --- worker side: D ---------------------------------------------------------------------

    def _receive_push(self, push: RemotePush) -> None:
        """D: register with P, then receive what it pushes straight into this cache's blocks;
        on any failure (or nothing from P for `timeout_s`) the blocks are reported failed."""
        port = push.remote_port + self._tp[0]  # P's rank r pushes this rank r's shard
        dst = list(push.local_block_ids)
        try:
            conn, offer = self._join(push.remote_host, port, {
                "push": push.transfer_id, "first_block": push.first_block, "dst": dst})
            with conn:
                receive_pushed_blocks(conn, offer, self._caches, dst, self.timeout_s)
            failed: set[int] = set()
        except TRANSFER_ERRORS as error:
            logger.warning("kvgraph: receiving request %s's KV blocks pushed from %s:%d failed "
                           "(%s); its prompt is computed here instead", push.request_id,
                           push.remote_host, port, error)
            failed = set(dst)
        with self._lock:
            self._received.add(push.request_id)
            self._failed_blocks |= failed
            self.counts["received_blocks"] += len(dst) - len(failed)
            self.counts["received_pushes"] += 1
            self.counts["failed_pushes"] += bool(failed)

    def close(self) -> None:
        if self._receivers is not None:  # a receiver holds blocks until it reports them
            self._receivers.shutdown(wait=True)
        with self._lock:
            for source in list(self._outgoing.values()):
                self._fail(source, "the prefill engine closed")
        super().close()
