"""`--kv-transfer-config`: the KV connector an engine runs (kvgraph.kv_transfer), in vLLM's JSON.

    --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'

The engine names the model for the connector (`model_key`): the example's preset and seed, or
the checkpoint's files (names, sizes, modification times), with the dtype. Blocks saved by one
model are then never loaded into another, and a prefill and a decode server of different
models refuse to pair. (Checkpoint files on two hosts must then have equal modification times:
give both the same `model_key` in the config otherwise.) With tensor parallelism each rank
builds its own worker side with its rank (its own shard's files, or its own side channel).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from kvgraph.errors import ConfigError
from kvgraph.kv_transfer import (
    KVConnectorBase,
    KVConnectorRole,
    KVTransferConfig,
    create_kv_connector,
)

# kvgraph's own connectors: they take the engine's model_key and the TP rank. Another gets only
# what every connector gets (it may read its rank from kvgraph.distributed).
KVGRAPH_CONNECTORS = ("SharedStorageConnector", "TorchDistributedConnector",
                      "MooncakeConnector", "NixlConnector")


def transfer_config(text: str) -> KVTransferConfig:
    """argparse's type for the flag: the config, or a usage error saying what is wrong."""
    try:
        return KVTransferConfig.from_json(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_kv_transfer_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--kv-transfer-config", type=transfer_config, metavar="JSON",
                       help="a KV connector, in vLLM's fields: kv_connector (e.g. "
                       "SharedStorageConnector: prompt blocks saved to, and loaded from, "
                       "kv_connector_extra_config.shared_storage_path, so a restart or another "
                       "process on the host skips their prefill), kv_role (kv_producer, "
                       "kv_consumer or kv_both) and kv_connector_extra_config")


def model_key(args: argparse.Namespace, models: Mapping[str, Any]) -> str:
    """A name for the weights `--model` loads and the cache dtype: what KV blocks depend on."""
    if args.model in models:
        source: Any = {"example": args.model, "preset": args.preset, "seed": args.seed}
    else:
        root = Path(args.model).resolve()
        source = {"checkpoint": str(root), "files": sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir()
            if p.is_file())}
    text = json.dumps({**source, "dtype": args.dtype}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def kv_connector(args: argparse.Namespace, models: Mapping[str, Any], role: KVConnectorRole,
                 block_size: int, tp_rank: int = 0, tp_size: int = 1
                 ) -> KVConnectorBase | None:
    """The connector `--kv-transfer-config` asks for, in `role`, for tensor-parallel rank
    `tp_rank` of `tp_size` (the scheduler side is rank 0's); None without the flag."""
    config = getattr(args, "kv_transfer_config", None)
    if config is None:
        return None
    if config.kv_connector not in KVGRAPH_CONNECTORS:
        return create_kv_connector(config, role, block_size)
    context: dict[str, Any] = {"tp_rank": tp_rank, "tp_size": tp_size}
    if "model_key" not in config.kv_connector_extra_config:  # the config's own wins
        context["model_key"] = model_key(args, models)
    return create_kv_connector(config, role, block_size, **context)
