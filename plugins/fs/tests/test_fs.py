"""fs on local directories and memory://: integrity, capacity across restarts, eviction,
O_DIRECT, start-up options, config and what plugins show says about LMCache's fields."""

from __future__ import annotations

import logging
import os
import shutil
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fs_helpers import (
    HEADER,
    Arena,
    client,
    closed_past_a_stuck_call,
    flip_byte,
    fs_backend,
    fs_config,
    load,
    open_fs,
    payload_bytes_on_disk,
    record_files,
    store,
)
from lmcache_plugin_fs import FsConfig
from lmcache_plugin_fs.backend import FsBackend

from lmcache_tiers.config import FieldError, L2EvictionConfig, build_config, decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.adapter import BackendCloseFailed, BackendCloseTimedOut
from lmcache_tiers.l2.files.dirlock import LOCK_DIR_ENV
from lmcache_tiers.l2.preflight import preflight_adapters
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.files import held_by_another_process
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.l2_restarts import fill_across_restarts

SIZE = 64 << 10
MIB = 1 << 20


def _eviction_controller(adapter: object, watermark: float, ratio: float) -> object:
    from lmcache_tiers.testing.l2_restarts import _eviction_controller as build

    return build(adapter, L2EvictionConfig(trigger_watermark=watermark, eviction_ratio=ratio))  # type: ignore[arg-type]


class _DeletedKeys:
    """A listener that keeps the keys announced deleted."""

    def __init__(self, deleted: list[ObjectKey]) -> None:
        self.deleted = deleted

    def on_l2_keys_stored(self, adapter: object, keys: list[ObjectKey]) -> None:
        pass

    def on_l2_keys_loaded(self, adapter: object, keys: list[ObjectKey]) -> None:
        pass

    def on_l2_keys_deleted(self, adapter: object, keys: list[ObjectKey]) -> None:
        self.deleted.extend(keys)


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "empty"])
def test_damaged_record_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(7, SIZE), pattern(8, SIZE)]
    adapter = open_fs(fs_config(str(tmp_path)), arena.view)
    deleted: list[ObjectKey] = []
    adapter.add_listener(_DeletedKeys(deleted))
    try:
        assert store(adapter, arena, keys, data) == [True, True]
        path = str(tmp_path / f"{keys[0].file_stem()}.bin")
        if damage == "payload":
            flip_byte(path, HEADER + SIZE // 2)
        elif damage == "header":
            flip_byte(path, 40)
        elif damage == "truncated":
            os.truncate(path, HEADER + SIZE - 1)
        else:
            os.truncate(path, 0)
        result = client(adapter).lookup_and_lock(keys)
        hit = damage != "empty"  # an empty file is shorter than a header: removed by the lookup
        assert result.found == [hit, True]
        if hit:
            ok, contents = load(adapter, arena, keys, result.sizes)
            assert ok == [False, True] and contents[1] == data[1]
        adapter.unlock([k for k, found in zip(keys, result.found, strict=True) if found])
        assert not os.path.exists(path)
        counter = "truncated_records_removed" if damage == "empty" else "corrupt_records_removed"
        assert adapter.stats()[counter] == 1
        # Released and announced as the record was removed, not when a later lookup
        # finds it gone (and takes it for a removal behind the adapter's back).
        assert adapter.used_bytes() == SIZE
        assert deleted == [keys[0]]
        assert client(adapter).lookup_and_lock(keys[:1]).found == [False]
        assert adapter.used_bytes() == SIZE
        assert adapter.stats().get("objects_vanished", 0) == 0
        assert deleted == [keys[0]]
    finally:
        adapter.close()


def test_a_damaged_record_on_a_remote_store_is_released_when_removed() -> None:
    """The same on an fsspec store (memory://): the bytes of a record a load removed as
    damaged are released and announced at once, not later as gone behind its back."""
    import fsspec

    memory = fsspec.filesystem("memory")
    root = f"memory://damaged-{uuid.uuid4().hex}"
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(7, SIZE), pattern(8, SIZE)]
    adapter = open_fs(fs_config(root), arena.view)
    deleted: list[ObjectKey] = []
    adapter.add_listener(_DeletedKeys(deleted))
    try:
        assert store(adapter, arena, keys, data) == [True, True]
        (path,) = [p for p in memory.find(root) if keys[0].file_stem() in p]
        record = bytearray(memory.cat_file(path))
        record[HEADER + SIZE // 2] ^= 0xFF
        memory.pipe_file(path, bytes(record))
        result = client(adapter).lookup_and_lock(keys)
        assert result.found == [True, True]
        ok, contents = load(adapter, arena, keys, result.sizes)
        adapter.unlock(keys)
        assert ok == [False, True] and contents[1] == data[1]
        assert not memory.exists(path)
        assert adapter.stats()["corrupt_records_removed"] == 1
        assert adapter.used_bytes() == SIZE and deleted == [keys[0]]
        assert client(adapter).lookup_and_lock(keys[:1]).found == [False]
        assert adapter.stats().get("objects_vanished", 0) == 0 and deleted == [keys[0]]
    finally:
        adapter.close()


def tenant_keys() -> tuple[ObjectKey, ObjectKey]:
    """A key salted "tenant" and the same key salted "tenant.bin": an ``s3`` adapter sharing
    an fs folder on an fsspec URL names the second's object as fs names the first's record."""
    (base,) = make_keys(1)
    mine = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant")
    return mine, ObjectKey(mine.model_name, mine.kv_rank, mine.chunk_hash, mine.object_group, "tenant.bin")


def test_another_keys_intact_record_under_a_remote_name_is_a_miss_that_is_kept() -> None:
    """An ``s3`` adapter sharing the folder of an fs root on s3:// names its object of a
    key salted "tenant.bin" as fs names the key salted "tenant": an intact record of
    another key is that writer's acknowledged object, never damage to remove."""
    import fsspec

    from lmcache_tiers.l2.files import record_name
    from lmcache_tiers.l2.record import encode_header

    files = fsspec.filesystem("memory")
    root = f"memory://foreign-{uuid.uuid4().hex}"
    mine, theirs = tenant_keys()
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    try:
        payload = pattern(9, SIZE)
        path = f"{root}/{record_name(mine)}"
        files.pipe_file(path, encode_header(theirs, payload, align=HEADER) + payload)
        # A hit would be adopted (accounted, later evicted: that writer's object deleted):
        # the lookup reads whose record it is, as a load does.
        assert client(adapter).lookup_and_lock([mine]).found == [False]
        ok, _ = load(adapter, arena, [mine], [SIZE])
        assert ok == [False]
        assert files.exists(path), "another writer's record: kept"
        stats = adapter.stats()
        assert stats["foreign_records"] == 2 and stats.get("corrupt_records_removed", 0) == 0
        assert stats.get("lookup_adopted", 0) == 0
    finally:
        adapter.close()
        files.rm(root, recursive=True)


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_stored_key_another_writer_replaced_is_released_by_the_load_that_finds_it(
    tmp_path: Path, where: str
) -> None:
    """An accounted key is a hit by its record's size alone; a load then reads another
    key's record under its name (an ``s3`` adapter sharing the folder, naming its key
    salted "tenant.bin" as fs names this one's salted "tenant").  Kept, and this adapter's
    bytes released then: it stayed a hit at every lookup, each load of it a miss."""
    import fsspec

    from lmcache_tiers.l2.files import record_name
    from lmcache_tiers.l2.record import encode_header

    root = str(tmp_path / "l2") if where == "local" else f"memory://replaced-{uuid.uuid4().hex}"
    files = fsspec.filesystem("file" if where == "local" else "memory")
    mine, theirs = tenant_keys()
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    try:
        assert store(adapter, arena, [mine], [pattern(3, SIZE)]) == [True]
        (path,) = [p for p in files.find(root) if p.endswith(record_name(mine))]
        payload = pattern(9, SIZE)
        files.pipe_file(path, encode_header(theirs, payload, align=HEADER) + payload)
        assert client(adapter).lookup_and_lock([mine]).found == [True]  # by its size
        adapter.unlock([mine])
        ok, _ = load(adapter, arena, [mine], [SIZE])
        assert ok == [False]
        assert client(adapter).lookup_and_lock([mine]).found == [False]
        assert files.exists(path), "another writer's record: kept"
        stats = adapter.stats()
        assert stats["objects_vanished"] == 1 and stats.get("corrupt_records_removed", 0) == 0
        assert adapter.used_bytes() == 0
    finally:
        adapter.close()
        if where == "remote":
            files.rm(root, recursive=True)


class _ZlibSerde:
    """A size-changing serde: a lookup of a key core does not know reads the header."""

    name = "test-zlib"

    def encode(self, data: memoryview, context: object) -> bytes:
        import zlib

        return zlib.compress(data)

    def decode(self, data: memoryview, context: object) -> bytes:
        import zlib

        return zlib.decompress(data)


@pytest.mark.parametrize("serde", [(), (_ZlibSerde(),)], ids=["plain", "serde"])
def test_another_keys_intact_record_under_a_local_name_is_a_miss_that_is_kept(
    tmp_path: Path, serde: tuple[object, ...]
) -> None:
    """Keys that differ only in case share a file on a case-insensitive filesystem: a
    lookup of one finding the other's intact record is a miss that keeps it -- neither
    removed as damage nor adopted (accounted, then evicted) under the other key."""
    from lmcache_tiers.l2.record import encode_header

    arena = Arena()
    known, base = make_keys(2)
    mine = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant")
    theirs = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "Tenant")
    adapter = open_fs(fs_config(str(tmp_path)), arena.view, serde=serde)  # type: ignore[arg-type]
    try:
        assert store(adapter, arena, [known], [pattern(3, SIZE)]) == [True]
        payload = pattern(9, SIZE)
        path = tmp_path / f"{mine.file_stem()}.bin"
        path.write_bytes(encode_header(theirs, payload, align=HEADER) + payload)
        # With an accounted key in the batch the lookup asks the directory.
        assert client(adapter).lookup_and_lock([known, mine]).found == [True, False]
        adapter.unlock([known])
        assert path.exists(), "another key's intact record: kept"
        stats = adapter.stats()
        assert stats["foreign_records"] == 1 and stats.get("corrupt_records_removed", 0) == 0
        assert stats.get("lookup_adopted", 0) == 0
    finally:
        adapter.close()


