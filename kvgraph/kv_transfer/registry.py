"""Connectors by name: kvgraph's own are registered here; others register themselves."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from kvgraph.errors import ConfigError
from kvgraph.kv_transfer.base import KVConnectorBase, KVConnectorRole
from kvgraph.kv_transfer.config import KVTransferConfig

ConnectorFactory = Callable[..., KVConnectorBase]

_factories: dict[str, Callable[[], type[KVConnectorBase]]] = {}


def register_kv_connector(name: str, connector: type[KVConnectorBase] | Callable[[], type]
                          ) -> None:
    """Make `name` a `kv_connector` value: a KVConnectorBase subclass, or a function returning
    one (imported on first use)."""
    if isinstance(connector, type):
        _factories[name] = lambda: connector
    else:
        _factories[name] = connector


def kv_connector_class(config: KVTransferConfig) -> type[KVConnectorBase]:
    """The class `config.kv_connector` names (its module imported first, when given)."""
    if config.kv_connector_module_path:
        try:
            importlib.import_module(config.kv_connector_module_path)
        except ImportError as error:
            raise ConfigError("kv_connector_module_path", f"kv_connector_module_path "
                              f"{config.kv_connector_module_path!r} cannot be imported: "
                              f"{error}") from error
    factory = _factories.get(config.kv_connector)
    if factory is None:
        raise ConfigError("kv_connector", f"unknown kv_connector {config.kv_connector!r}; "
                          f"registered: {sorted(_factories)} (register_kv_connector adds one)")
    return factory()


def create_kv_connector(config: KVTransferConfig, role: KVConnectorRole, block_size: int,
                        **context: Any) -> KVConnectorBase:
    """A connector of `config`'s kind for `role`; `context` is what the connector's constructor
    takes besides (the shared-storage connector's `model_key`, ...)."""
    return kv_connector_class(config)(config, role, block_size, **context)


def _shared_storage() -> type[KVConnectorBase]:
    from kvgraph.kv_transfer.shared_storage import SharedStorageConnector

    return SharedStorageConnector


def _torch_distributed() -> type[KVConnectorBase]:
    from kvgraph.kv_transfer.torch_distributed import TorchDistributedConnector

    return TorchDistributedConnector


def _mooncake() -> type[KVConnectorBase]:
    from kvgraph.kv_transfer.mooncake import MooncakeConnector

    return MooncakeConnector


def _nixl() -> type[KVConnectorBase]:
    from kvgraph.kv_transfer.nixl import NixlConnector

    return NixlConnector


register_kv_connector("SharedStorageConnector", _shared_storage)
register_kv_connector("NixlConnector", _nixl)
register_kv_connector("MooncakeConnector", _mooncake)
register_kv_connector("TorchDistributedConnector", _torch_distributed)
