"""`--kv-transfer-config`: the KV connector an engine runs (kvgraph.kv_transfer), in vLLM's JSON.

    --kv-transfer-config '{"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"shared_storage_path": "/tmp/kv"}}'

The engine names the model for the connector (`model_key`): the example's preset and seed, or
the checkpoint's files (names, sizes, modification times), with the dtype. Blocks saved by one
model are then never loaded into another, and a prefill and a decode server of different
models refuse to pair. (Checkpoint files on two hosts must then have equal modification times:
give both the same `model_key` in the config otherwise.)
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
                 block_size: int) -> KVConnectorBase | None:
    """The connector `--kv-transfer-config` asks for, in `role`; None without the flag."""
    config = getattr(args, "kv_transfer_config", None)
    if config is None:
        return None
    context = {"model_key": model_key(args, models)} if _takes_model_key(config) else {}
    return create_kv_connector(config, role, block_size, **context)


def _takes_model_key(config: KVTransferConfig) -> bool:
    """Whether to pass the engine's model_key: kvgraph's own connectors take one (unless their
    config names its own); other connectors get only what every connector gets."""
    return (config.kv_connector in ("SharedStorageConnector", "TorchDistributedConnector",
                                    "MooncakeConnector")
            and "model_key" not in config.kv_connector_extra_config)