def test_damaged_record_never_survives_a_restart(tmp_path: Path) -> None:
    arena = Arena()
    keys = make_keys(3)
    adapter = open_fs(fs_config(str(tmp_path)), arena.view)
    assert store(adapter, arena, keys, [pattern(i, SIZE) for i in range(3)]) == [True] * 3
    adapter.close()
    os.truncate(tmp_path / f"{keys[0].file_stem()}.bin", 100)
    (tmp_path / f"{keys[1].file_stem()}.bin").write_bytes(b"")
    restarted = open_fs(fs_config(str(tmp_path)), arena.view)
    try:
        assert restarted.stats()["truncated_records_removed"] == 2
        assert restarted.stats()["scan_keys"] == 1 and restarted.used_bytes() == SIZE
        assert record_files(str(tmp_path)) == [f"{keys[2].file_stem()}.bin"]
    finally:
        restarted.close()


@pytest.mark.parametrize("with_eviction", [False, True])
@pytest.mark.parametrize("url", [False, True])
def test_capacity_is_held_across_three_restarts(tmp_path: Path, with_eviction: bool, url: bool) -> None:
    capacity = 2 * MIB
    eviction = L2EvictionConfig(trigger_watermark=0.8, eviction_ratio=0.3) if with_eviction else None
    if url:
        import fsspec

        root = f"memory://restarts-{uuid.uuid4().hex}"
        memory = fsspec.filesystem("memory")

        def on_disk() -> int:
            return sum(int(info["size"]) - HEADER for info in memory.find(root, detail=True).values())
    else:
        root = str(tmp_path)

        def on_disk() -> int:
            return payload_bytes_on_disk(root)

    config = fs_config(root, max_capacity_gb=capacity / (1 << 30), eviction=eviction, shard_dirs=True)
    reports = fill_across_restarts(
        lambda: open_fs(config), on_disk, capacity=capacity, object_size=SIZE, eviction=eviction
    )
    for run, report in enumerate(reports):
        assert report.on_disk <= capacity, f"run {run} left {report.on_disk} bytes over a {capacity} cap"
        assert report.used_bytes == report.on_disk, "accounting must match what is on disk"
        assert report.refused > 0 or with_eviction
    assert [r.scanned_bytes for r in reports[1:]] == [r.on_disk for r in reports[:-1]]
    if with_eviction:
        # Eviction makes room for new objects: each run's newest batch is stored and found.
        assert all(r.last_keys_found == 4 for r in reports)
        assert all(r.on_disk >= capacity // 2 for r in reports)
    else:
        # Without eviction a full cache refuses: later runs store nothing new.
        assert reports[1].stored == 0 and reports[2].stored == 0


def test_eviction_under_capacity_pressure_skips_pinned_keys(tmp_path: Path) -> None:
    arena = Arena()
    keys = make_keys(4)
    names = [f"{key.file_stem()}.bin" for key in keys]
    config = fs_config(
        str(tmp_path), max_capacity_gb=(4 * SIZE) / (1 << 30), eviction={"eviction_policy": "LRU"}
    )
    adapter = open_fs(config, arena.view)
    try:
        controller = _eviction_controller(adapter, watermark=0.75, ratio=0.5)
        assert store(adapter, arena, keys, [pattern(i, SIZE) for i in range(4)]) == [True] * 4
        assert adapter.usage() == 1.0
        # A fifth object does not fit until eviction runs.
        assert store(adapter, arena, make_keys(1, start=9), [pattern(9, SIZE)]) == [False]
        # LRU evicts the tail of a prefix first: keys[3] is the first victim, and a
        # prefetch has it pinned between its lookup and its load.
        assert client(adapter).lookup_and_lock(keys[3:]).found == [True]
        controller.evict(2 * SIZE)  # type: ignore[attr-defined]
        assert set(record_files(str(tmp_path))) == {names[0], names[3]}, "pinned key skipped"
        assert adapter.usage() == 0.5
        adapter.unlock(keys[3:])
        controller.evict(SIZE)  # type: ignore[attr-defined]
        assert set(record_files(str(tmp_path))) == {names[0]}, "retried in the next cycle"
        assert store(adapter, arena, make_keys(1, start=9), [pattern(9, SIZE)]) == [True]
    finally:
        adapter.close()


@pytest.mark.parametrize("size", [SIZE, SIZE + 123, 100])
def test_direct_io_round_trip_and_restart(tmp_path: Path, size: int) -> None:
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(30, size), pattern(31, size // 3 + 1)]
    config = fs_config(str(tmp_path), use_odirect=True)
    adapter = open_fs(config, arena.view)
    assert store(adapter, arena, keys, data) == [True, True]
    assert load(adapter, arena, keys, [len(d) for d in data]) == ([True, True], data)
    assert adapter.stats().get("direct_io_fallbacks", 0) == 0, "aligned buffers take the O_DIRECT path"
    adapter.close()
    restarted = open_fs(config, arena.view)
    try:
        result = client(restarted).lookup_and_lock(keys)
        assert result.sizes == [len(d) for d in data]
        assert load(restarted, arena, keys, result.sizes) == ([True, True], data)
        restarted.unlock(keys)
        unaligned = arena.take(len(data[0]) + 1)[1:]
        assert client(restarted).load(keys[:1], [unaligned]) == [True] and bytes(unaligned) == data[0]
        assert restarted.stats()["direct_io_fallbacks"] == 1
    finally:
        restarted.close()


@pytest.mark.parametrize("read_ahead", [None, 1000, 10 * SIZE])
def test_read_ahead_reads_every_byte(tmp_path: Path, read_ahead: int | None) -> None:
    arena = Arena()
    keys = make_keys(3)
    data = [pattern(40 + i, SIZE - i) for i in range(3)]
    adapter = open_fs(fs_config(str(tmp_path), read_ahead_size=read_ahead), arena.view)
    try:
        assert store(adapter, arena, keys, data) == [True] * 3
        assert load(adapter, arena, keys, [len(d) for d in data]) == ([True] * 3, data)
    finally:
        adapter.close()


def test_recover_on_start_false_and_persist_disabled(tmp_path: Path) -> None:
    arena = Arena()
    keys = make_keys(3)
    (tmp_path / "notes.txt").write_text("not ours")
    first = open_fs(fs_config(str(tmp_path)), arena.view)
    assert store(first, arena, keys, [pattern(i, SIZE) for i in range(3)]) == [True] * 3
    first.close()
    fresh = open_fs(fs_config(str(tmp_path), recover_on_start=False, persist_enabled=False, shard_dirs=True))
    try:
        assert fresh.stats()["records_dropped_at_start"] == 3 and fresh.used_bytes() == 0
        assert client(fresh).lookup_and_lock(keys).found == [False] * 3
        assert store(fresh, arena, keys[:1], [pattern(1, SIZE)]) == [True]
    finally:
        fresh.close()
    assert sorted(os.listdir(tmp_path)) == ["notes.txt"], "records and shard directories removed, others kept"


def test_temp_files_go_to_relative_tmp_dir_and_are_swept(tmp_path: Path) -> None:
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / ".tmp-1-1.part").write_bytes(b"half")
    arena = Arena()
    adapter = open_fs(fs_config(str(tmp_path), relative_tmp_dir="staging"), arena.view)
    try:
        assert adapter.stats()["orphan_temp_files_removed"] == 1
        assert store(adapter, arena, make_keys(1), [pattern(1, SIZE)]) == [True]
        assert os.listdir(tmp_path / "staging") == []
    finally:
        adapter.close()


def recorded_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.fsync`` is called on from now on, in order (each still synced)."""
    synced: list[str] = []
    real_fsync = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return synced


def test_with_fsync_the_directories_the_adapter_makes_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced = recorded_fsyncs(monkeypatch)
    root = tmp_path / "new" / "l2"
    arena = Arena()
    adapter = open_fs(fs_config(str(root), fsync=True, shard_dirs=True), arena.view)
    try:
        # the entries naming new/ and new/l2/ are synced before anything is stored
        assert {str(tmp_path), str(tmp_path / "new")} <= set(synced)
        assert store(adapter, arena, make_keys(1), [pattern(1, SIZE)]) == [True]
        assert str(root) in synced  # the new shard directory's entry
    finally:
        adapter.close()


@pytest.mark.parametrize("temp_dir", [None, "staging"])
@pytest.mark.parametrize("vanished", ["shard", "root"])
def test_stores_go_on_after_the_tree_vanished(tmp_path: Path, temp_dir: str | None, vanished: str) -> None:
    arena = Arena()
    keys = make_keys(2)  # both in shard 00/00
    root = tmp_path / "l2"
    adapter = open_fs(fs_config(str(root), shard_dirs=True, relative_tmp_dir=temp_dir), arena.view)
    try:
        assert store(adapter, arena, keys[:1], [pattern(1, SIZE)]) == [True]
        shutil.rmtree(root / "00" if vanished == "shard" else root)
        # With relative_tmp_dir the temporary file is created outside the vanished shard
        # directory, so only the rename finds it missing.
        assert store(adapter, arena, keys[1:], [pattern(2, SIZE)]) == [True]
        assert load(adapter, arena, keys[1:], [SIZE]) == ([True], [pattern(2, SIZE)])
        assert adapter.stats().get("store_io_errors", 0) == 0
        assert adapter.stats().get("root_recreated", 0) == (vanished == "root")
    finally:
        adapter.close()


@pytest.mark.parametrize("url", [False, True])
def test_temp_files_of_a_killed_run_are_swept_counted_and_logged(
    tmp_path: Path, url: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import fsspec

    root = f"memory://sweep-{uuid.uuid4().hex}" if url else str(tmp_path)
    files = fsspec.filesystem("memory") if url else fsspec.filesystem("file")
    for name in (".tmp-1-1.part", "staging/.tmp-1-2.part"):
        files.makedirs(os.path.dirname(f"{root}/{name}"), exist_ok=True)
        files.pipe_file(f"{root}/{name}", b"half")
    with caplog.at_level(logging.INFO):
        adapter = open_fs(fs_config(root, relative_tmp_dir="staging"))
    try:
        assert adapter.stats()["orphan_temp_files_removed"] == 2
        assert any("removed 2 temporary files" in record.getMessage() for record in caplog.records)
        assert not [path for path in files.find(root) if path.endswith(".part")]
    finally:
        adapter.close()
        if url:
            files.rm(root, recursive=True)


def test_two_adapters_on_one_directory_are_refused(tmp_path: Path) -> None:
    first = open_fs(fs_config(str(tmp_path)))
    try:
        with pytest.raises(ConfigError, match="already used by another adapter"):
            open_fs(fs_config(f"file://{tmp_path}"))
        with pytest.raises(ConfigError, match="already used by another adapter"):
            open_fs(fs_config(str(tmp_path / ".." / tmp_path.name)))
    finally:
        first.close()
    open_fs(fs_config(str(tmp_path))).close()


def test_the_preflight_refuses_a_directory_another_server_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    root = tmp_path / "cache"
    with held_by_another_process(str(root)) as holder:
        for cfg, field in (
            (fs_config(str(root)), "path"),
            (FsConfig(base_path=f"file://{root}"), "base_path"),
        ):
            with pytest.raises(FieldError) as caught:
                FsBackend.preflight(cfg)
            assert caught.value.field == field
            assert str(caught.value) == (
                f"the fs directory {root} is in use by another lmcache-tiers server (pid {holder.pid}); "
                "give each server its own directory"
            )
        # the same words as the open, which stays the authority
        with pytest.raises(
            ConfigError, match=f"the fs directory {root} is in use by .* \\(pid {holder.pid}\\)"
        ):
            open_fs(fs_config(str(root)))
    FsBackend.preflight(fs_config(str(root)))  # its lock file is left, held by nobody
    assert os.listdir(tmp_path / "locks")
    FsBackend.preflight(fs_config(str(tmp_path / "new")))
    assert not (tmp_path / "new").exists()  # the pre-flight creates nothing
    adapter = open_fs(fs_config(str(root)))
    try:
        with pytest.raises(FieldError, match="already used by another adapter of this server"):
            FsBackend.preflight(fs_config(str(root)))
    finally:
        adapter.close()


def test_the_preflight_refuses_a_memory_store_another_adapter_uses() -> None:
    name = f"claim-{uuid.uuid4().hex}"
    adapter = open_fs(fs_config(f"memory://{name}"))
    try:
        # another spelling of the same store: fsspec reduces both to one path
        with pytest.raises(FieldError) as caught:
            FsBackend.preflight(FsConfig(base_path=f"memory:///{name}/"))
        assert caught.value.field == "base_path"
        assert str(caught.value) == (
            f"the fs store memory:///{name}/ is already used by another adapter of this server; "
            "give each adapter its own directory"
        )
        FsBackend.preflight(fs_config(f"memory://{name}-other"))
    finally:
        adapter.close()
    FsBackend.preflight(fs_config(f"memory://{name}"))  # free once closed
    # two adapters of one config: the second is refused, where the open would refuse it
    registry = load_registry()
    specs = [{"type": "fs", "path": f"memory://{name}"}, {"type": "fs", "path": f"memory:///{name}"}]
    at_second = r"already used by another adapter .* - at `\$\.l2_adapters\[1\]\.path`$"
    with pytest.raises(ConfigError, match=at_second):
        preflight_adapters(registry, build_config(registry, {"l2_adapters": specs}))
    preflight_adapters(registry, build_config(registry, {"l2_adapters": specs[:1]}))


def test_control_characters_in_names_are_escaped_in_log_lines(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena()
    key = ObjectKey("evil\nmodel\x1b[31m", 0, b"\x05" * 32, 0, "salt\r\nforged line")
    adapter = open_fs(fs_config(str(tmp_path)), arena.view)
    try:
        assert store(adapter, arena, [key], [pattern(1, SIZE)]) == [True]
        (path,) = record_files(str(tmp_path))
        assert "\n" not in path and "\x1b" not in path and not path.startswith(".")
        flip_byte(str(tmp_path / path), HEADER + 10)
        with caplog.at_level(logging.WARNING):
            assert load(adapter, arena, [key], [SIZE])[0] == [False]
        assert adapter.stats()["corrupt_records_removed"] == 1
        lines = [record.getMessage() for record in caplog.records]
        assert lines and all("\n" not in line and "\r" not in line and "\x1b" not in line for line in lines)
    finally:
        adapter.close()


# -- configuration -------------------------------------------------------------------------


def _decode(raw: dict[str, object]) -> object:
    return decode_adapter(load_registry(), {"type": "fs", **raw}, 0).config


def test_lmcache_fields_are_accepted() -> None:
    config = _decode(
        {"base_path": "/data/kv", "relative_tmp_dir": "tmp", "use_odirect": True, "read_ahead_size": 65536}
    )
    assert config.root == "/data/kv" and config.capacity_bytes is None  # type: ignore[attr-defined]
    assert _decode({"path": "/d", "max_capacity_gb": 2}).capacity_bytes == 2 << 30  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({}, r"exactly one of them - at `\$\.l2_adapters\[0\]\.path`"),
        ({"path": "/a", "base_path": "/b"}, r"exactly one of them - at `\$\.l2_adapters\[0\]\.base_path`"),
        ({"path": "/a", "eviction": {"eviction_policy": "LRU"}}, "eviction needs a capacity"),
        ({"path": "memory://x", "use_odirect": True}, "local directories only"),
        ({"path": "/a", "relative_tmp_dir": "../elsewhere"}, "relative_tmp_dir"),
        ({"path": "/a", "max_capacity_gb": -1}, "max_capacity_gb"),
        ({"path": "/a", "read_ahead_size": 0}, "read_ahead_size"),
        # a local URL without a path would make the working directory the cache
        ({"path": "file://"}, "must not be empty"),
        ({"base_path": "local:// "}, "must not be empty"),
    ],
)
def test_bad_configs_are_refused_with_one_line(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        _decode(raw)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field", ["fsync", "use_odirect"])
def test_a_local_only_field_on_an_fsspec_url_is_refused(field: str) -> None:
    """fsspec has no fsync: a store acknowledged as durable on an sftp server would be in its
    page cache, lost to its power loss; nor O_DIRECT.  The refusal names the URL without
    its password."""
    with pytest.raises(ConfigError, match=f"{field} applies to local directories only") as info:
        _decode({"path": "sftp://user:secret@host/kv", field: True})
    assert "secret" not in str(info.value) and "\n" not in str(info.value)
    assert _decode({"path": "file:///data/kv", "fsync": True}).fsync  # type: ignore[attr-defined]


def test_plugins_show_names_the_lmcache_aliases() -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "lmcache_tiers.cli.main", "plugins", "show", "fs"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "LMCache alias of path" in text
    for field in ("base_path", "relative_tmp_dir", "use_odirect", "read_ahead_size", "max_capacity_gb"):
        assert field in text


def test_config_round_trips_through_builtins() -> None:
    config = fs_config("/d", shard_dirs=True, eviction={"eviction_policy": "LRU"}, max_capacity_gb=1)
    assert msgspec.convert(msgspec.to_builtins(config), type(config)) == config


@pytest.mark.parametrize("remote", [False, True], ids=["local", "fsspec"])
def test_a_record_that_cannot_be_asked_about_is_a_miss_that_stays_accounted(
    tmp_path: Path, remote: bool
) -> None:
    """An error other than "no such file" (here ELOOP; EIO or a network error alike) is not
    an answer: the lookup misses, and the record stays in the accounting -- answering
    "absent" would have core forget a record that is still on disk."""
    arena = Arena()
    keys = make_keys(2)
    root = f"dir::file://{tmp_path}" if remote else str(tmp_path)
    adapter = open_fs(fs_config(root, max_capacity_gb=1), arena.view)
    try:
        assert store(adapter, arena, keys, [pattern(1, SIZE), pattern(2, SIZE)]) == [True, True]
        used = adapter.used_bytes()
        name = keys[0].file_stem() + ".bin"
        [record] = [found for found in record_files(str(tmp_path)) if found.endswith(name)]
        path = tmp_path / record
        saved = path.read_bytes()
        path.unlink()
        path.symlink_to(path)  # stat and open fail with ELOOP
        assert client(adapter).lookup_and_lock(keys).found == [False, False]
        assert adapter.used_bytes() == used
        assert "objects_vanished" not in adapter.stats()
        path.unlink()
        path.write_bytes(saved)
        result = client(adapter).lookup_and_lock(keys)
        assert result.found == [True, True]
        adapter.unlock(keys)
        assert load(adapter, arena, keys[:1], [SIZE]) == ([True], [pattern(1, SIZE)])
    finally:
        adapter.close()


def _digest_named_keys(count: int) -> list[ObjectKey]:
    """Keys whose readable names do not fit in a file name: their records get digest names."""
    return [ObjectKey("m" * 250, 0, bytes([n + 1]) * 32, 0, "s" * 100) for n in range(count)]


@pytest.mark.parametrize("remote", [False, True], ids=["local", "fsspec"])
def test_digest_records_whose_header_cannot_be_read_are_removed_at_start(
    tmp_path: Path, remote: bool
) -> None:
    import fsspec

    from lmcache_tiers.l2.files import record_name

    root = f"memory://digest-{uuid.uuid4().hex}" if remote else str(tmp_path)
    files = fsspec.filesystem("memory") if remote else fsspec.filesystem("file")
    arena = Arena()
    keys = _digest_named_keys(4)
    adapter = open_fs(fs_config(root), arena.view)
    assert store(adapter, arena, keys, [pattern(n, SIZE) for n in range(4)]) == [True] * 4
    adapter.close()
    paths = [f"{root}/{record_name(key)}" for key in keys]
    files.pipe_file(paths[1], b"")  # zero-length
    files.pipe_file(paths[2], b"\xff" * (HEADER + SIZE))  # garbage
    files.pipe_file(paths[3], files.cat_file(paths[0]))  # another key's record
    restarted = open_fs(fs_config(root), arena.view)
    try:
        stats = restarted.stats()
        assert stats["truncated_records_removed"] == 1 and stats["corrupt_records_removed"] == 2
        assert stats["scan_keys"] == 1 and restarted.used_bytes() == SIZE
        assert [files.exists(path) for path in paths] == [True, False, False, False]
    finally:
        restarted.close()
        if remote:
            files.rm(root, recursive=True)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "fsspec"])
def test_records_of_the_other_layout_are_counted_reported_and_kept(
    tmp_path: Path, remote: bool, caplog: pytest.LogCaptureFixture
) -> None:
    import fsspec

    root = f"memory://layout-{uuid.uuid4().hex}" if remote else str(tmp_path)
    arena = Arena()
    keys = make_keys(2) + _digest_named_keys(1)
    adapter = open_fs(fs_config(root, shard_dirs=True), arena.view)
    assert store(adapter, arena, keys, [pattern(n, SIZE) for n in range(3)]) == [True] * 3
    adapter.close()
    try:
        with caplog.at_level(logging.WARNING):
            flat = open_fs(fs_config(root, shard_dirs=False), arena.view)
        try:
            assert flat.stats()["records_other_layout"] == 3 and flat.used_bytes() == 0
            assert any(
                "3 records" in r.getMessage() and "set shard_dirs back to true" in r.getMessage()
                for r in caplog.records
            )
        finally:
            flat.close()
        sharded = open_fs(fs_config(root, shard_dirs=True), arena.view)
        try:
            assert sharded.stats()["scan_keys"] == 3 and sharded.used_bytes() == 3 * SIZE
            assert "records_other_layout" not in sharded.stats()
        finally:
            sharded.close()
    finally:
        if remote:
            fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "o_direct"])
def test_close_does_not_wait_for_a_load_stuck_in_a_read_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool
) -> None:
    """A read stuck for good on one of the adapter's read threads (a hung mount) must not
    hold close past its deadline; the load is failed, and its buffers get no later piece
    -- with O_DIRECT neither the payload's last partial block, a read of its own after
    the aligned part."""
    import threading

    arena = Arena()
    keys = make_keys(2)
    # a batch spread over the read threads, each record in several pieces (and with
    # O_DIRECT an aligned part and a partial last block)
    size = 2 * MIB + (5 if direct else 0)
    data = [pattern(90 + i, size) for i in range(2)]
    entered, gate = threading.Event(), threading.Event()
    reads_after_close: list[int] = []
    closed = threading.Event()
    preadv = os.preadv

    def stuck_on_a_read_thread(fd: int, buffers: list[memoryview], offset: int) -> int:
        if closed.is_set():
            reads_after_close.append(offset)
        if threading.current_thread().name.startswith("fs-") and not entered.is_set():
            entered.set()
            gate.wait(60)
        return preadv(fd, buffers, offset)

    adapter = open_fs(fs_config(str(tmp_path), use_odirect=direct), arena.view)

    try:
        assert store(adapter, arena, keys, data) == [True] * 2
        assert client(adapter).lookup_and_lock(keys).found == [True] * 2
        monkeypatch.setattr(os, "preadv", stuck_on_a_read_thread)
        adapter.submit_load(keys, [arena.take(size) for _ in keys])
        assert entered.wait(10)
        with closed_past_a_stuck_call(adapter, gate, closed, ("l2-0:fs-test-load", "fs-"), "read"):
            pass  # nothing to do while the call is stuck
    finally:
        gate.set()
        adapter.close()  # a no-op once closed
    assert reads_after_close == [], "pieces were read into L1 after close returned"


@pytest.mark.parametrize("stuck_in", ["pwrite", "fsync"])
def test_close_does_not_wait_for_a_store_stuck_in_a_write_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stuck_in: str
) -> None:
    """A write stuck on one of the adapter's write threads (a hung mount) must not hold
    close past its deadline; once it returns, after the adapter released its directory,
    the store publishes nothing -- no record of its key appears -- and leaves no
    temporary file.  Stuck in the payload's pwrite it writes nothing more; stuck in the
    fsync before the rename (``fsync: true``) it does not rename."""
    import threading

    arena = Arena()
    # a batch spread over the write threads: one of them surely takes a record, even when
    # the calling thread is the first to start
    keys = make_keys(8)
    size = 2 * MIB
    data = [pattern(110 + i, size) for i in range(len(keys))]
    entered, gate = threading.Event(), threading.Event()
    stuck: list[int] = []  # the index of the record whose write is stuck
    closed = threading.Event()
    pwrite, fsync = os.pwrite, os.fsync

    def which(prefix: bytes) -> int:
        (index,) = [i for i, payload in enumerate(data) if payload[:64] == prefix]
        return index

    def is_the_stuck_one() -> bool:
        return threading.current_thread().name.startswith("fs-") and not entered.is_set()

    def stuck_pwrite(fd: int, view: memoryview, offset: int) -> int:
        if offset == HEADER and is_the_stuck_one():  # the payload, written first
            stuck.append(which(bytes(view[:64])))
            entered.set()
            gate.wait(60)
        return pwrite(fd, view, offset)

    def stuck_fsync(fd: int) -> None:
        if os.fstat(fd).st_size == HEADER + size and is_the_stuck_one():  # a record's file
            with open(os.readlink(f"/proc/self/fd/{fd}"), "rb") as record:  # fd is write-only
                record.seek(HEADER)
                payload = record.read(64)
            stuck.append(which(payload))
            entered.set()
            gate.wait(60)
        fsync(fd)

    fields = {"fsync": True} if stuck_in == "fsync" else {}
    adapter = open_fs(fs_config(str(tmp_path), use_odirect=False, **fields), arena.view)

    try:
        if stuck_in == "pwrite":
            monkeypatch.setattr(os, "pwrite", stuck_pwrite)
        else:
            monkeypatch.setattr(os, "fsync", stuck_fsync)
        buffers = [arena.take(size) for _ in keys]
        for buffer, payload in zip(buffers, data, strict=True):
            buffer[:] = payload
        adapter.submit_store(keys, buffers)
        assert entered.wait(10)
        with closed_past_a_stuck_call(adapter, gate, closed, ("l2-0:fs-test-store", "fs-"), "write"):
            pass  # nothing to do while the call is stuck
    finally:
        gate.set()
        adapter.close()  # a no-op once closed
    (index,) = stuck
    assert f"{keys[index].file_stem()}.bin" not in record_files(str(tmp_path)), (
        "a store stuck past close published its record after the directory was released"
    )
    left = [name for _dir, _dirs, names in os.walk(tmp_path) for name in names if not name.endswith(".bin")]
    assert left == [], "a store stopped by close left its temporary file"


def test_a_remote_load_stuck_when_the_adapter_closes_copies_nothing_into_its_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A load from an fsspec store still running when close returned past its deadline (a
    hung network store) must not copy the payload into its buffer, which may hold another
    object by then."""
    import threading

    import fsspec
    import lmcache_plugin_fs.remote as remote

    root = f"memory://stuck-{uuid.uuid4().hex}"
    arena = Arena()
    keys = make_keys(1)
    data = [pattern(97, SIZE)]
    entered, gate = threading.Event(), threading.Event()
    closed = threading.Event()
    verify = remote.verify_payload

    def stuck_in_the_read(header: object, payload: bytes) -> None:
        entered.set()
        gate.wait(60)
        verify(header, payload)  # type: ignore[arg-type]

    adapter = open_fs(fs_config(root), arena.view)

    buffer = arena.take(SIZE)
    try:
        assert store(adapter, arena, keys, data) == [True]
        assert client(adapter).lookup_and_lock(keys).found == [True]
        monkeypatch.setattr(remote, "verify_payload", stuck_in_the_read)
        adapter.submit_load(keys, [buffer])
        assert entered.wait(10)
        with closed_past_a_stuck_call(adapter, gate, closed, "l2-0:fs-test-load", "read"):
            buffer[:] = bytes(SIZE)  # the buffer is another object's now
    finally:
        gate.set()
        adapter.close()  # a no-op once closed
        fsspec.filesystem("memory").rm(root, recursive=True)
    assert bytes(buffer) == bytes(SIZE), "the payload was copied into L1 after close returned"


def test_a_delete_leaves_another_keys_record_the_listing_accounted_under_a_remote_name() -> None:
    """The start-up listing reads names only, so it accounts the object an ``s3`` adapter
    sharing the folder stored for a key salted "tenant.bin" as this adapter's key salted
    "tenant"; deleting that key (the L2 eviction) must leave the other writer's
    acknowledged object, as a lookup and a load do."""
    import fsspec

    from lmcache_tiers.l2.files import record_name
    from lmcache_tiers.l2.record import encode_header

    files = fsspec.filesystem("memory")
    root = f"memory://foreign-delete-{uuid.uuid4().hex}"
    mine, theirs = tenant_keys()
    payload = pattern(9, SIZE)
    path = f"{root}/{record_name(mine)}"
    files.pipe_file(path, encode_header(theirs, payload, align=HEADER) + payload)
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    try:
        assert adapter.used_bytes() == SIZE  # listed by name
        assert adapter.delete([mine]) == [False]
        assert files.exists(path), "another writer's record: kept"
        assert adapter.stats()["foreign_records"] == 1
    finally:
        adapter.close()
        files.rm(root, recursive=True)


def test_a_foreign_record_a_delete_left_is_no_longer_accounted_nor_a_hit() -> None:
    """The delete leaves the other writer's object, but it is not this adapter's record:
    its bytes are released (not held against the capacity for good, nor offered to the
    eviction and refused at every cycle), lookups miss it, and it is counted once."""
    import fsspec

    from lmcache_tiers.l2.files import record_name
    from lmcache_tiers.l2.record import encode_header

    files = fsspec.filesystem("memory")
    root = f"memory://foreign-release-{uuid.uuid4().hex}"
    mine, theirs = tenant_keys()
    payload = pattern(9, SIZE)
    path = f"{root}/{record_name(mine)}"
    files.pipe_file(path, encode_header(theirs, payload, align=HEADER) + payload)
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    try:
        assert adapter.used_bytes() == SIZE  # listed by name
        assert adapter.delete([mine]) == [False]
        assert files.exists(path), "another writer's record: kept"
        assert adapter.used_bytes() == 0, "the other writer's object is still accounted as this key"
        assert adapter.stats()["foreign_records"] == 1
        assert client(adapter).lookup_and_lock([mine]).found == [False]
        assert files.exists(path)
    finally:
        adapter.close()
        files.rm(root, recursive=True)


@pytest.mark.parametrize("remote", [False, True])
def test_records_stored_through_a_size_changing_chain_are_hits_after_a_restart(
    tmp_path: Path, remote: bool
) -> None:
    """After a restart core knows no L1 size of a record written through a size-changing
    serde chain: the lookup reads it from the header and reports a hit, which loads."""
    import fsspec

    root = f"memory://zlib-restart-{uuid.uuid4().hex}" if remote else str(tmp_path)
    arena = Arena()
    keys = make_keys(2)
    data = [pattern(40 + i, SIZE) for i in range(2)]
    serde = (_ZlibSerde(),)
    try:
        first = open_fs(fs_config(root), arena.view, serde=serde)  # type: ignore[arg-type]
        try:
            assert store(first, arena, keys, data) == [True, True]
        finally:
            first.close()
        again = open_fs(fs_config(root), arena.view, serde=serde)  # type: ignore[arg-type]
        try:
            result = client(again).lookup_and_lock(keys)
            assert result.found == [True, True]
            assert load(again, arena, keys, result.sizes) == ([True, True], data)
            again.unlock(keys)
            assert again.stats().get("objects_vanished", 0) == 0
        finally:
            again.close()
    finally:
        if remote:
            fsspec.filesystem("memory").rm(root, recursive=True)


def _newer_format(key: ObjectKey, payload: bytes) -> bytes:
    """A record of ``key`` whose header says a format version this code does not read
    (what a newer server sharing the folder writes), its header crc made right again."""
    import zlib

    from lmcache_tiers.l2.record import encode_header

    header = bytearray(encode_header(key, payload, align=HEADER))
    header[4:6] = (99).to_bytes(2, "little")
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")
    return bytes(header) + payload


def test_a_delete_keeps_a_record_of_a_newer_format_on_a_remote_folder() -> None:
    """A newer server sharing the folder stored a record under a key this one listed: the
    delete (the L2 eviction's) must leave that writer's object, release the key's bytes
    (not this adapter's record) and count it once."""
    import fsspec

    from lmcache_tiers.l2.files import record_name

    files = fsspec.filesystem("memory")
    root = f"memory://newer-delete-{uuid.uuid4().hex}"
    (key,) = make_keys(1)
    path = f"{root}/{record_name(key)}"
    files.pipe_file(path, _newer_format(key, pattern(9, SIZE)))
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    try:
        assert adapter.used_bytes() == SIZE  # listed by name
        assert adapter.delete([key]) == [False]
        assert files.exists(path), "a newer server's acknowledged write was deleted"
        assert adapter.used_bytes() == 0, "a record this server cannot read is still accounted"
        stats = adapter.stats()
        assert stats["record_version_unknown"] == 1
        assert stats.get("corrupt_records_removed", 0) == 0
        assert client(adapter).lookup_and_lock([key]).found == [False]
        assert files.exists(path)
    finally:
        adapter.close()
        files.rm(root, recursive=True)


@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_record_of_a_newer_format_is_a_miss_that_is_kept(tmp_path: Path, where: str) -> None:
    """A newer server sharing the folder overwrote a key this one stored (a load finds it)
    and stored one this one never saw (a lookup reads its header): misses, both records
    kept (that server reads them), each counted."""
    import fsspec

    from lmcache_tiers.l2.files import record_name

    files = fsspec.filesystem("memory" if where == "remote" else "file")
    root = f"memory://newer-load-{uuid.uuid4().hex}" if where == "remote" else str(tmp_path / "root")
    stored, theirs = make_keys(2)
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    try:
        assert store(adapter, arena, [stored], [pattern(3, SIZE)]) == [True]
        paths = [f"{root}/{record_name(key)}" for key in (stored, theirs)]
        for path, key in zip(paths, (stored, theirs), strict=True):
            files.pipe_file(path, _newer_format(key, pattern(5, SIZE)))
        result = client(adapter).lookup_and_lock([stored, theirs])
        assert result.found == [True, False]  # core knows the stored one's size: no header read
        ok, _contents = load(adapter, arena, [stored], result.sizes[:1])
        adapter.unlock([stored])
        assert ok == [False]
        assert all(files.exists(path) for path in paths), "a newer server's record was removed"
        stats = adapter.stats()
        assert stats.get("corrupt_records_removed", 0) == 0
        assert stats["record_version_unknown"] == 2
    finally:
        adapter.close()
        files.rm(root, recursive=True)


@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_digest_named_record_of_a_newer_format_is_kept_by_the_listing(tmp_path: Path, where: str) -> None:
    """Only its header tells a digest-named record's key; a newer server's header cannot be
    read here, but the record is that server's: not listed, kept, counted."""
    import fsspec

    from lmcache_tiers.l2.files import record_name

    files = fsspec.filesystem("memory" if where == "remote" else "file")
    root = f"memory://newer-digest-{uuid.uuid4().hex}" if where == "remote" else str(tmp_path / "root")
    files.makedirs(root, exist_ok=True)
    (key,) = _digest_named_keys(1)
    path = f"{root}/{record_name(key)}"
    files.pipe_file(path, _newer_format(key, pattern(7, SIZE)))
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    try:
        assert files.exists(path), "a newer server's acknowledged write was removed"
        stats = adapter.stats()
        assert stats.get("corrupt_records_removed", 0) == 0
        assert stats["record_version_unknown"] == 1
        assert adapter.used_bytes() == 0
    finally:
        adapter.close()
        files.rm(root, recursive=True)


def test_a_remote_store_stuck_when_the_adapter_closes_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A store to an fsspec store still running when close returned past its deadline (a
    hung network store) must not publish its record: its payload buffer may hold another
    object by then, and the store may belong to another adapter.  It removes its temporary
    object and fails, as a local directory's does."""
    import threading

    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from lmcache_tiers.l2.files import record_name

    root = f"memory://stuck-store-{uuid.uuid4().hex}"
    arena = Arena()
    keys = make_keys(1)
    entered, gate = threading.Event(), threading.Event()
    closed = threading.Event()
    makedirs = MemoryFileSystem.makedirs

    def stuck_in_the_store(self: MemoryFileSystem, path: str, exist_ok: bool = False) -> None:
        if threading.current_thread().name.startswith("l2-0:fs-test-store") and not entered.is_set():
            entered.set()
            gate.wait(60)
        makedirs(self, path, exist_ok=exist_ok)

    adapter = open_fs(fs_config(root), arena.view)

    buffer = arena.take(SIZE)
    buffer[:] = pattern(98, SIZE)
    try:
        monkeypatch.setattr(MemoryFileSystem, "makedirs", stuck_in_the_store)
        adapter.submit_store(keys, [buffer])
        assert entered.wait(10)
        with closed_past_a_stuck_call(adapter, gate, closed, "l2-0:fs-test-store", "store"):
            buffer[:] = bytes(SIZE)  # the buffer is another object's now
        files = fsspec.filesystem("memory")
        left = [str(path) for path in files.find(root)]
    finally:
        gate.set()
        adapter.close()  # a no-op once closed
        fsspec.filesystem("memory").rm(root, recursive=True)
    assert not any(path.endswith(record_name(keys[0])) for path in left), (
        "a store stuck past close published its record"
    )
    assert left == [], "a store stopped by close left its temporary object"


def test_a_store_stuck_when_the_adapter_closes_does_not_create_the_released_root_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store stuck creating its temporary file (a hung mount) when close returned past its
    deadline, which then finds the root gone, must not create the root again: the adapter
    released the directory, and creating it again would take the directory's lock once
    more -- for ever, as nothing releases it -- refusing the next adapter on it."""
    import threading

    root = str(tmp_path / "cache")
    arena = Arena()
    keys = make_keys(1)
    entered, gate = threading.Event(), threading.Event()
    closed = threading.Event()
    real_open = os.open

    def stuck_open(path: str, flags: int, *args: int, **kwargs: int) -> int:
        if (
            flags & os.O_CREAT
            and threading.current_thread().name.startswith("l2-0:fs-test-store")
            and not entered.is_set()
        ):
            entered.set()
            gate.wait(60)
            shutil.rmtree(root)  # removed while the mount hung (the server was stopping)
        return real_open(path, flags, *args, **kwargs)

    adapter = open_fs(fs_config(root, use_odirect=False), arena.view)

    buffer = arena.take(SIZE)
    buffer[:] = pattern(99, SIZE)
    try:
        monkeypatch.setattr(os, "open", stuck_open)
        adapter.submit_store(keys, [buffer])
        assert entered.wait(10)
        with closed_past_a_stuck_call(adapter, gate, closed, "l2-0:fs-test-store", "store"):
            pass  # nothing to do while the call is stuck
    finally:
        gate.set()
        adapter.close()  # a no-op once closed
        monkeypatch.setattr(os, "open", real_open)
    assert not os.path.exists(root), "a store past close created the released root again"
    again = open_fs(fs_config(root, use_odirect=False), arena.view)  # the directory is free
    again.close()


def test_a_close_removing_records_on_a_hung_mount_does_not_hold_the_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With persistence off the backend's close removes every record, which on a hung
    mount never returns: core goes on without it past its own budget (counted, logged),
    and the records it did not remove stay complete and checksummed on disk."""
    arena = Arena()
    keys = make_keys(2)
    adapter = open_fs(fs_config(str(tmp_path), persist_enabled=False), arena.view)
    assert store(adapter, arena, keys, [pattern(i, SIZE) for i in range(2)]) == [True, True]
    tree = fs_backend(adapter)._tree
    remove_all_records = tree.remove_all_records
    entered, gate, closed = threading.Event(), threading.Event(), threading.Event()

    def removal_on_a_hung_mount() -> int:
        entered.set()
        gate.wait(60)
        return int(remove_all_records())

    monkeypatch.setattr(tree, "remove_all_records", removal_on_a_hung_mount)
    adapter.close_backend_timeout_s = 0.2  # type: ignore[misc]
    timed_out: list[BackendCloseTimedOut] = []
    close = adapter.close

    def close_failing_as_timed_out() -> None:  # the close returns, failed: records may stay
        try:
            close()
        except BackendCloseTimedOut as exc:
            timed_out.append(exc)

    monkeypatch.setattr(adapter, "close", close_failing_as_timed_out)
    with closed_past_a_stuck_call(adapter, gate, closed, "l2-0:fs-test-close", "removal of records"):
        assert entered.is_set()
        assert len(timed_out) == 1
        assert adapter.stats()["backend_close_timeouts"] == 1
        assert "close of the backend did not return" in caplog.text
        assert len(record_files(str(tmp_path))) == 2, "the records not removed are left as they are"
    assert record_files(str(tmp_path)) == [], "the removal, once it returns, goes on"


@pytest.mark.parametrize("remote", [False, True], ids=["local", "url"])
def test_a_close_that_cannot_remove_one_record_removes_the_rest_and_counts_it(
    tmp_path: Path, remote: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With persistence off the close removes every record.  One that cannot be removed (a
    permission or I/O error) must neither leave the others on disk nor pass unseen: the
    rest are removed, it is counted (``records_not_removed``) and one line says so."""
    import fsspec

    root = f"memory://not-removed-{uuid.uuid4().hex}" if remote else str(tmp_path)
    files = fsspec.filesystem("memory" if remote else "file")
    arena = Arena()
    keys = make_keys(3)
    adapter = open_fs(fs_config(root, persist_enabled=False), arena.view)
    assert store(adapter, arena, keys, [pattern(i, SIZE) for i in range(3)]) == [True] * 3
    stuck = sorted(path for path in files.find(root) if path.endswith(".bin"))[0]
    refused: list[str] = []

    def refuse(path: str, remove: Any) -> None:
        if str(path).endswith(os.path.basename(stuck)):
            refused.append(str(path))
            raise PermissionError(13, "injected: permission denied", str(path))
        remove(path)

    if remote:
        tree = fs_backend(adapter)._tree
        rm_file = tree.fs.rm_file
        monkeypatch.setattr(tree.fs, "rm_file", lambda path: refuse(path, rm_file))
    else:
        unlink = os.unlink
        monkeypatch.setattr(os, "unlink", lambda path, *args, **kwargs: refuse(path, unlink))
    try:
        # the stop fails too
        with caplog.at_level(logging.WARNING), pytest.raises(BackendCloseFailed, match="stay"):
            adapter.close()
    finally:
        monkeypatch.undo()
    assert refused, "the removal never reached the record"
    left = [path for path in files.find(root) if path.endswith(".bin")]
    assert [os.path.basename(path) for path in left] == [os.path.basename(stuck)], "the rest were left"
    assert adapter.stats().get("records_not_removed", 0) == 1
    assert any("could not be removed" in record.getMessage() for record in caplog.records)
    if remote:
        files.rm(root, recursive=True)


@pytest.mark.parametrize("remote", [False, True], ids=["local", "url"])
def test_a_close_that_cannot_list_a_directory_removes_the_rest_and_counts_it(
    tmp_path: Path, remote: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With persistence off the close removes every record.  A directory of the store that
    cannot be listed (a permission or I/O error) must neither stop the sweep of the other
    directories nor pass unseen: it is counted (``directories_not_listed``), one line names
    it, and the close reports that records stay."""
    import fsspec

    root = f"memory://not-listed-{uuid.uuid4().hex}" if remote else str(tmp_path)
    files = fsspec.filesystem("memory" if remote else "file")
    arena = Arena()
    keys = [ObjectKey("suite-model", 0, bytes([i]) * 8, 0, "") for i in range(1, 5)]  # a shard each
    config = fs_config(root, persist_enabled=False, shard_dirs=not remote)
    adapter = open_fs(config, arena.view)
    assert store(adapter, arena, keys, [pattern(i, SIZE) for i in range(4)]) == [True] * 4
    records = sorted(path for path in files.find(root) if path.endswith(".bin"))
    assert len({os.path.dirname(path) for path in records}) == (1 if remote else 4)
    if remote:
        unreadable = root
        tree = fs_backend(adapter)._tree

        def refuse_find(path: str, **options: Any) -> Any:
            raise PermissionError(13, "injected: permission denied", str(path))

        monkeypatch.setattr(tree.fs, "find", refuse_find)
    else:
        unreadable = os.path.dirname(records[0])
        scandir = os.scandir

        def refuse_scandir(path: Any = ".") -> Any:
            if os.fspath(path) == unreadable:
                raise PermissionError(13, "injected: permission denied", unreadable)
            return scandir(path)

        monkeypatch.setattr(os, "scandir", refuse_scandir)
    try:
        # the stop fails too
        with caplog.at_level(logging.WARNING), pytest.raises(BackendCloseFailed, match="stay"):
            adapter.close()
    finally:
        monkeypatch.undo()
    assert adapter.stats().get("directories_not_listed", 0) == 1
    told = [record.getMessage() for record in caplog.records]
    assert any("cannot list" in line and os.path.basename(unreadable) in line for line in told), told
    assert any("could not be listed" in line for line in told), "the close reports what stays"
    left = sorted(path for path in files.find(root) if path.endswith(".bin"))
    if remote:
        assert left == records, "nothing could be listed: every record stays"
        files.rm(root, recursive=True)
    else:
        assert [os.path.dirname(path) for path in left] == [unreadable], "the rest were removed"


def test_local_open_and_read_errors_are_counted_and_told_once_a_burst(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record file that cannot be opened (a symbolic link looping on itself: ELOOP) or
    read (a directory in its place: EISDIR) fails its load: each is counted
    (``load_read_errors``) and a burst of them is one line, not one line each."""
    root = str(tmp_path / "kv")
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    keys = make_keys(3)
    try:
        assert store(adapter, arena, keys, [pattern(index, 4096) for index in range(3)]) == [True] * 3
        paths = [os.path.join(root, name) for name in record_files(root)]
        assert len(paths) == 3
        for index, path in enumerate(paths):
            os.unlink(path)
            if index == 1:
                os.symlink(os.path.basename(path), path)  # a loop: ELOOP on open
            else:
                os.mkdir(path)  # opens, but EISDIR on read
        with caplog.at_level(logging.INFO):
            for key in keys:
                assert load(adapter, arena, [key], [4096])[0] == [False]
        assert adapter.stats().get("load_read_errors") == 3
        told = [
            r.getMessage()
            for r in caplog.records
            if "cannot open" in r.getMessage() or "cannot read" in r.getMessage()
        ]
        assert len(told) == 1, told
    finally:
        adapter.close()


def test_a_later_adapter_of_this_process_never_reuses_a_temporary_name(tmp_path: Path) -> None:
    """A store of an adapter closed past its deadline (a hung mount) may still hold its
    temporary file when an adapter of the same process opens the directory again.  The
    later adapter's temporary files must have other names: sharing one, its store would
    fail on the name taken, and the stuck store giving up would remove the later
    adapter's half-written file under it."""
    from lmcache_tiers.l2.files import FileLayout, LocalFiles

    key = make_keys(1)[0]

    def opened() -> LocalFiles:
        return LocalFiles(FileLayout(str(tmp_path), shard_dirs=True), name="fs", count=lambda _n, _v: None)

    stuck_fd, stuck_path = opened().create_temp(key)
    later_fd, later_path = opened().create_temp(key)
    try:
        assert later_path != stuck_path
        os.close(stuck_fd)
        LocalFiles.remove_quietly(stuck_path)  # the stuck store gives up
        assert os.path.exists(later_path), "the later adapter's file is its own"
    finally:
        os.close(later_fd)


def _counted_files(root: Path, counts: dict[str, int], *, fsync: bool = False) -> Any:
    """The local files of a store under ``root`` whose counters land in ``counts``."""
    from lmcache_tiers.l2.files import FileLayout, LocalFiles

    def count(name: str, amount: int) -> None:
        counts[name] = counts.get(name, 0) + amount

    return LocalFiles(FileLayout(str(root), shard_dirs=True), name="fs", count=count, fsync=fsync)


def _refuse(monkeypatch: pytest.MonkeyPatch, call: str, refused: str) -> None:
    """Make ``os.<call>`` of ``refused`` fail with EACCES (as root, a permission is no bar)."""
    real = getattr(os, call)

    def refusing(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) == refused:
            raise PermissionError(13, "injected: permission denied", refused)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, call, refusing)


@pytest.mark.parametrize(
    ("call", "counter"),
    [("unlink", "temp_files_not_removed"), ("scandir", "directories_not_listed")],
    ids=["unremovable-temp", "unlistable-directory"],
)
def test_a_start_up_sweep_that_cannot_clean_up_counts_it_and_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, counter: str
) -> None:
    """The start fails when a temporary file of a killed run cannot be removed, or a
    directory of the store cannot be listed: counted, and the error is one line naming
    the file or directory and why."""
    counts: dict[str, int] = {}
    files = _counted_files(tmp_path, counts)
    fd, leftover = files.create_temp(make_keys(1)[0])
    os.close(fd)
    refused = leftover if call == "unlink" else os.path.dirname(leftover)
    _refuse(monkeypatch, call, refused)
    with pytest.raises(OSError) as failed:
        files.remove_temp_files()
    monkeypatch.undo()
    assert counts.get(counter, 0) == 1
    told = str(failed.value)
    assert "\n" not in told and refused in told and "permission denied" in told, told


@pytest.mark.parametrize("refused_calls", [("unlink",), ("unlink", "lstat")])
def test_a_failed_stores_record_that_cannot_be_withdrawn_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_calls: tuple[str, ...]
) -> None:
    """A store whose directory fsync failed removes the record it published; one that
    cannot be removed stays on disk, live yet unaccounted until a lookup or restart finds
    it: counted (``failed_store_records_left``) as well as logged -- also when the record
    cannot even be asked about (an error is no proof it is gone)."""
    counts: dict[str, int] = {}
    files = _counted_files(tmp_path, counts, fsync=True)
    key = make_keys(1)[0]
    fd, temp = files.create_temp(key)
    os.write(fd, b"record")
    record = files.layout.path_for(key)

    def fail_fsync(_directory: str) -> None:
        raise OSError(5, "injected: directory fsync failed")

    monkeypatch.setattr(files, "_fsync_directory", fail_fsync)
    for call in refused_calls:
        _refuse(monkeypatch, call, record)
    with pytest.raises(OSError, match="directory fsync failed"):
        files.publish(key, temp, fd)
    monkeypatch.undo()
    assert os.path.exists(record)
    assert counts.get("failed_store_records_left", 0) == 1


