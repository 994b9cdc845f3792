"""KVTransferConfig: which KV connector a server runs and how, in vLLM's field names."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvgraph.config_checks import json_object
from kvgraph.errors import ConfigError

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector's name, role and its own settings, checked on construction.

    `kv_connector` names a registered connector (`register_kv_connector`);
    `kv_connector_module_path`, when given, is imported first, so a connector of one's own
    registers itself there. `kv_role`: a producer saves (or sends) the blocks it computes, a
    consumer loads (or receives) them, `kv_both` does both. `kv_connector_extra_config` is the
    connector's own, read by it (the shared-storage connector's `shared_storage_path`, ...).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kv_connector, str) or not self.kv_connector:
            raise ConfigError("kv_connector", f"kv_connector: expected a connector's name, got "
                              f"{self.kv_connector!r}")
        if self.kv_role not in KV_ROLES:
            raise ConfigError("kv_role", f"kv_role: expected one of {list(KV_ROLES)}, got "
                              f"{self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, Mapping):
            raise ConfigError("kv_connector_extra_config", "kv_connector_extra_config: expected "
                              f"an object, got {self.kv_connector_extra_config!r}")
        path = self.kv_connector_module_path
        if path is not None and (not isinstance(path, str) or not path):
            raise ConfigError("kv_connector_module_path", "kv_connector_module_path: expected "
                              f"a module name, got {path!r}")

    @property
    def is_producer(self) -> bool:
        """Whether this side saves (or sends) the blocks it computes."""
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        """Whether this side loads (or receives) blocks it did not compute."""
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, name: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(name, default)

    @classmethod
    def from_json(cls, text: str) -> KVTransferConfig:
        """The config a `--kv-transfer-config` JSON object describes; a ConfigError naming what
        is wrong with it."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError("kv_transfer_config", f"not JSON ({error}); "
                              'expected e.g. {"kv_connector": "SharedStorageConnector", '
                              '"kv_role": "kv_both", "kv_connector_extra_config": '
                              '{"shared_storage_path": "/tmp/kv"}}') from None
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, value: Any) -> KVTransferConfig:
        json_object("kv_transfer_config", "kv transfer config", value,
                    [f.name for f in fields(cls)])
        if "kv_connector" not in value:
            raise ConfigError("kv_connector", "kv transfer config: kv_connector is required")
        return cls(**value)
