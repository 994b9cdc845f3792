"""KVConnectorBase: what saves, loads and moves each layer's KV cache tuple, in two roles.

Shaped after vLLM's KVConnectorBase_V1, so a connector author recognises it, but typed for
kvgraph's caches: one tuple of tensors per layer, by layer name (`(key, value)`, or MLA's
`(kv_c, k_pe)`), `num_blocks` first in every tensor, so a block id names the same bytes in each.

The **scheduler side** (one per engine) decides, per request, how many of its tokens a
connector can supply (`get_num_new_matched_tokens`), is told the blocks allocated for them
(`update_state_after_alloc`), builds one `KVConnectorMetadata` per step for the workers
(`build_connector_meta`), hears what the workers finished (`update_connector_output`) and says,
when a request ends, whether its blocks must stay held while they are still being sent
(`request_finished`).

The **worker side** (one per runner) is given the caches once (`register_kv_caches`), then per
step: the metadata (`bind_connector_metadata`), `start_load_kv` before the forward,
`wait_for_layer_load(layer)` before each layer's attention and `save_kv_layer(layer, ...)` after
it (only for a `layerwise` connector: the attention ops call them), `wait_for_save` after the
forward, and `get_finished` / `get_block_ids_with_load_errors` for the step's report.

A layer-by-layer connector cannot run inside a full device graph: no Python runs at replay,
so its per-layer calls would be skipped. A runner given one resolves full graph modes to
piecewise (see kvgraph.runtime.dispatcher.resolve_for_kv_connector). A connector that loads
whole requests before the step and saves after it keeps full graphs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from kvgraph.kv_cache.spec import KVCache
from kvgraph.kv_transfer.config import KVTransferConfig


class KVConnectorRole(enum.Enum):
    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorMetadata:
    """What a connector's scheduler side tells its workers for one step (subclassed by each
    connector; it must pickle, as it crosses to other processes)."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step: requests whose asynchronous sends or loads
    finished, and blocks whose load failed (their tokens must be computed)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)

    @property
    def empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


class ConnectorRequest(Protocol):
    """What the scheduler side reads of a request (the example engine's Request is one)."""

    request_id: str
    prompt_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt and output tokens so far."""


class ScheduledChunk(Protocol):
    """`num_tokens` of `request`'s tokens from its `num_computed_tokens` on run in this step."""

    request: ConnectorRequest
    num_tokens: int


class KVConnectorBase:
    """The base of every KV connector: both roles' calls, each a no-op by default.

    `layerwise` (class attribute): whether the connector works inside the forward, layer by
    layer (its `wait_for_layer_load` and `save_kv_layer` are called). `block_size` is the
    cache's tokens per block, which the scheduler side needs to speak in blocks.
    """

    layerwise = False

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, block_size: int):
        self.config = config
        self.role = role
        self.block_size = block_size
        self._metadata: KVConnectorMetadata | None = None

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        """Refuse (ConfigError) settings this connector cannot run, touching nothing: what a
        server checks before it loads a model. The constructor checks them too."""

    @property
    def name(self) -> str:
        return self.config.kv_connector

    # --- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, KVCache]) -> None:
        """The runner's caches, by layer name, once, before any step (their addresses hold)."""

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        self._metadata = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @property
    def connector_metadata(self) -> KVConnectorMetadata | None:
        """This step's metadata (bound by the runner before the step, cleared after)."""
        return self._metadata

    def start_load_kv(self, attn_metadata: Any) -> None:
        """Before the step's forward: start (or do) the loads this step's metadata asks for."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before `layer_name`'s attention reads its cache (layerwise connectors only)."""

    def save_kv_layer(self, layer_name: str, kv_cache: KVCache, attn_metadata: Any) -> None:
        """After `layer_name`'s attention wrote its cache (layerwise connectors only)."""

    def wait_for_save(self) -> None:
        """After the step's forward: finish (or start) the saves this step's metadata asks for."""

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous sends, and loads, are done since the last call."""
        return None, None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks this step (or an asynchronous load) failed to load: recompute their tokens."""
        return set()

    # --- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        """How many tokens after the first `num_computed_tokens` the connector can supply
        (None: ask again later), and whether it loads them asynchronously (the request then
        waits, not running, until its load is reported finished)."""
        return 0, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None:
        """`request` now holds `block_ids`; the connector supplies `num_external_tokens` tokens
        into them from its `num_computed_tokens` on."""

    def build_connector_meta(self, scheduled: Sequence[ScheduledChunk]) -> KVConnectorMetadata:
        """The workers' metadata for a step that runs `scheduled` (called once per step)."""
        return KVConnectorMetadata()

    def has_pending_work(self) -> bool:
        """Whether the scheduler side has something for the workers even with no request to
        run (the engine then steps, so it is delivered): False by default."""
        return False

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """What the workers reported for the last step."""

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """`request` ended: whether its blocks must stay held until `get_finished` reports it
        sent, and parameters for whoever continues it (disaggregated prefill)."""
        return False, None

    def stats(self) -> dict[str, Any]:
        """Counts for /metrics and stats(): the base has none."""
        return {}

    def close(self) -> None:
        """Finish pending work and let go of files and threads."""
