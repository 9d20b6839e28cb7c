"""Helpers of the dax tests: mapped files in /dev/shm, configs, adapters (and, from
raw_block's slot_helpers, blocking calls, damage, eviction)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcache_plugin_dax import DaxConfig
from lmcache_plugin_dax.backend import DaxBackend
from lmcache_plugin_dax.layout import ENTRY_BYTES, SUPERBLOCK_BYTES
from slot_helpers import client, flip_byte, load, store

from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.serde import Serde

__all__ = ["backend_of", "client", "config", "flip_byte", "load", "open_dax", "shm_dir", "size_gb", "store"]

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
