"""Test helpers of both slot stores, raw_block and dax (whose tests put this directory on
their path too): blocking calls, buffers, damage, eviction, a size-changing serde."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.testing.blocking import BlockingAdapterClient


def client(adapter: Any) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


class Arena:
    """Page-aligned stand-in for the L1 arena (its extents are aligned, so O_DIRECT moves
    them in place); ``take`` hands out 4096-aligned slices, wrapping when full."""

    def __init__(self, size: int = 16 << 20) -> None:
        self._map = mmap.mmap(-1, size)
        self.view = memoryview(self._map)
        self._offset = 0

    def take(self, size: int) -> memoryview:
        start = -(-self._offset // 4096) * 4096
        if start + size > self.view.nbytes:
            start = 0  # tests copy out what they keep
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


def flip_byte(path: Path | str, offset: int) -> None:
    with open(path, "r+b") as device:
        device.seek(offset)
        byte = device.read(1)
        device.seek(offset)
        device.write(bytes([byte[0] ^ 0xFF]))


def as_newer_format(slot_header: bytes, identity: bytes, slot: int) -> bytes:
    """``slot_header`` (an intact one of ``slot`` on the device of ``identity``) with its
    record header turned into one of a newer format version, intact: what a newer server
    sharing the device before a downgrade leaves in its slots."""
    from lmcache_plugin_raw_block.slotheader import decode_slot_header, encode_slot_header

    header = decode_slot_header(slot_header, identity, slot)
    assert header is not None
    record = bytearray(header.record)
    record[4:6] = (99).to_bytes(2, "little")  # the record format version
    record[-4:] = zlib.crc32(bytes(record[:-4])).to_bytes(4, "little")  # its header crc
    rewritten = encode_slot_header(
        identity, slot, header.seq, header.key, header.stored, header.l1, bytes(record)
    )
    return rewritten + bytes(len(slot_header) - len(rewritten))


def lru_controller(adapter: L2Adapter, watermark: float, ratio: float) -> L2EvictionController:
    """The real per-adapter eviction controller with the installed LRU policy (tests run
    its cycles by calling ``evict`` or ``step``, not by its thread)."""
    eviction = L2EvictionConfig(eviction_policy="LRU", trigger_watermark=watermark, eviction_ratio=ratio)
    component = load_registry().get(Kind.EVICTION_POLICY, "LRU")
    policy = component.create(component.config())
    return L2EvictionController(AdapterSlot(0, adapter.name, adapter), policy, eviction, EngineStats(1))


class ZlibSerde:
    """A size-changing serde: after a restart the L1 size must come from the slot header."""

    name = "test-zlib"

    def encode(self, data: memoryview, context: object) -> bytes:
        return zlib.compress(data)

    def decode(self, data: memoryview, context: object) -> bytes:
        return zlib.decompress(data)


def plugins_show_rows(plugin: str) -> dict[str, str]:
    """``lmcache-tiers plugins show PLUGIN``: each field's table row, by field name."""
    result = subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", "plugins", "show", plugin],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "400"},
    )
    assert result.returncode == 0, result.stderr
    return {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") > 2}


@contextmanager
def small_tmpfs(size: str) -> Iterator[str]:
    """A tmpfs of ``size`` mounted on a fresh directory (root only: skipped with the
    reason otherwise); unmounted afterwards."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    directory = tempfile.mkdtemp(prefix="lmcache-slot-tmpfs-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", directory], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", directory], check=False)
        os.rmdir(directory)


def check_an_object_replaced_by_another_size_is_a_counted_miss(adapter: Any, caplog: Any) -> None:
    """The lookup said 1000 bytes, then the key's object was replaced by one of 2000 (as a
    store racing the load does): the load of a 1000-byte buffer is a miss, counted and
    logged, and the object stays (a lookup now says its new size)."""
    from lmcache_tiers.testing.l2 import make_keys

    (key,) = make_keys(1)
    assert store(adapter, [key], [b"a" * 1000]) == [True]
    found = client(adapter).lookup_and_lock([key])
    assert found.found == [True]
    backend = adapter.backend
    newer = memoryview(bytearray(b"b" * 2000))
    assert backend.put_many([key], [newer]) == [True]
    buffer = memoryview(bytearray(1000))
    assert backend.get_many_into([key], [buffer]) == [False]
    adapter.unlock([key])
    assert bytes(buffer) == bytes(1000), "nothing is read into a buffer of another size"
    assert adapter.stats().get("load_size_changed", 0) == 1
    assert any(
        "not loaded: it is 2000 bytes in its slot, the load buffer 1000" in r.message for r in caplog.records
    )
    assert backend.contains_many([key])[0].stored == 2000, "the object is kept"
