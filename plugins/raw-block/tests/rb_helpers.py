"""Shared helpers of the raw_block tests: configs, adapters, blocking calls, a simulated crash."""

from __future__ import annotations

import mmap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import RawBlockBackend

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.blocking import BlockingAdapterClient

SLOT = 64 << 10
HEADER = 4096
PAYLOAD = SLOT - HEADER


def config(path: Path | str, slots: int = 16, *, slot_bytes: int = SLOT, **extra: Any) -> RawBlockConfig:
    """A config whose device holds exactly ``slots`` slots (metadata sized by the adapter)."""
    meta = 4096 + 2 * (64 << 10)  # the adapter's sizing for up to 120 slots
    assert slots <= 120
    return RawBlockConfig(
        device_path=str(path), slot_bytes=slot_bytes, capacity_bytes=meta + slots * slot_bytes, **extra
    )


def open_raw(cfg: RawBlockConfig, serde: tuple[Serde, ...] = ()) -> BackendAdapter:
    adapter = create_adapter(
        RawBlockBackend, cfg, AdapterContext(index=0, name="0:raw_block", config=cfg, serde=serde)
    )
    assert isinstance(adapter, BackendAdapter)
    return adapter


def backend_of(adapter: BackendAdapter) -> RawBlockBackend:
    backend = adapter.backend
    assert isinstance(backend, RawBlockBackend)
    return backend


def client(adapter: Any) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


class Arena:
    """Page-aligned stand-in for the L1 arena (its extents are aligned, so O_DIRECT moves
    them in place); ``take`` hands out 4096-aligned slices."""

    def __init__(self, size: int = 16 << 20) -> None:
        self._map = mmap.mmap(-1, size)
        self.view = memoryview(self._map)
        self._offset = 0

    def take(self, size: int) -> memoryview:
        start = -(-self._offset // 4096) * 4096
        if start + size > self.view.nbytes:
            self._offset = start = 0  # wrap: tests keep what they need in bytes
        self._offset = start + size
        return self.view[start : start + size]

    def filled(self, data: bytes) -> memoryview:
        view = self.take(len(data))
        view[:] = data
        return view


def store(
    adapter: Any, keys: Sequence[ObjectKey], data: Sequence[bytes], arena: Arena | None = None
) -> list[bool]:
    """Store from aligned arena slices, or from plain (unaligned) bytearrays."""
    buffers = [arena.filled(d) if arena else memoryview(bytearray(d)) for d in data]
    return client(adapter).store(keys, buffers)


def load(
    adapter: Any, keys: Sequence[ObjectKey], sizes: Sequence[int], arena: Arena | None = None
) -> tuple[list[bool], list[bytes]]:
    """Look up, load into fresh buffers and unlock; (loaded, contents)."""
    result = client(adapter).lookup_and_lock(keys)
    buffers = [arena.take(size) if arena else memoryview(bytearray(size)) for size in sizes]
    loaded = client(adapter).load(keys, buffers)
    adapter.unlock([key for key, hit in zip(keys, result.found, strict=True) if hit])
    return loaded, [bytes(b) for b in buffers]


def crash(adapter: BackendAdapter) -> None:
    """End the adapter the way a killed process leaves the device: no final checkpoint.

    Nothing is in flight when it is called, so what is on the device is exactly what a
    SIGKILL at this moment leaves there; the real kill is in test_crash.
    """
    backend_of(adapter).checkpoint = lambda force=False: False  # type: ignore[method-assign]
    adapter.close()


def flip_byte(path: Path | str, offset: int) -> None:
    with open(path, "r+b") as device:
        device.seek(offset)
        byte = device.read(1)
        device.seek(offset)
        device.write(bytes([byte[0] ^ 0xFF]))
