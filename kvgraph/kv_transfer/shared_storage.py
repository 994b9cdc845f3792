"""SharedStorageConnector: a prefix cache on disk that outlives the process and is shared by the
processes of one host.

Each full block of a prompt is saved, after the step that computed it, as a file named by its
prefix chain hash (the hash prefix caching computes: it names the whole prefix up to the block).
A later request, in this process after the block was evicted from memory, in another process
or after a restart, loads the run of blocks its prompt starts with instead of computing them.
Files are kept by BlockStore (trusted, atomic, checksummed, size-limited).

It works on whole requests: blocks are loaded before the step's forward (`start_load_kv`, or in
a background thread with `load_async`) and saved after it (`wait_for_save`), so it keeps full
graphs. Settings (`kv_connector_extra_config`): `shared_storage_path` (required), `model_key`
(names the weights and cache dtype; the example engine passes its own), `max_size_gib` (default
10; least recently used blocks are deleted past it) and `load_async` (default false).

Under tensor parallelism each rank keeps its own shard's files (the store key names the rank).
A block loaded in the step that failed on one rank was computed on with garbage on every rank
(a step's attention spans all ranks' heads), so that step's saves for its request are skipped
on every rank: the ranks agree on which failed with one small all-reduce, in the steps that
load and save.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from kvgraph.distributed import tensor_parallel_group
from kvgraph.errors import ConfigError
from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorRole,
    ScheduledChunk,
)
from kvgraph.kv_transfer.block_hashes import BlockHash, chain_hashes
from kvgraph.kv_transfer.block_store import BlockFileError, BlockStore, StoreLayout
from kvgraph.kv_transfer.config import KVTransferConfig

logger = logging.getLogger(__name__)

DEFAULT_MAX_SIZE_GIB = 10.0
SETTINGS = ("shared_storage_path", "model_key", "max_size_gib", "load_async")


@dataclass(frozen=True)
class BlockTransfer:
    """Blocks of one request to load or save: `block_ids[i]` holds the block `block_hashes[i]`."""

    request_id: str
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    asynchronous: bool = False


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


class SharedStorageConnector(KVConnectorBase):
    """Both roles of the shared-storage connector (see the module docstring)."""

    layerwise = False

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                 model_key: str | None = None, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(config, role, block_size)
        self.check_config(config)
        model_key = model_key or config.extra("model_key")
        if not isinstance(model_key, str) or not model_key:
            raise ConfigError("model_key", "SharedStorageConnector needs a model_key naming the "
                              "model's weights and cache dtype (blocks of one model must never "
                              "reach another): pass model_key=, or set it in "
                              "kv_connector_extra_config")
        self.load_async = config.extra("load_async", False)
        max_gib = config.extra("max_size_gib", DEFAULT_MAX_SIZE_GIB)
        path = config.extra("shared_storage_path")
        self.store = BlockStore(path, StoreLayout(model_key, block_size, tp_rank, tp_size),
                                None if max_gib is None else int(max_gib * 2**30))
        # Scheduler side: per request, its prompt's chain hashes and the blocks to load.
        self._hashes: dict[str, list[BlockHash]] = {}
        self._pending_loads: list[BlockTransfer] = []
        self.matched_tokens = 0
        # Worker side.
        self._caches: dict[str, KVCache] = {}
        self._loader: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # guards what the loader thread reports
        self._finished_loads: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._failed_requests: set[str] = set()  # this step's: their computed blocks are wrong
        self._tp_group: dist.ProcessGroup | None = None  # the ranks that agree on those
        self.counts = {"loaded_tokens": 0, "saved_tokens": 0, "load_failures": 0}

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        unknown = sorted(set(config.kv_connector_extra_config) - set(SETTINGS))
        if unknown:
            raise ConfigError("kv_connector_extra_config", f"SharedStorageConnector: unknown "
                              f"setting(s) {unknown}; valid: {list(SETTINGS)}")
        path = config.extra("shared_storage_path")
        if not isinstance(path, str) or not path:
            raise ConfigError("shared_storage_path", "SharedStorageConnector needs "
                              "kv_connector_extra_config.shared_storage_path, a directory")
        _flag(config.extra("load_async", False), "load_async")
        _size(config.extra("max_size_gib", DEFAULT_MAX_SIZE_GIB))

    # --- scheduler side ---------------------------------------------------------------------

    def _prompt_hashes(self, request: ConnectorRequest) -> list[BlockHash]:
        known = self._hashes.get(request.request_id, [])
        hashes = chain_hashes(request.prompt_token_ids, self.block_size, known)
        self._hashes[request.request_id] = hashes
        return hashes

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self.config.is_consumer or num_computed_tokens % self.block_size:
            return 0, False
        # The last token is always computed: its logits are what the step samples from.
        usable = (len(request.all_token_ids) - 1) // self.block_size
        hashes = self._prompt_hashes(request)[:usable]
        found = 0
        for block_hash in hashes[num_computed_tokens // self.block_size:]:
            if not self.store.has(block_hash):
                break
            found += 1
        return found * self.block_size, self.load_async and found > 0

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self.matched_tokens += num_external_tokens
        first = request.num_computed_tokens // self.block_size
        last = first + num_external_tokens // self.block_size
        self._pending_loads.append(BlockTransfer(
            request.request_id, tuple(self._prompt_hashes(request)[first:last]),
            tuple(block_ids[first:last]), self.load_async))

    def build_connector_meta(self, scheduled: Sequence[ScheduledChunk]) -> SharedStorageMetadata:
        metadata = SharedStorageMetadata(loads=self._pending_loads)
        self._pending_loads = []
        if self.config.is_producer:
            for chunk in scheduled:
                save = self._blocks_completed(chunk.request, chunk.num_tokens)
                if save is not None:
                    metadata.saves.append(save)
        return metadata

    def _blocks_completed(self, request: ConnectorRequest, num_tokens: int
                          ) -> BlockTransfer | None:
        """The full prompt blocks `request`'s next `num_tokens` tokens complete, if any."""
        start = request.num_computed_tokens
        end = min(start + num_tokens, len(request.prompt_token_ids))
        # The block `start` falls in is completed now too when a chunk before ended inside it.
        first, last = start // self.block_size, end // self.block_size
        if last <= first:
            return None
        hashes = self._prompt_hashes(request)
        return BlockTransfer(request.request_id, tuple(hashes[first:last]),
                             tuple(request.block_ids[first:last]))

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._hashes.pop(request.request_id, None)
        return False, None  # saves are done by the end of their step: nothing to wait for

    # --- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, KVCache]) -> None:
        self._caches = dict(kv_caches)
        tp_size = self.store.layout.tp_size
        if tp_size > 1:
            tp = tensor_parallel_group()
            if tp.world_size != tp_size:
                raise ConfigError("tp_size", f"SharedStorageConnector: built for {tp_size} "
                                  f"tensor-parallel ranks, but this process has {tp.world_size}")
            self._tp_group = tp.cpu_group

    def start_load_kv(self, attn_metadata: Any) -> None:
        self._failed_requests = set()
        metadata = self.connector_metadata
        for load in getattr(metadata, "loads", ()):
            if load.asynchronous:
                if self._loader is None:
                    self._loader = concurrent.futures.ThreadPoolExecutor(
                        1, thread_name_prefix="kvgraph-kv-load")
                self._loader.submit(self._load, load)
            else:
                self._load(load)

    def _load(self, load: BlockTransfer) -> None:
        """Load `load`'s blocks in order; from the first that fails on, none is served."""
        failed: set[int] = set()
        for block_hash, block_id in zip(load.block_hashes, load.block_ids):
            if failed:
                failed.add(block_id)
                continue
            try:
                self.store.load(block_hash, block_id, self._caches)
            except BlockFileError as error:
                logger.warning("kvgraph: KV block %s for request %s not loaded (%s); its "
                               "tokens are computed instead", block_hash.hex()[:16],
                               load.request_id, error)
                failed.add(block_id)
        with self._lock:
            self.counts["loaded_tokens"] += (len(load.block_ids) - len(failed)) * self.block_size
            self.counts["load_failures"] += len(failed)
            self._failed_blocks |= failed
            if load.asynchronous:
                self._finished_loads.add(load.request_id)
            elif failed:  # this step computes on the failed blocks: save none of its blocks
                self._failed_requests.add(load.request_id)

    def wait_for_save(self) -> None:
        failed = self._failed_on_any_rank()
        for save in getattr(self.connector_metadata, "saves", ()):
            if save.request_id in failed:
                continue
            for block_hash, block_id in zip(save.block_hashes, save.block_ids):
                if self.store.save(block_hash, block_id, self._caches):
                    self.counts["saved_tokens"] += self.block_size

    def _failed_on_any_rank(self) -> set[str]:
        """This step's requests whose load in the step failed here or on another rank."""
        metadata = self.connector_metadata
        loaded = [load.request_id for load in getattr(metadata, "loads", ())
                  if not load.asynchronous]
        # Every rank has the same metadata: all of them exchange, or none.
        if self._tp_group is None or not (loaded and getattr(metadata, "saves", ())):
            return self._failed_requests
        flags = torch.tensor([r in self._failed_requests for r in loaded], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._tp_group)
        return {r for r, flag in zip(loaded, flags.tolist()) if flag}

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            done, self._finished_loads = self._finished_loads, set()
        return None, done or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def stats(self) -> dict[str, Any]:
        if self.role is KVConnectorRole.SCHEDULER:
            return {"matched_tokens": self.matched_tokens}
        with self._lock:
            counts = dict(self.counts)
        return {**counts, "store_bytes": self.store.nbytes, "evicted_blocks": self.store.evicted,
                "save_failures": self.store.write_failures}

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
            self._loader = None


def _flag(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(name, f"{name}: expected true or false, got {value!r}")
    return value


def _size(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError("max_size_gib", f"max_size_gib: expected a positive number of GiB "
                          f"(or null: no limit), got {value!r}")
    return float(value)
