"""fs on an fsspec URL owns the directories of its layout only (the root, the shard
directories and its temporary directory), as on a local directory: a store nested under
its root is another store, whose files its sweeps, listing and removals leave alone."""

from __future__ import annotations

import uuid

import fsspec
from fs_helpers import Arena, client, fs_config, load, open_fs, store

from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 8 << 10


def test_a_store_nested_under_a_remote_root_is_left_alone() -> None:
    memory = fsspec.filesystem("memory")
    outer = f"memory://nested-{uuid.uuid4().hex}"
    inner = f"{outer}/team"
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(i, SIZE) for i in range(2)]
    nested = open_fs(fs_config(inner), arena.view)
    try:
        assert store(nested, arena, keys, data) == [True, True]
        memory.pipe(f"{inner}/.tmp-1-1.part", b"a write of the nested store in flight")
        # Starting without recovery and closing without persistence remove this store's
        # records: only its own.
        config = fs_config(outer, recover_on_start=False, persist_enabled=False, shard_dirs=True)
        adapter = open_fs(config, arena.view)
        try:
            assert store(adapter, arena, make_keys(1, start=5), [pattern(5, SIZE)]) == [True]
            stats = adapter.stats()
            assert stats.get("records_misplaced", 0) == 0, "the nested store's records are not ours"
            assert stats.get("orphan_temp_files_removed", 0) == 0
        finally:
            adapter.close()
        assert memory.exists(f"{inner}/.tmp-1-1.part")
        result = client(nested).lookup_and_lock(keys)
        assert result.found == [True, True]
        assert load(nested, arena, keys, result.sizes) == ([True, True], data)
        nested.unlock(keys)
    finally:
        nested.close()
