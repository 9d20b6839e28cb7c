"""Helpers of the s3 plugin's tests: configs for the test server, adapters, raw access."""

from __future__ import annotations

import uuid
from typing import Any

import s3fs
from lmcache_plugin_s3 import S3Config
from lmcache_plugin_s3.records import ObjectNames

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.seaweedfs import SeaweedS3

#: the bucket the tests share; each test works under a prefix of its own
BUCKET = "tiers-s3-tests"


def fresh_prefix(tag: str) -> str:
    return f"{tag}/{uuid.uuid4().hex}"


def s3_config(server: SeaweedS3, prefix: str, **fields: Any) -> S3Config:
    """A config for ``server`` with its static keys (tests leave the environment alone)."""
    settings: dict[str, Any] = {
        "bucket": BUCKET,
        "prefix": prefix,
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        **fields,
    }
    return S3Config(**settings)


def open_adapter(config: S3Config, l1: memoryview, index: int = 0) -> L2Adapter:
    """An ``s3`` adapter built the way the StorageManager builds one."""
    registry = load_registry()
    factory = registry.get(Kind.L2_ADAPTER, "s3").load()
    context = AdapterContext(index=index, name=f"{index}:s3", config=config, l1_buffer=l1)
    return create_adapter(factory, config, context, registry=registry, type_name="s3")


def blocking(adapter: L2Adapter, timeout: float = 60.0) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=timeout)


_RAW_CLIENTS: dict[str, s3fs.S3FileSystem] = {}


class Raw:
    """Direct access to the test bucket, past the adapter: what another writer could do."""

    def __init__(self, server: SeaweedS3, prefix: str) -> None:
        # One client per server for the whole session: each one made and dropped would
        # be torn down by the garbage collector on a loop of its own, noisily.
        self.fs = _RAW_CLIENTS.get(server.endpoint)
        if self.fs is None:
            self.fs = _RAW_CLIENTS[server.endpoint] = s3fs.S3FileSystem(
                key=server.access_key,
                secret=server.secret_key,
                endpoint_url=server.endpoint,
                skip_instance_cache=True,
            )
        self.names = ObjectNames(prefix)

    def path(self, key_or_name: ObjectKey | str) -> str:
        name = key_or_name if isinstance(key_or_name, str) else self.names.of(key_or_name)
        return f"{BUCKET}/{name}"

    def read(self, key: ObjectKey | str) -> bytes:
        return bytes(self.fs.cat_file(self.path(key)))

    def write(self, key: ObjectKey | str, data: bytes) -> None:
        self.fs.pipe_file(self.path(key), data)

    def exists(self, key: ObjectKey | str) -> bool:
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self.path(key)))
