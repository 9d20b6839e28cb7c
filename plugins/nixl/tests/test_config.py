"""Configuration of both adapter types: the JSON users write, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig

from lmcache_tiers.config import AdapterSpec, parse_adapter_json
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry

STORE_JSON = (
    '{"type": "nixl_store", "backend": "POSIX", "backend_params": '
    '{"file_path": "/data/lmcache/l2", "use_direct_io": "false"}, "pool_size": 64}'
)
DYNAMIC_JSON = (
    '{"type": "nixl_store_dynamic", "backend": "POSIX", "backend_params": {"file_path": '
    '"/data/lmcache/l2", "use_direct_io": "false", "max_capacity_gb": "10", "shard_dirs": "true"}}'
)


def parse(raw: dict[str, object] | str, index: int = 0) -> AdapterSpec:
    text = raw if isinstance(raw, str) else json.dumps(raw)
    return parse_adapter_json(load_registry(), text, index)


def test_users_nixl_store_json_is_accepted() -> None:
    spec = parse(STORE_JSON)
    assert spec.type == "nixl_store"
    config = spec.config
    assert isinstance(config, NixlStoreConfig)
    assert (config.backend, config.pool_size, config.file_path) == ("POSIX", 64, "/data/lmcache/l2")
    assert config.use_direct_io is False
    assert config.nixl_init_params() == {}


def test_users_nixl_store_dynamic_json_is_accepted() -> None:
    config = parse(DYNAMIC_JSON).config
    assert isinstance(config, NixlStoreDynamicConfig)
    assert config.max_capacity_bytes == 10 << 30
    assert config.shard_dirs is True
    assert config.persist_enabled is True
    assert config.use_direct_io is False


def test_dynamic_defaults_and_top_level_persist_flag() -> None:
    raw = json.loads(DYNAMIC_JSON)
    del raw["backend_params"]["shard_dirs"]
    raw["persist_enabled"] = False
    config = parse(raw).config
    assert config.shard_dirs is False
    assert config.persist_enabled is False


def test_common_adapter_options_are_accepted() -> None:
    raw = json.loads(STORE_JSON)
    raw["eviction"] = {"eviction_policy": "LRU", "trigger_watermark": 0.9, "eviction_ratio": 0.1}
    config = parse(raw).config
    assert config.eviction is not None and config.eviction.trigger_watermark == 0.9


@pytest.mark.parametrize("backend", ["GDS", "GDS_MT", "HF3FS"])
def test_other_file_backends_validate_like_posix(backend: str) -> None:
    for text in (STORE_JSON, DYNAMIC_JSON):
        raw = json.loads(text)
        raw["backend"] = backend
        assert parse(raw).config.backend == backend
        del raw["backend_params"]["file_path"]
        with pytest.raises(ConfigError, match="file_path is required"):
            parse(raw)


def test_extra_backend_params_are_kept_for_nixl() -> None:
    raw = json.loads(STORE_JSON)
    raw["backend_params"]["use_uring"] = "true"
    assert parse(raw).config.nixl_init_params() == {"use_uring": "true"}


def test_object_backends_take_no_file_path() -> None:
    obj = parse({"type": "nixl_store", "backend": "OBJ", "backend_params": {"bucket": "kv"}, "pool_size": 8})
    assert obj.config.nixl_init_params() == {"bucket": "kv"}
    azure = parse(
        {
            "type": "nixl_store",
            "backend": "AZURE_BLOB",
            "backend_params": {"account_url": "https://a.blob.core.windows.net", "container_name": "kv"},
            "pool_size": 8,
        }
    )
    assert azure.config.backend == "AZURE_BLOB"


REFUSALS = [
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false"},
            "pool_size": 0,
        },
        "pool_size",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false"},
        },
        "pool_size",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "backend_params": {"use_direct_io": "false"},
            "pool_size": 4,
        },
        "file_path is required",
    ),
    (
        {"type": "nixl_store", "backend": "POSIX", "backend_params": {"file_path": "/x"}, "pool_size": 4},
        "use_direct_io is required",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "yes"},
            "pool_size": 4,
        },
        'use_direct_io must be "true" or "false"',
    ),
    (
        {
            "type": "nixl_store",
            "backend": "posix",
            "backend_params": {"file_path": "/x", "use_direct_io": "false"},
            "pool_size": 4,
        },
        "did you mean 'POSIX'",
    ),
    (
        {"type": "nixl_store", "backend": "NFS", "backend_params": {}, "pool_size": 4},
        "backend must be one of POSIX, GDS, GDS_MT, HF3FS, OBJ, AZURE_BLOB",
    ),
    (
        {"type": "nixl_store", "backend": "OBJ", "backend_params": {"file_path": "/x"}, "pool_size": 4},
        "file_path does not apply to the OBJ backend",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "AZURE_BLOB",
            "backend_params": {"container_name": "c"},
            "pool_size": 4,
        },
        "account_url is required",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "AZURE_BLOB",
            "backend_params": {"account_url": "https://a"},
            "pool_size": 4,
        },
        "container_name is required",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false", "max_capacity_gb": "1"},
            "pool_size": 4,
        },
        "applies to nixl_store_dynamic only",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false"},
            "pool_size": 4,
            "persist_enabled": True,
        },
        "unknown field `persist_enabled`",
    ),
    (
        {
            "type": "nixl_store",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": 0},
            "pool_size": 4,
        },
        "backend_params",
    ),
    (
        {"type": "nixl_store_dynamic", "backend": "OBJ", "backend_params": {"bucket": "b"}},
        "backend 'OBJ' is not supported by nixl_store_dynamic, which stores one file per object",
    ),
    (
        {"type": "nixl_store_dynamic", "backend": "AZURE_BLOB", "backend_params": {}},
        "not supported by nixl_store_dynamic",
    ),
    (
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false"},
        },
        "max_capacity_gb is required",
    ),
    (
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false", "max_capacity_gb": "ten"},
        },
        "max_capacity_gb must be a number",
    ),
    (
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false", "max_capacity_gb": "-1"},
        },
        "max_capacity_gb must be a positive number",
    ),
    (
        # positive, yet 0 bytes once converted: a cache that refuses every store
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false", "max_capacity_gb": "1e-10"},
        },
        "max_capacity_gb 1e-10 is under one byte",
    ),
    (
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {
                "file_path": "/x",
                "use_direct_io": "false",
                "max_capacity_gb": "1",
                "shard_dirs": "2",
            },
        },
        "shard_dirs must be",
    ),
    (
        {
            "type": "nixl_store_dynamic",
            "backend": "POSIX",
            "backend_params": {"file_path": "/x", "use_direct_io": "false", "max_capacity_gb": "1"},
            "pool_size": 3,
        },
        "unknown field `pool_size`",
    ),
]


@pytest.mark.parametrize(("raw", "message"), REFUSALS)
def test_bad_configs_are_refused_with_adapter_name_and_path(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(raw, index=2)
    text = str(caught.value)
    assert message in text
    assert text.startswith(str(raw["type"]) + ":")
    assert "$.l2_adapters[2]" in text


def _dynamic_at(file_path: str) -> dict[str, object]:
    return {
        "type": "nixl_store_dynamic",
        "backend": "POSIX",
        "backend_params": {"file_path": file_path, "use_direct_io": "false", "max_capacity_gb": "1"},
    }


@pytest.mark.parametrize("suffix", ["ab/cd", "ab/cd/", "0f/9e"])
def test_a_directory_shaped_like_a_shard_directory_is_refused(tmp_path: Path, suffix: str) -> None:
    """``<outer>/ab/cd`` cannot be told from a shard directory of a sharded fs or
    nixl_store_dynamic store at ``<outer>``: that store's listing would account these
    records, its start-up sweep remove the writes in flight, and its removal of every
    record (``persist_enabled: false``) the acknowledged ones."""
    with pytest.raises(ConfigError, match=r"named like a shard directory") as caught:
        parse(_dynamic_at(f"{tmp_path}/{suffix}"))
    assert "backend_params.file_path" in str(caught.value)


@pytest.mark.parametrize("suffix", ["ab", "ab/cd/kv", "ab/xy", "AB/CD"])
def test_directories_not_shaped_like_a_shard_directory_are_accepted(tmp_path: Path, suffix: str) -> None:
    spec = parse(_dynamic_at(f"{tmp_path}/{suffix}"))
    assert isinstance(spec.config, NixlStoreDynamicConfig)
    assert spec.config.file_path == f"{tmp_path}/{suffix}"


def test_a_symlink_to_a_shard_shaped_directory_is_refused(tmp_path: Path) -> None:
    """The check looks at the directory the path resolves to, as the store's files do."""
    shard = tmp_path / "outer" / "ab" / "cd"
    shard.mkdir(parents=True)
    link = tmp_path / "cache"
    link.symlink_to(shard)
    with pytest.raises(ConfigError, match=r"named like a shard directory \(ab/cd\)"):
        parse(_dynamic_at(str(link)))


