"""fs on an fsspec URL owns the directories of its layout only (the root, the shard
directories and its temporary directory), as on a local directory: a store nested under
its root is another store, whose files its sweeps, listing and removals leave alone."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

import fsspec
import msgspec
import pytest
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


def _temp_objects(memory: fsspec.AbstractFileSystem, root: str) -> list[str]:
    return [path for path in memory.find(root) if path.rsplit("/", 1)[-1].startswith(".tmp-")]


def test_a_move_whose_delete_fails_after_the_copy_is_a_stored_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an object store ``mv`` copies, then deletes the temporary object: when only the
    delete fails, the record is published under its name, so the store is acknowledged
    and accounted -- a failed store that leaves its record behind would hold bytes no
    capacity counts.  The temporary object left is removed at the next start."""
    memory = fsspec.filesystem("memory")
    root = f"memory://mv-{uuid.uuid4().hex}"
    arena = Arena()
    keys = make_keys(1)
    config = fs_config(root, max_capacity_gb=1)
    adapter = open_fs(config, arena.view)
    try:
        real_rm_file = memory.rm_file

        def rm_file(path: str) -> None:
            if path.rsplit("/", 1)[-1].startswith(".tmp-"):
                raise PermissionError(13, "delete refused", path)
            real_rm_file(path)

        monkeypatch.setattr(memory, "rm_file", rm_file)
        ok = store(adapter, arena, keys, [pattern(3, SIZE)])
        published = memory.exists(f"{root}/{keys[0].file_stem()}.bin")
        assert (ok, published) in (([True], True), ([False], False)), "a failed store left its record"
        assert adapter.used_bytes() == (SIZE if published else 0)
        monkeypatch.undo()
        result = client(adapter).lookup_and_lock(keys)
        assert result.found == [True]
        assert load(adapter, arena, keys, result.sizes) == ([True], [pattern(3, SIZE)])
        adapter.unlock(keys)
    finally:
        monkeypatch.undo()
        adapter.close()
    restarted = open_fs(config, arena.view)
    try:
        assert _temp_objects(memory, root) == []
        assert restarted.used_bytes() == SIZE
    finally:
        restarted.close()
        memory.rm(root, recursive=True)


def test_an_unexpected_store_error_fails_its_record_alone_and_leaves_no_temp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fsspec filesystem may raise what is not an OSError (an s3 credential error, a
    gcs HttpError): that record fails alone, counted, and its temporary object is removed;
    the records of the batch already published stay acknowledged."""
    memory = fsspec.filesystem("memory")
    root = f"memory://raise-{uuid.uuid4().hex}"
    arena = Arena()
    keys = make_keys(2)
    adapter = open_fs(fs_config(root, max_capacity_gb=1), arena.view)
    try:
        real_mv = memory.mv

        def mv(source: str, target: str, *args: object, **kwargs: object) -> None:
            if target.endswith(f"{keys[1].file_stem()}.bin"):
                raise RuntimeError("no credentials")
            real_mv(source, target, *args, **kwargs)

        monkeypatch.setattr(memory, "mv", mv)
        assert store(adapter, arena, keys, [pattern(1, SIZE), pattern(2, SIZE)]) == [True, False]
        assert _temp_objects(memory, root) == []
        assert adapter.used_bytes() == SIZE
        assert adapter.stats()["store_io_errors"] == 1
    finally:
        monkeypatch.undo()
        adapter.close()
        memory.rm(root, recursive=True)


def test_a_failed_store_whose_temporary_object_stays_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that failed and cannot remove its temporary object either leaves an object
    no capacity counts until the next start removes it: one line names it."""
    memory = fsspec.filesystem("memory")
    root = f"memory://stays-{uuid.uuid4().hex}"
    arena = Arena()
    keys = make_keys(1)
    adapter = open_fs(fs_config(root), arena.view)
    real_rm_file = memory.rm_file

    def mv(source: str, target: str, *args: object, **kwargs: object) -> None:
        raise RuntimeError("the store went away")

    def rm_file(path: str) -> None:
        if path.rsplit("/", 1)[-1].startswith(".tmp-"):
            raise RuntimeError("the store went away")
        real_rm_file(path)

    try:
        monkeypatch.setattr(memory, "mv", mv)
        monkeypatch.setattr(memory, "rm_file", rm_file)
        with caplog.at_level(logging.INFO):
            assert store(adapter, arena, keys, [pattern(1, SIZE)]) == [False]
        left = _temp_objects(memory, root)
        assert len(left) == 1
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("lmcache_plugin_fs")]
        assert any(left[0].rsplit("/", 1)[-1] in line and "next start" in line for line in lines), lines
        assert adapter.stats()["store_io_errors"] == 1
    finally:
        monkeypatch.undo()
        adapter.close()
    open_fs(fs_config(root), arena.view).close()
    assert _temp_objects(memory, root) == [], "the next start removes it"
    memory.rm(root, recursive=True)


