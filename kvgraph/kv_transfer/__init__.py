"""KV connectors: what saves, loads and moves each layer's KV cache tuple (see base.py)."""

from kvgraph.kv_transfer.base import (
    ConnectorRequest,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    ScheduledChunk,
)
from kvgraph.kv_transfer.block_hashes import BlockHash, chain_hashes
from kvgraph.kv_transfer.config import KVTransferConfig
from kvgraph.kv_transfer.registry import (
    create_kv_connector,
    kv_connector_class,
    register_kv_connector,
)

__all__ = [
    "BlockHash",
    "ConnectorRequest",
    "KVConnectorBase",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorRole",
    "KVTransferConfig",
    "ScheduledChunk",
    "chain_hashes",
    "create_kv_connector",
    "kv_connector_class",
    "register_kv_connector",
]