@pytest.mark.parametrize(
    "connection_string",
    ["AccountKey=c2VjcmV0LWtleQ==;Garbage", "DefaultEndpointsProtocol=http;AccountKey=c2VjcmV0LWtleQ=="],
)
def test_an_azure_connection_string_naming_no_service_is_refused_unquoted(connection_string: str) -> None:
    # Neither BlobEndpoint nor AccountName: no address of the blob service can be derived
    # (the probe would have asked for "https://.blob.core.windows.net").
    raw = {
        "type": "nixl_store",
        "backend": "AZURE_BLOB",
        "backend_params": {"connection_string": connection_string, "container_name": "c"},
        "pool_size": 4,
    }
    with pytest.raises(ConfigError) as caught:
        parse(raw)
    text = str(caught.value)
    assert text.startswith(
        "nixl_store: backend_params.connection_string names neither BlobEndpoint nor AccountName"
    )
    assert "$.l2_adapters[0].backend_params.connection_string" in text
    assert "c2VjcmV0" not in text


def test_an_azure_connection_string_naming_its_account_or_endpoint_is_accepted() -> None:
    for connection_string in (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=k;EndpointSuffix=core.windows.net",
        "AccountName=devstoreaccount1;AccountKey=k;BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;",
        "BlobEndpoint=https://acct.blob.core.windows.net/;SharedAccessSignature=sv=1&sig=s",
    ):
        raw = {
            "type": "nixl_store",
            "backend": "AZURE_BLOB",
            "backend_params": {"connection_string": connection_string, "container_name": "c"},
            "pool_size": 4,
        }
        assert parse(raw).config.string_params["connection_string"] == connection_string
