"""nixl_store slots damaged in storage (a miss, the key dropped at once, counted, logged)
and stores into a full filesystem (counted and named)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from lmcache_plugin_nixl.pool import slot_file_name
from nixl_helpers import Arena, client, open_pool, pool_config, scratch_dir

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.mounts import tmpfs_at

SIZE = 64 << 10


def _store_two(adapter: L2Adapter, arena: Arena) -> tuple[list[ObjectKey], list[bytes]]:
    keys = make_keys(2)
    data = [pattern(50 + i, SIZE) for i in range(2)]
    assert client(adapter).store(keys, [arena.filled(d) for d in data]) == [True, True]
    return keys, data


def _load_both(
    adapter: L2Adapter, arena: Arena, keys: list[ObjectKey]
) -> tuple[list[bool], list[memoryview]]:
    assert client(adapter).lookup_and_lock(keys).found == [True, True]
    buffers = [arena.take(SIZE) for _ in keys]
    loaded = client(adapter).load(keys, buffers)
    adapter.unlock(keys)
    return loaded, buffers


def test_a_slot_dropped_for_its_checksum_releases_its_accounting_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The adapter dropped the key itself: usage follows at once, and no later lookup
    reports it as removed behind the adapter's back."""
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=2), arena.view)
        try:
            keys, data = _store_two(adapter, arena)
            assert adapter.usage() == 1.0
            with open(os.path.join(directory, slot_file_name(0)), "r+b") as slot_file:
                slot_file.seek(100)
                slot_file.write(b"rot!")
            with caplog.at_level("WARNING"):
                loaded, buffers = _load_both(adapter, arena, keys)
                assert loaded == [False, True]
                assert bytes(buffers[1]) == data[1]
                assert adapter.usage() == 0.5, "the dropped object is no longer accounted"
                assert client(adapter).lookup_and_lock(keys).found == [False, True]
                adapter.unlock(keys[1:])
            assert "behind" not in caplog.text
            assert adapter.stats()["corrupt_slots_dropped"] == 1
        finally:
            adapter.close()


def test_a_slot_file_cut_short_is_a_miss_and_its_key_dropped(caplog: pytest.LogCaptureFixture) -> None:
    """A slot file truncated in storage fails every read of its object: the key is dropped
    as damaged (counted, logged), not offered to every later lookup to fail again."""
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=2), arena.view)
        try:
            keys, data = _store_two(adapter, arena)
            os.truncate(os.path.join(directory, slot_file_name(0)), SIZE // 3)
            with caplog.at_level("WARNING"):
                loaded, buffers = _load_both(adapter, arena, keys)
            assert loaded == [False, True]
            assert bytes(buffers[1]) == data[1], "the intact slot of the batch still loads"
            assert adapter.stats()["corrupt_slots_dropped"] == 1
            assert f"holds {SIZE // 3} bytes" in caplog.text
            assert adapter.usage() == 0.5
            assert client(adapter).lookup_and_lock(keys).found == [False, True]
            adapter.unlock(keys[1:])
            assert adapter.stats()["pool_slots_used"] == 1, "the damaged slot is free again"
        finally:
            adapter.close()


def test_a_store_into_a_full_filesystem_is_counted_and_named_as_no_space(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """NIXL reports only a failed write: an object the filesystem has no room for is
    counted (``store_no_space``) and logged as such, and the objects that fit are stored."""
    mount = str(tmp_path / "small")
    with tmpfs_at(mount, "size=1m") as refused:
        if refused is not None:
            pytest.skip(refused)
        arena = Arena()
        adapter = open_pool(pool_config(mount, pool_size=4), arena.view)
        try:
            size = 384 << 10  # two fit in 1 MiB, the third does not
            keys = make_keys(3)
            data = [pattern(70 + i, size) for i in range(3)]
            with caplog.at_level("WARNING"):
                stored = client(adapter).store(keys, [arena.filled(d) for d in data])
            assert stored == [True, True, False]
            assert adapter.stats()["store_no_space"] == 1
            assert f"no space left in {mount}" in caplog.text
            buffers = [arena.take(size) for _ in range(2)]
            assert client(adapter).lookup_and_lock(keys).found == [True, True, False]
            assert client(adapter).load(keys[:2], buffers) == [True, True]
            assert [bytes(b) for b in buffers] == data[:2]
            adapter.unlock(keys[:2])
        finally:
            adapter.close()
