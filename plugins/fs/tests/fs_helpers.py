"""Shared helpers of the fs plugin tests: configs, adapters, arenas, files on disk."""

from __future__ import annotations

import os
from typing import Any

import msgspec
from lmcache_plugin_fs import FsConfig
from lmcache_plugin_fs.backend import FsBackend

from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.files import AlignedArena, flip_byte, load_data, store_data

HEADER = 4096


def fs_config(root: str, **fields: Any) -> FsConfig:
    return msgspec.convert({"path": root, **fields}, FsConfig)


def open_fs(
    config: FsConfig, arena: memoryview | None = None, serde: tuple[Serde, ...] = ()
) -> BackendAdapter:
    facts = AdapterContext(index=0, name="0:fs-test", config=config, serde=serde, l1_buffer=arena)
    adapter = create_adapter(FsBackend, config, facts)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def client(adapter: Any) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


Arena = AlignedArena


store = store_data
load = load_data
__all__ = [
    "HEADER",
    "Arena",
    "client",
    "flip_byte",
    "fs_config",
    "load",
    "open_fs",
    "payload_bytes_on_disk",
    "record_files",
    "store",
]


def record_files(root: str) -> list[str]:
    """Every record file under root, relative to it."""
    return sorted(
        os.path.relpath(os.path.join(directory, name), root)
        for directory, _dirs, files in os.walk(root)
        for name in files
        if name.endswith(".bin")
    )


def payload_bytes_on_disk(root: str) -> int:
    return sum(os.path.getsize(os.path.join(root, path)) - HEADER for path in record_files(root))
