"""nixl_store_dynamic's directory hygiene on core's file-store code: a full filesystem, a
write error reported only at a file's close, names that need escaping, a vanished root,
capacity across restarts."""

from __future__ import annotations

import os
import shutil

import pytest
from nixl_helpers import Arena, client, dynamic_config, open_dynamic, scratch_dir

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.files import check_close_error_fails_store, check_full_disk_batch
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.l2_restarts import fill_across_restarts

SIZE = 64 << 10


def _store(adapter: object, arena: Arena, keys: list[ObjectKey], data: list[bytes]) -> list[bool]:
    return client(adapter).store(keys, [arena.filled(d) for d in data])


def test_a_batch_that_hits_enospc_stores_what_fits() -> None:
    check_full_disk_batch(lambda root, arena: open_dynamic(dynamic_config(root), arena))


def test_a_write_error_reported_at_close_publishes_nothing() -> None:
    check_close_error_fails_store(lambda root, arena: open_dynamic(dynamic_config(root), arena))


def test_model_names_starting_with_a_dot_are_listed_and_removed() -> None:
    arena = Arena()
    keys = [ObjectKey(".hidden-model", 0, bytes([i]) * 32, 0, "salt\tx") for i in range(3)]
    with scratch_dir() as root:
        adapter = open_dynamic(dynamic_config(root), arena.view)
        assert _store(adapter, arena, keys, [pattern(i, SIZE) for i in range(3)]) == [True] * 3
        assert not any(name.startswith(".") for name in os.listdir(root))
        adapter.close()
        reopened = open_dynamic(dynamic_config(root, persist_enabled=False), arena.view)
        try:
            assert set(reopened.iter_keys()) == set(keys)
            assert reopened.used_bytes() == 3 * SIZE
        finally:
            reopened.close()
        assert os.listdir(root) == [], "persistence off removes them too"


def test_a_vanished_flat_root_is_created_again() -> None:
    arena = Arena()
    keys = make_keys(2)
    with scratch_dir() as root:
        adapter = open_dynamic(dynamic_config(root), arena.view)
        try:
            assert _store(adapter, arena, keys[:1], [pattern(1, SIZE)]) == [True]
            shutil.rmtree(root)
            assert _store(adapter, arena, keys[1:], [pattern(2, SIZE)]) == [True]
            assert adapter.stats()["root_recreated"] == 1
            assert client(adapter).lookup_and_lock(keys[1:]).found == [True]
            adapter.unlock(keys[1:])
        finally:
            adapter.close()


def _payload_on_disk(root: str) -> int:
    return sum(
        os.path.getsize(os.path.join(d, n)) - 4096
        for d, _s, files in os.walk(root)
        for n in files
        if n.endswith(".bin")
    )


@pytest.mark.parametrize("with_eviction", [False, True])
def test_capacity_is_held_across_three_restarts(with_eviction: bool) -> None:
    capacity = 1 << 20
    eviction = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.3) if with_eviction else None
    with scratch_dir() as root:
        config = dynamic_config(root, capacity_gb=capacity / (1 << 30), shard_dirs=True)
        reports = fill_across_restarts(
            lambda: open_dynamic(config, Arena(4 << 20).view),
            lambda: _payload_on_disk(root),
            capacity=capacity,
            object_size=SIZE,
            eviction=eviction,
        )
    for report in reports:
        assert report.on_disk <= capacity and report.used_bytes == report.on_disk
    assert [r.scanned_bytes for r in reports[1:]] == [r.on_disk for r in reports[:-1]]
    if with_eviction:
        assert all(r.last_keys_found == 4 for r in reports)
    else:
        assert reports[1].stored == 0 and reports[2].stored == 0
