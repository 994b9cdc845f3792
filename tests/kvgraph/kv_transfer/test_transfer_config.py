"""--kv-transfer-config in vLLM's field names: a valid one gives its connector and role, a wrong
one a ConfigError naming the setting; connectors are found by name, or registered by a module
the config names; the shared-storage connector checks its own settings before making files."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from kvgraph.errors import ConfigError
from kvgraph.kv_transfer import KVConnectorBase, KVConnectorRole, KVTransferConfig, registry
from kvgraph.kv_transfer import create_kv_connector
from kvgraph.kv_transfer.shared_storage import SharedStorageConnector

FIELDS = ["kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path"]


def vllm_json(directory, **changes) -> str:
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"shared_storage_path": str(directory)},
                       **changes})


@pytest.mark.parametrize("role, producer, consumer", [("kv_producer", True, False),
                                                      ("kv_consumer", False, True),
                                                      ("kv_both", True, True)])
def test_vllm_config_reads_with_its_role(tmp_path, role, producer, consumer):
    """vLLM's JSON gives the connector's name, its settings and what its role does."""
    config = KVTransferConfig.from_json(vllm_json(tmp_path / "kv", kv_role=role))
    assert config.kv_connector == "SharedStorageConnector" and config.kv_role == role
    assert config.extra("shared_storage_path") == str(tmp_path / "kv")
    assert config.extra("max_size_gib", 3) == 3 and config.kv_connector_module_path is None
    assert (config.is_producer, config.is_consumer) == (producer, consumer)


def test_role_defaults_to_both():
    """Without kv_role a connector both saves and loads, as in vLLM."""
    config = KVTransferConfig.from_json('{"kv_connector": "SharedStorageConnector"}')
    assert config.kv_role == "kv_both" and config.is_producer and config.is_consumer


BAD_CONFIGS = {  # text -> (the field named, words the message holds)
    '{"kv_connector": ': ("kv_transfer_config", ["not JSON", "kv_connector_extra_config"]),
    '["SharedStorageConnector"]': ("kv_transfer_config", ["expected an object", "list"]),
    '{"kv_connector": "X", "kv_rol": "kv_both"}': ("kv_transfer_config", ["kv_rol", *FIELDS]),
    '{"kv_role": "kv_both"}': ("kv_connector", ["required"]),
    '{"kv_connector": ""}': ("kv_connector", ["''"]),
    '{"kv_connector": 7}': ("kv_connector", ["7"]),
    '{"kv_connector": "X", "kv_role": "both"}':
        ("kv_role", ["'both'", "kv_producer", "kv_consumer", "kv_both"]),
    '{"kv_connector": "X", "kv_connector_extra_config": ["path"]}':
        ("kv_connector_extra_config", ["an object", "['path']"]),
    '{"kv_connector": "X", "kv_connector_module_path": ""}': ("kv_connector_module_path", []),
}


@pytest.mark.parametrize("text", BAD_CONFIGS)
def test_bad_config_names_its_setting(text):
    """Each mistake is a ConfigError whose `field` and message name what is wrong."""
    field, words = BAD_CONFIGS[text]
    with pytest.raises(ConfigError) as info:
        KVTransferConfig.from_json(text)
    assert info.value.field == field
    for word in words:
        assert word in str(info.value)


def test_unknown_connector_lists_the_registered_ones():
    """A name no one registered is refused with the names that are."""
    config = KVTransferConfig("NoSuchConnector")
    with pytest.raises(ConfigError) as info:
        create_kv_connector(config, KVConnectorRole.WORKER, 16)
    assert info.value.field == "kv_connector"
    assert "'NoSuchConnector'" in str(info.value)
    for name in ("SharedStorageConnector", "TorchDistributedConnector", "MooncakeConnector",
                 "NixlConnector"):
        assert name in str(info.value)


def test_module_path_that_cannot_be_imported(tmp_path):
    """A kv_connector_module_path that does not import is a ConfigError naming the module."""
    config = KVTransferConfig("MyConnector", kv_connector_module_path="no_such_kv_module_x")
    with pytest.raises(ConfigError) as info:
        create_kv_connector(config, KVConnectorRole.WORKER, 16)
    assert info.value.field == "kv_connector_module_path"
    assert "no_such_kv_module_x" in str(info.value)


CONNECTOR_MODULE = textwrap.dedent('''
    from kvgraph.kv_transfer import KVConnectorBase, register_kv_connector

    class RecordingConnector(KVConnectorBase):
        def __init__(self, config, role, block_size, shard=None):
            super().__init__(config, role, block_size)
            self.shard = shard

    register_kv_connector("RecordingConnector", RecordingConnector)
''')


def test_module_path_registers_its_own_connector(tmp_path, monkeypatch):
    """The module kv_connector_module_path names is imported first, so the connector it
    registers is built, with the role, block size and context given."""
    (tmp_path / "my_kv_connectors.py").write_text(CONNECTOR_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    # Registration and the import are process-wide: both are put back after the test.
    monkeypatch.setattr(registry, "_factories", dict(registry._factories))
    monkeypatch.delitem(sys.modules, "my_kv_connectors", raising=False)
    with pytest.raises(ConfigError):  # registered by the module's import, not before
        create_kv_connector(KVTransferConfig("RecordingConnector"), KVConnectorRole.WORKER, 16)
    config = KVTransferConfig.from_json(json.dumps({
        "kv_connector": "RecordingConnector", "kv_role": "kv_producer",
        "kv_connector_module_path": "my_kv_connectors"}))
    try:
        connector = create_kv_connector(config, KVConnectorRole.SCHEDULER, 32, shard=3)
    finally:
        sys.modules.pop("my_kv_connectors", None)
    assert type(connector).__name__ == "RecordingConnector"
    assert isinstance(connector, KVConnectorBase) and connector.name == "RecordingConnector"
    assert (connector.role, connector.block_size, connector.shard) == \
        (KVConnectorRole.SCHEDULER, 32, 3)


@pytest.mark.parametrize("extra, load_async, max_bytes", [
    ({}, False, 10 * 2**30),
    ({"max_size_gib": 0.5, "load_async": True}, True, 2**29),
    ({"max_size_gib": None}, False, None),
])
def test_shared_storage_connector_takes_its_settings(tmp_path, extra, load_async, max_bytes):
    """SharedStorageConnector, made by name, keeps its store under shared_storage_path with
    the size limit and load mode asked for (10 GiB and synchronous by default)."""
    config = KVTransferConfig.from_json(vllm_json(tmp_path / "kv"))
    config = KVTransferConfig("SharedStorageConnector", "kv_both",
                              {**config.kv_connector_extra_config, **extra})
    connector = create_kv_connector(config, KVConnectorRole.WORKER, 16, model_key="m/fp32")
    assert isinstance(connector, SharedStorageConnector)
    assert connector.load_async is load_async and connector.store.max_bytes == max_bytes
    assert connector.store.directory.parent == tmp_path / "kv"
    assert connector.store.directory.is_dir() and connector.store.layout.block_size == 16


BAD_SETTINGS = {  # kv_connector_extra_config changes -> the field named
    "no path": ({"shared_storage_path": None}, "shared_storage_path"),
    "empty path": ({"shared_storage_path": ""}, "shared_storage_path"),
    "path not a string": ({"shared_storage_path": 5}, "shared_storage_path"),
    "no model_key": ({"model_key": None}, "model_key"),
    "unknown setting": ({"max_size": 1}, "kv_connector_extra_config"),
    "zero size": ({"max_size_gib": 0}, "max_size_gib"),
    "negative size": ({"max_size_gib": -1}, "max_size_gib"),
    "size a string": ({"max_size_gib": "x"}, "max_size_gib"),
    "size a bool": ({"max_size_gib": True}, "max_size_gib"),
    "load_async a string": ({"load_async": "yes"}, "load_async"),
}


@pytest.mark.parametrize("bad", BAD_SETTINGS)
def test_shared_storage_connector_refuses_bad_settings(tmp_path, bad):
    """A missing or wrong setting is a ConfigError naming it, raised before any file is made."""
    changes, field = BAD_SETTINGS[bad]
    extra = {"shared_storage_path": str(tmp_path / "kv"), "model_key": "m/fp32", **changes}
    config = KVTransferConfig("SharedStorageConnector",
                              kv_connector_extra_config={k: v for k, v in extra.items()
                                                         if v is not None})
    with pytest.raises(ConfigError) as info:
        SharedStorageConnector(config, KVConnectorRole.WORKER, 16)
    assert info.value.field == field
    if field == "kv_connector_extra_config":
        assert "['max_size']" in str(info.value)
        assert all(name in str(info.value) for name in ("shared_storage_path", "load_async"))
    assert not (tmp_path / "kv").exists()


def test_shared_storage_path_that_is_a_file(tmp_path):
    """A shared_storage_path that is a file is refused, naming the path."""
    (tmp_path / "kv").write_text("a file")
    config = KVTransferConfig.from_json(vllm_json(tmp_path / "kv"))
    with pytest.raises(ConfigError, match=str(tmp_path / "kv")):
        SharedStorageConnector(config, KVConnectorRole.WORKER, 16, model_key="m/fp32")