def test_a_shard_directory_replaced_by_a_file_fails_a_lookup_and_is_a_read_error_to_a_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file where a shard directory belongs (ENOTDIR) says nothing of the records, which
    may be intact where the directory went: a lookup fails (a miss, counted as a backend
    error, the key still accounted), never "absent"; a load that meets it is a miss counted
    as a read error, with a line naming the path, so the damage is told."""
    root = str(tmp_path / "kv")
    arena = Arena()
    adapter = open_fs(fs_config(root, shard_dirs=True), arena.view)
    keys = make_keys(2)
    try:
        assert store(adapter, arena, keys, [pattern(index, 4096) for index in range(2)]) == [True] * 2
        shard = os.path.dirname(os.path.join(root, record_files(root)[0]))
        assert all(os.path.dirname(os.path.join(root, name)) == shard for name in record_files(root))
        shutil.rmtree(shard)
        Path(shard).write_bytes(b"not a directory")
        with caplog.at_level(logging.WARNING):
            assert load(adapter, arena, [keys[0]], [4096])[0] == [False]
        assert adapter.stats().get("load_read_errors") == 1
        assert any(os.path.basename(shard) in r.getMessage() for r in caplog.records)
        failures_before = adapter.stats().get("backend_errors", 0)
        assert client(adapter).lookup_and_lock([keys[1]]).found == [False]
        assert adapter.stats().get("backend_errors", 0) == failures_before + 1
        assert adapter.stats().get("objects_vanished", 0) == 0
    finally:
        adapter.close()


@pytest.mark.parametrize("remote", [False, True], ids=["local", "fsspec"])
def test_deletes_that_fail_are_counted_and_told_once_per_burst(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, remote: bool
) -> None:
    """A record that cannot be deleted (here its shard directory is a file: ENOTDIR) stays
    accounted, so the L2 eviction offers it again each cycle: each failed delete is counted
    (``delete_io_errors``) and the log tells the burst in one line, not one per attempt --
    on a local directory and through fsspec (``dir::file://``: the same failure, raised by
    fsspec's calls) alike."""
    root = str(tmp_path / "kv")
    arena = Arena()
    url = f"dir::file://{root}" if remote else root
    adapter = open_fs(fs_config(url, shard_dirs=True), arena.view)
    keys = make_keys(1)
    try:
        assert store(adapter, arena, keys, [pattern(0, 4096)]) == [True]
        shard = os.path.dirname(os.path.join(root, record_files(root)[0]))
        shutil.rmtree(shard)
        Path(shard).write_bytes(b"not a directory")
        with caplog.at_level(logging.WARNING):
            for _attempt in range(3):
                assert adapter.delete(keys) == [False]
        assert adapter.stats().get("delete_io_errors") == 3
        told = [r for r in caplog.records if "cannot delete" in r.getMessage()]
        assert len(told) == 1 and os.path.basename(shard) in told[0].getMessage()
        assert adapter.stats().get("objects_vanished", 0) == 0
    finally:
        adapter.close()


def test_a_symlink_to_a_shard_shaped_directory_is_refused(tmp_path: Path) -> None:
    """The check looks at the directory the path resolves to: a link to ``<outer>/ab/cd``
    is a shard directory of a sharded store at ``<outer>`` all the same."""
    shard = tmp_path / "outer" / "ab" / "cd"
    shard.mkdir(parents=True)
    link = tmp_path / "cache"
    link.symlink_to(shard)
    for build, field in (
        (lambda: FsConfig(path=str(link)), "path"),
        (lambda: FsConfig(base_path=f"file://{link}"), "base_path"),
    ):
        with pytest.raises(FieldError, match=r"named like a shard directory \(ab/cd\)") as caught:
            build()
        assert caught.value.field == field


def test_a_record_larger_than_a_lowered_capacity_is_accounted_and_evictable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena()
    keys = make_keys(3)
    sizes = [4 * SIZE, SIZE, SIZE]
    adapter = open_fs(fs_config(str(tmp_path)), arena.view)
    try:
        assert store(adapter, arena, keys, [pattern(i, size) for i, size in enumerate(sizes)]) == [True] * 3
    finally:
        adapter.close()
    capacity = 2 * SIZE  # lowered below the first record's size
    config = fs_config(
        str(tmp_path), max_capacity_gb=capacity / (1 << 30), eviction={"eviction_policy": "LRU"}
    )
    with caplog.at_level(logging.WARNING):
        adapter = open_fs(config, arena.view)
    try:
        assert adapter.used_bytes() == payload_bytes_on_disk(str(tmp_path)) == sum(sizes)
        assert adapter.stats()["scan_objects_past_capacity"] == 1
        assert any("larger than the capacity" in r.getMessage() for r in caplog.records)
        assert adapter.usage() > 1.0
        assert load(adapter, arena, keys[:1], [4 * SIZE]) == ([True], [pattern(0, 4 * SIZE)])
        controller = _eviction_controller(adapter, watermark=0.75, ratio=0.5)
        for _attempt in range(3):
            if adapter.used_bytes() <= capacity:
                break
            controller.evict(adapter.used_bytes() - capacity)  # type: ignore[attr-defined]
        assert f"{keys[0].file_stem()}.bin" not in record_files(str(tmp_path))
        assert adapter.used_bytes() == payload_bytes_on_disk(str(tmp_path)) <= capacity
    finally:
        adapter.close()


def assert_old_temp_dir_left_alone(
    adapter: Any, in_flight: list[Any], exists: Callable[[Any], bool] = os.path.exists
) -> None:
    """One earlier temporary directory was skipped as another store's: nothing removed,
    each file of ``in_flight`` still there."""
    assert adapter.stats()["old_temp_dirs_skipped"] == 1
    assert adapter.stats().get("orphan_temp_files_removed", 0) == 0
    assert all(exists(path) for path in in_flight)


@pytest.mark.parametrize("url", [False, True])
@pytest.mark.parametrize("now", [None, "staging2"])
def test_temp_files_left_in_a_temp_dir_no_longer_configured_are_swept(
    tmp_path: Path, url: bool, now: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    import fsspec

    root = f"memory://old-temp-{uuid.uuid4().hex}" if url else str(tmp_path)
    files = fsspec.filesystem("memory") if url else fsspec.filesystem("file")
    open_fs(fs_config(root, relative_tmp_dir="staging")).close()
    files.makedirs(f"{root}/elsewhere", exist_ok=True)
    # A run killed mid-store left a temporary file there; the user's own file is not ours.
    files.pipe_file(f"{root}/staging/.tmp-1-1.part", b"half")
    files.pipe_file(f"{root}/staging/notes.txt", b"mine")
    # Never configured as a temporary directory: nothing says its files are ours.
    files.pipe_file(f"{root}/elsewhere/.tmp-1-2.part", b"not ours")
    with caplog.at_level(logging.INFO):
        adapter = open_fs(fs_config(root, relative_tmp_dir=now))
    try:
        assert adapter.stats()["orphan_temp_files_removed"] == 1
        assert not files.exists(f"{root}/staging/.tmp-1-1.part")
        assert files.exists(f"{root}/staging/notes.txt")
        assert files.exists(f"{root}/elsewhere/.tmp-1-2.part")
        assert any("an earlier temporary directory" in r.getMessage() for r in caplog.records)
    finally:
        adapter.close()
    files.pipe_file(f"{root}/staging/.tmp-1-3.part", b"after the sweep")
    adapter = open_fs(fs_config(root, relative_tmp_dir=now))
    try:  # swept once: the old directory is forgotten, and nothing of it is touched again
        assert adapter.stats().get("orphan_temp_files_removed", 0) == 0
        assert files.exists(f"{root}/staging/.tmp-1-3.part")
    finally:
        adapter.close()
        if url:
            files.rm(root, recursive=True)


def test_an_old_temp_dir_another_store_now_holds_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    open_fs(fs_config(str(tmp_path), relative_tmp_dir="staging")).close()
    nested = open_fs(fs_config(str(tmp_path / "staging")))  # another store's root now
    try:
        (tmp_path / "staging" / ".tmp-1-1.part").write_bytes(b"its write in flight")
        with caplog.at_level(logging.WARNING):
            adapter = open_fs(fs_config(str(tmp_path)))
        try:
            assert_old_temp_dir_left_alone(adapter, [tmp_path / "staging" / ".tmp-1-1.part"])
            assert any("in use" in r.getMessage() for r in caplog.records)
        finally:
            adapter.close()
    finally:
        nested.close()


def test_an_unreadable_record_of_temp_dirs_removes_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / ".tmp-1-1.part").write_bytes(b"half")
    (tmp_path / ".lmcache-tiers-temp-dirs").write_text("staging\n../outside\n")
    with caplog.at_level(logging.WARNING):
        adapter = open_fs(fs_config(str(tmp_path)))
    try:
        assert adapter.stats()["temp_dir_record_unreadable"] == 1
        assert (tmp_path / "staging" / ".tmp-1-1.part").exists()
        assert (tmp_path / ".lmcache-tiers-temp-dirs").read_text() == "staging\n../outside\n"
        assert any("cannot read" in r.getMessage() for r in caplog.records)
    finally:
        adapter.close()


def test_an_old_temp_dir_inside_a_directory_another_store_holds_is_left_alone(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The old directory is not another store's root, but it lies under one: its
    temporary files are that store's writes in flight (its own ``relative_tmp_dir``)."""
    open_fs(fs_config(str(tmp_path), relative_tmp_dir="outer/staging")).close()
    nested = open_fs(fs_config(str(tmp_path / "outer"), relative_tmp_dir="staging"))
    try:
        (tmp_path / "outer" / "staging" / ".tmp-1-1.part").write_bytes(b"its write in flight")
        with caplog.at_level(logging.WARNING):
            adapter = open_fs(fs_config(str(tmp_path)))
        try:
            assert_old_temp_dir_left_alone(adapter, [tmp_path / "outer" / "staging" / ".tmp-1-1.part"])
        finally:
            adapter.close()
    finally:
        nested.close()


@pytest.mark.parametrize("url", [False, True])
def test_an_old_temp_dir_that_is_a_store_root_now_is_left_alone(url: bool, tmp_path: Path) -> None:
    """A store rooted in the old directory since -- a remote one no lock tells of, or a
    local one not running now -- holds records there: its temporary files are its own."""
    import fsspec

    root = f"memory://old-temp-store-{uuid.uuid4().hex}" if url else str(tmp_path)
    files = fsspec.filesystem("memory") if url else fsspec.filesystem("file")
    open_fs(fs_config(root, relative_tmp_dir="staging")).close()
    arena = Arena()
    nested = open_fs(fs_config(f"{root}/staging"), arena.view)
    try:
        assert store(nested, arena, make_keys(1), [pattern(0, SIZE)]) == [True]
    finally:
        nested.close()
    files.pipe_file(f"{root}/staging/.tmp-1-1.part", b"its write in flight")
    adapter = open_fs(fs_config(root))
    try:
        assert_old_temp_dir_left_alone(adapter, [f"{root}/staging/.tmp-1-1.part"], files.exists)
    finally:
        adapter.close()
        if url:
            files.rm(root, recursive=True)


def test_a_store_in_the_temp_dir_of_a_running_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root that is a running store's ``relative_tmp_dir`` -- or a ``relative_tmp_dir``
    that is a running store's root -- is refused: either start-up sweep would remove the
    other store's writes in flight (its ``.tmp-*.part`` files there)."""
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    root = tmp_path / "cache"
    outer = open_fs(fs_config(str(root), relative_tmp_dir="staging"))
    try:
        in_flight = root / "staging" / f".tmp-{os.getpid()}-1.part"
        in_flight.write_bytes(b"a write in flight")
        with pytest.raises(FieldError, match="already used by another adapter"):
            FsBackend.preflight(fs_config(str(root / "staging")))
        with pytest.raises(ConfigError, match="already used by another adapter"):
            open_fs(fs_config(str(root / "staging")))
        assert in_flight.exists()
    finally:
        outer.close()
    inner = open_fs(fs_config(str(root / "staging")))
    try:
        in_flight = root / "staging" / f".tmp-{os.getpid()}-2.part"
        in_flight.write_bytes(b"a write in flight")
        with pytest.raises(FieldError, match="already used by another adapter"):
            FsBackend.preflight(fs_config(str(root), relative_tmp_dir="staging"))
        with pytest.raises(ConfigError, match="already used by another adapter"):
            open_fs(fs_config(str(root), relative_tmp_dir="staging"))
        assert in_flight.exists()
    finally:
        inner.close()
    open_fs(fs_config(str(root), relative_tmp_dir="staging")).close()  # both let go


def test_an_old_temp_dir_under_the_current_one_is_swept(tmp_path: Path) -> None:
    """The current temporary directory is locked by this very adapter: the old one under
    it is not another store's."""
    open_fs(fs_config(str(tmp_path), relative_tmp_dir="staging/old")).close()
    (tmp_path / "staging" / "old" / ".tmp-1-1.part").write_bytes(b"half")
    adapter = open_fs(fs_config(str(tmp_path), relative_tmp_dir="staging"))
    try:
        assert adapter.stats().get("old_temp_dirs_skipped", 0) == 0
        assert adapter.stats()["orphan_temp_files_removed"] == 1
        assert not (tmp_path / "staging" / "old" / ".tmp-1-1.part").exists()
    finally:
        adapter.close()


_SERVER_IN_FLIGHT = """
import os, sys
sys.path.insert(0, sys.argv[1])
from fs_helpers import fs_config, open_fs
root = sys.argv[2]
adapter = open_fs(fs_config(root, relative_tmp_dir="t"))
# Its writes in flight: a temporary file next to its records and one in its temp directory.
for directory in (root, os.path.join(root, "t")):
    with open(os.path.join(directory, f".tmp-{os.getpid()}-1.part"), "wb") as handle:
        handle.write(b"half written")
print("serving", flush=True)
sys.stdin.read()
adapter.close()
"""


@pytest.mark.parametrize("earlier", ["old", "old/t", "link", "link/t"])
def test_an_old_temp_dir_that_a_running_server_writes_in_is_left_alone(
    earlier: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another server -- another process, found only by its lock files and directory
    locks -- runs rooted in ``old``, and writes in it and in its own temporary directory
    ``old/t``; this root recorded one of them as an earlier temporary directory, or
    reached through a symbolic link: none of its files in flight is removed."""
    import subprocess
    import sys

    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    root = tmp_path / "cache"
    open_fs(fs_config(str(root), relative_tmp_dir=earlier)).close()
    (root / "old").mkdir(exist_ok=True)
    if earlier.startswith("link"):
        shutil.rmtree(root / "link")
        (root / "link").symlink_to(root / "old")
    helpers = os.path.dirname(os.path.abspath(__file__))
    server = subprocess.Popen(
        [sys.executable, "-c", _SERVER_IN_FLIGHT, helpers, str(root / "old")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "serving"
        in_flight = [
            root / "old" / f".tmp-{server.pid}-1.part",
            root / "old" / "t" / f".tmp-{server.pid}-1.part",
        ]
        adapter = open_fs(fs_config(str(root)))
        try:
            assert_old_temp_dir_left_alone(adapter, in_flight)
        finally:
            adapter.close()
    finally:
        server.communicate(timeout=60)
    assert server.returncode == 0


def test_a_temp_dir_that_is_the_root_itself_is_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``relative_tmp_dir`` that leads back to the root (a symbolic link to it) is the
    root, which the adapter holds already: not another adapter's directory to refuse."""
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))
    root = tmp_path / "cache"
    root.mkdir()
    (root / "tmp").symlink_to(".")
    config = fs_config(str(root), relative_tmp_dir="tmp")
    registry = load_registry()
    spec = {"type": "fs", "path": str(root), "relative_tmp_dir": "tmp"}
    preflight_adapters(registry, build_config(registry, {"l2_adapters": [spec]}))
    arena = Arena()
    adapter = open_fs(config, arena.view)
    try:
        assert store(adapter, arena, make_keys(1), [pattern(0, SIZE)]) == [True]
        assert load(adapter, arena, make_keys(1), [SIZE]) == ([True], [pattern(0, SIZE)])
    finally:
        adapter.close()
    adapter = open_fs(fs_config(str(root)))  # unset: the earlier one is the root, swept with it
    try:
        assert adapter.stats().get("old_temp_dirs_skipped", 0) == 0
        assert not (root / ".lmcache-tiers-temp-dirs").exists()
    finally:
        adapter.close()


def test_the_record_of_temp_dirs_and_the_sweep_it_drives_are_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without ``fsync`` too: the record must survive a power loss before a store writes
    in the directory it names, and an old directory's removals before the record forgets
    it -- else a power loss strands temporary files in a directory nothing sweeps."""
    synced = recorded_fsyncs(monkeypatch)
    record = str(tmp_path / ".lmcache-tiers-temp-dirs")
    open_fs(fs_config(str(tmp_path), relative_tmp_dir="staging")).close()
    # the staged copy's bytes, then the rename that made it the record
    assert synced == [record + ".new", str(tmp_path)]
    (tmp_path / "staging" / ".tmp-1-1.part").write_bytes(b"half")
    synced.clear()
    adapter = open_fs(fs_config(str(tmp_path)))
    try:
        assert adapter.stats()["orphan_temp_files_removed"] == 1
        # the removal in the old directory, then the record's removal that forgets it
        assert synced == [str(tmp_path / "staging"), str(tmp_path)]
        assert not os.path.exists(record)
    finally:
        adapter.close()


def test_temp_dirs_no_record_names_are_counted_reported_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``relative_tmp_dir`` of a release before the record of temporary directories is
    named nowhere: its leftovers are counted and named in one line, and kept -- a server of
    such a release does not lock its temporary directory, so nothing proves they are no
    write in flight.  What is a store's (a nested root, a live one's, shard directories),
    a link, and the current temporary directory are not reported."""
    root = tmp_path / "cache"
    leftovers = [root / "old" / ".tmp-1-1.part", root / "old" / "deeper" / ".tmp-1-2.part"]
    theirs = [
        root / "stopped" / ".tmp-1-3.part",  # a stopped nested store: it has a record
        root / "live" / ".tmp-1-4.part",  # a live nested store's write in flight
        root / "ab" / "cd" / ".tmp-1-5.part",  # a shard directory: the root's own sweep's
    ]
    for path in leftovers + theirs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    (root / "stopped" / "x.bin").write_bytes(b"a record")
    (root / "link").symlink_to(root / "old")
    (root / "staging").mkdir()
    (root / "staging" / ".tmp-1-6.part").write_bytes(b"half")
    live = open_fs(fs_config(str(root / "live")))
    try:
        theirs[1].write_bytes(b"its write in flight")  # after its own start-up sweep
        with caplog.at_level(logging.WARNING):
            adapter = open_fs(fs_config(str(root), relative_tmp_dir="staging", shard_dirs=True))
        try:
            assert adapter.stats()["unrecorded_temp_dirs"] == 2
            lines = [r.getMessage() for r in caplog.records if "no temporary directory" in r.getMessage()]
            assert len(lines) == 1
            assert "2 directories" in lines[0] and "2 temporary files" in lines[0]
            assert "old, old/deeper;" in lines[0]
            assert all(path.exists() for path in leftovers + theirs[:2])
        finally:
            adapter.close()
    finally:
        live.close()


@pytest.mark.parametrize("url", [False, True])
def test_a_damaged_record_that_cannot_be_removed_is_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The damage is a miss and its removal fails (a read-only or failing disk): counted,
    and the line says why it was judged bad -- no removal counter tells of it."""
    import fsspec

    root = f"memory://unremovable-{uuid.uuid4().hex}" if url else str(tmp_path)
    files = fsspec.filesystem("memory") if url else fsspec.filesystem("file")
    arena = Arena()
    keys = make_keys(1)
    adapter = open_fs(fs_config(root), arena.view)
    try:
        assert store(adapter, arena, keys, [pattern(3, SIZE)]) == [True]
        path = f"{root}/{keys[0].file_stem()}.bin"
        data = bytearray(files.cat_file(path))
        data[HEADER + 10] ^= 0xFF
        files.pipe_file(path, bytes(data))
        if url:
            real_rm = type(files).rm_file

            def refusing(self: Any, target: str, *args: Any, **kwargs: Any) -> Any:
                if str(target).endswith(os.path.basename(path)):
                    raise PermissionError(13, "injected: permission denied", target)
                return real_rm(self, target, *args, **kwargs)

            monkeypatch.setattr(type(files), "rm_file", refusing)
        else:
            _refuse(monkeypatch, "unlink", path)
        with caplog.at_level(logging.WARNING):
            assert load(adapter, arena, keys, [SIZE])[0] == [False]
        monkeypatch.undo()
        assert files.exists(path)
        assert adapter.stats()["corrupt_remove_failures"] == 1
        assert adapter.stats().get("corrupt_records_removed", 0) == 0
        assert any("checksum" in r.getMessage() and "stays a miss" in r.getMessage() for r in caplog.records)
    finally:
        adapter.close()
        if url:
            files.rm(root, recursive=True)


def test_temp_dirs_no_record_names_on_an_fsspec_store_are_reported_from_the_sweeps_listing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """On an fsspec store no lock tells of a store nested there: one is known by its
    files (a record, shard directories), and what lies in or under it is not reported."""
    import fsspec

    files = fsspec.filesystem("memory")
    root = f"memory://unrecorded-{uuid.uuid4().hex}"
    leftovers = [f"{root}/old/.tmp-1-1.part", f"{root}/old/deeper/.tmp-1-2.part"]
    theirs = [
        f"{root}/stopped/.tmp-1-3.part",  # next to a nested store's record
        f"{root}/sharded/t/.tmp-1-4.part",  # in a nested sharded store's temporary directory
    ]
    for path in leftovers + theirs:
        files.pipe_file(path, b"half")
    files.pipe_file(f"{root}/stopped/x.bin", b"a record")
    files.pipe_file(f"{root}/sharded/ab/cd/y.bin", b"a record")
    files.pipe_file(f"{root}/staging/.tmp-1-5.part", b"half")  # the current one: swept
    try:
        with caplog.at_level(logging.WARNING):
            adapter = open_fs(fs_config(root, relative_tmp_dir="staging"))
        try:
            assert adapter.stats()["unrecorded_temp_dirs"] == 2
            assert adapter.stats()["orphan_temp_files_removed"] == 1
            lines = [r.getMessage() for r in caplog.records if "no temporary directory" in r.getMessage()]
            assert len(lines) == 1 and "old, old/deeper;" in lines[0]
            assert all(files.exists(path) for path in leftovers + theirs)
        finally:
            adapter.close()
    finally:
        files.rm(root, recursive=True)
