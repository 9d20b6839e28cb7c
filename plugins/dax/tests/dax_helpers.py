"""Shared helpers of the dax tests: mapped files in /dev/shm, adapters, blocking calls."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcache_plugin_dax import DaxConfig
from lmcache_plugin_dax.backend import DaxBackend
from lmcache_plugin_dax.layout import ENTRY_BYTES, SUPERBLOCK_BYTES

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.blocking import BlockingAdapterClient

SLOT = 64 << 10


def size_gb(slots: int, slot_bytes: int = SLOT) -> float:
    """A mapping of exactly ``slots`` slots (a superblock and an entry per slot before them)."""
    return (SUPERBLOCK_BYTES + slots * (ENTRY_BYTES + slot_bytes)) / (1 << 30)


@contextmanager
def shm_dir() -> Iterator[Path]:
    directory = Path(tempfile.mkdtemp(prefix="lmcache-dax-test-", dir="/dev/shm"))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def config(path: Path | str, slots: int = 16, **extra: Any) -> DaxConfig:
    return DaxConfig(device_path=str(path), max_dax_size_gb=size_gb(slots), slot_bytes=SLOT, **extra)


def open_dax(cfg: DaxConfig, serde: tuple[Serde, ...] = ()) -> BackendAdapter:
    adapter = create_adapter(DaxBackend, cfg, AdapterContext(index=0, name="0:dax", config=cfg, serde=serde))
    assert isinstance(adapter, BackendAdapter)
    return adapter


def backend_of(adapter: BackendAdapter) -> DaxBackend:
    backend = adapter.backend
    assert isinstance(backend, DaxBackend)
    return backend


def client(adapter: Any) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


def store(adapter: Any, keys: Sequence[ObjectKey], data: Sequence[bytes]) -> list[bool]:
    return client(adapter).store(keys, [memoryview(bytearray(d)) for d in data])


def load(adapter: Any, keys: Sequence[ObjectKey], sizes: Sequence[int]) -> tuple[list[bool], list[bytes]]:
    result = client(adapter).lookup_and_lock(keys)
    buffers = [memoryview(bytearray(size)) for size in sizes]
    loaded = client(adapter).load(keys, buffers)
    adapter.unlock([key for key, hit in zip(keys, result.found, strict=True) if hit])
    return loaded, [bytes(b) for b in buffers]


def flip_byte(path: Path | str, offset: int) -> None:
    with open(path, "r+b") as device:
        device.seek(offset)
        byte = device.read(1)
        device.seek(offset)
        device.write(bytes([byte[0] ^ 0xFF]))