def test_an_unexpected_delete_error_fails_that_key_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete batch whose one key fails with an fsspec store's own error type (not an
    OSError) reports the keys it did remove as removed: failing the whole batch would keep
    them accounted though gone."""
    memory = fsspec.filesystem("memory")
    root = f"memory://delete-{uuid.uuid4().hex}"
    arena = Arena()
    keys = make_keys(3)
    adapter = open_fs(fs_config(root, max_capacity_gb=1), arena.view)
    try:
        assert store(adapter, arena, keys, [pattern(index, SIZE) for index in range(3)]) == [True] * 3
        real_rm_file = memory.rm_file

        def rm_file(path: str) -> None:
            if path.endswith(f"{keys[1].file_stem()}.bin"):
                raise RuntimeError("no credentials")
            real_rm_file(path)

        monkeypatch.setattr(memory, "rm_file", rm_file)
        assert adapter.delete(keys) == [True, False, True]
        assert adapter.used_bytes() == SIZE
    finally:
        monkeypatch.undo()
        adapter.close()
        memory.rm(root, recursive=True)


@pytest.mark.parametrize("remote", [False, True])
def test_a_store_nested_at_a_shard_name_under_a_sharded_root_is_left_alone(
    tmp_path: Path, remote: bool
) -> None:
    """A store whose root is a two-hex-digit directory of a sharded store's root: nothing
    of the outer store's, in either layout, lies directly in a first-level shard
    directory (its records are one level deeper, its temporary files next to them), so
    what lies there is the nested store's -- its records and its writes in flight -- and
    the outer store's sweeps, listing and removals leave it alone."""
    memory = fsspec.filesystem("memory")
    outer = f"memory://shardnest-{uuid.uuid4().hex}" if remote else str(tmp_path / "outer")
    inner = f"{outer}/ab"
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(i, SIZE) for i in range(2)]
    in_flight = f"{inner}/.tmp-1-1.part"
    nested = open_fs(fs_config(inner), arena.view)
    try:
        assert store(nested, arena, keys, data) == [True, True]
        if remote:
            memory.pipe(in_flight, b"a write of the nested store in flight")
        else:
            Path(in_flight).write_bytes(b"a write of the nested store in flight")
        config = fs_config(outer, recover_on_start=False, persist_enabled=False, shard_dirs=True)
        adapter = open_fs(config, arena.view)
        try:
            assert store(adapter, arena, make_keys(1, start=5), [pattern(5, SIZE)]) == [True]
            stats = adapter.stats()
            assert stats.get("records_misplaced", 0) == 0, "the nested store's records are not ours"
            assert stats.get("records_other_layout", 0) == 0
            assert stats.get("orphan_temp_files_removed", 0) == 0
            assert adapter.used_bytes() == SIZE
        finally:
            adapter.close()
        assert memory.exists(in_flight) if remote else os.path.exists(in_flight)
        result = client(nested).lookup_and_lock(keys)
        assert result.found == [True, True]
        assert load(nested, arena, keys, result.sizes) == ([True, True], data)
        nested.unlock(keys)
    finally:
        nested.close()
        if remote:
            memory.rm(outer, recursive=True)


@pytest.mark.parametrize("remote", [False, True])
def test_a_store_whose_root_is_shaped_like_a_shard_directory_is_refused(tmp_path: Path, remote: bool) -> None:
    """A store whose root is ``<outer>/ab/cd`` -- two levels of shard names under another
    store's root -- cannot be told from that store's own shard directory: the outer
    store's listing would account its records, its start-up sweep remove its writes in
    flight and a removal of every record (``persist_enabled: false``) its acknowledged
    records.  Such a root is refused; one level (``<outer>/ab``) or a name that is no
    shard name is not."""
    outer = f"memory://shardshape-{uuid.uuid4().hex}" if remote else str(tmp_path / "outer")
    with pytest.raises(msgspec.ValidationError, match="shard directory"):
        fs_config(f"{outer}/ab/cd")
    with pytest.raises(msgspec.ValidationError, match="shard directory"):
        fs_config(f"{outer}/ab/cd/")
    for fine in (f"{outer}/ab", f"{outer}/ab/cd/kv", f"{outer}/ab/xy", f"{outer}/AB/CD"):
        assert fs_config(fine).root == fine


def test_a_remote_start_that_cannot_remove_a_temporary_file_fails_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leftover temporary object the start-up sweep cannot remove is not passed over
    unseen: the start fails as on a local directory, one line naming the object."""
    memory = fsspec.filesystem("memory")
    root = f"memory://temp-stuck-{uuid.uuid4().hex}"
    leftover = f"{root}/.tmp-1-1.part"
    memory.pipe(leftover, b"half a record of a killed run")
    rm_file = type(memory).rm_file

    def refuse(self: object, path: str) -> None:
        if str(path).endswith(".tmp-1-1.part"):
            raise PermissionError(13, "injected: permission denied", str(path))
        rm_file(self, path)

    monkeypatch.setattr(type(memory), "rm_file", refuse)
    with pytest.raises(OSError) as failed:
        open_fs(fs_config(root), Arena().view)
    monkeypatch.undo()
    told = str(failed.value)
    assert "\n" not in told and ".tmp-1-1.part" in told and "permission denied" in told, told
    memory.rm(root, recursive=True)
