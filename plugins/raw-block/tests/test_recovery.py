"""Restart recovery of raw_block: checkpoints, slot headers, reformatting."""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path

import pytest
from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import RawBlockBackend
from lmcache_plugin_raw_block.checkpoint import CheckpointAreas
from lmcache_plugin_raw_block.device import BlockDevice
from lmcache_plugin_raw_block.geometry import Geometry, plan_geometry
from lmcache_plugin_raw_block.recovery import SCAN_WINDOW, UNSAVED_QUARANTINE_MAX
from lmcache_plugin_raw_block.slots import Claim
from rb_helpers import (
    PAYLOAD,
    SLOT,
    Arena,
    backend_of,
    check_a_superseded_record_of_another_chain_does_not_hide_the_newer_write,
    client,
    config,
    crash,
    flip_byte,
    load,
    open_raw,
    store,
)
from slot_helpers import ZlibSerde, as_newer_format

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.l2 import make_keys, pattern


def sizes(count: int) -> list[int]:
    return [PAYLOAD - 4096 * (i % 3) - i for i in range(count)]


def data_for(count: int, seed: int = 0) -> list[bytes]:
    return [pattern(seed * 1000 + i, size) for i, size in enumerate(sizes(count))]


def test_clean_restart_recovers_from_the_checkpoint_alone(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    keys, data = make_keys(6), data_for(6)
    adapter = open_raw(cfg)
    assert store(adapter, keys, data) == [True] * 6
    adapter.close()
    reopened = open_raw(cfg)
    try:
        stats = reopened.stats()
        assert stats["recovered_from_checkpoint"] == 6
        assert stats.get("recovered_from_headers", 0) == 0
        assert stats["slots_used"] == 6
        assert reopened.used_bytes() == sum(map(len, data))
        assert load(reopened, keys, [len(d) for d in data]) == ([True] * 6, data)
    finally:
        reopened.close()


def test_writes_after_the_last_checkpoint_are_recovered_from_their_headers(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img", meta_enable_periodic=False)
    keys, data = make_keys(8), data_for(8)
    arena = Arena()
    adapter = open_raw(cfg)
    assert store(adapter, keys[:3], data[:3], arena) == [True] * 3
    assert backend_of(adapter).checkpoint()  # the last checkpoint knows of 3 objects
    assert store(adapter, keys[3:], data[3:], arena) == [True] * 5
    crash(adapter)
    reopened = open_raw(cfg)
    try:
        stats = reopened.stats()
        assert stats["recovered_from_checkpoint"] == 3
        assert stats["recovered_from_headers"] == 5
        assert load(reopened, keys, [len(d) for d in data], arena) == ([True] * 8, data)
    finally:
        reopened.close()


def test_a_checkpointed_slot_reused_after_the_checkpoint_holds_the_newer_object(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img", slots=4, meta_enable_periodic=False)
    old_keys, new_keys = make_keys(2), make_keys(2, start=10)
    old, new = data_for(2), data_for(2, seed=1)
    adapter = open_raw(cfg)
    assert store(adapter, old_keys, old) == [True, True]
    assert backend_of(adapter).checkpoint()
    assert adapter.delete(old_keys[:1]) == [True]  # slot 0 is free again ...
    assert store(adapter, new_keys[:1], new[:1]) == [True]  # ... and reused at once
    slot_of_new = backend_of(adapter).table.lookup(new_keys[:1])[0]
    assert slot_of_new is not None and slot_of_new.slot == 0
    crash(adapter)
    reopened = open_raw(cfg)
    try:
        found = client(reopened).lookup_and_lock(old_keys + new_keys[:1])
        assert found.found == [False, True, True], (
            "the checkpoint's entry lost to the newer write in its slot"
        )
        reopened.unlock(old_keys[1:] + new_keys[:1])
        assert load(reopened, new_keys[:1], [len(new[0])]) == ([True], new[:1])
    finally:
        reopened.close()


def test_a_damaged_newest_checkpoint_falls_back_to_the_other(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img", meta_enable_periodic=False)
    keys, data = make_keys(5), data_for(5)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    assert store(adapter, keys[:2], data[:2]) == [True, True]
    assert backend.checkpoint()
    assert store(adapter, keys[2:], data[2:]) == [True] * 3
    assert backend.checkpoint()
    geometry = backend.geometry
    newest = backend._areas._area
    adapter.close()  # the final checkpoint goes to the other area: damage both that and the one before
    closing_area = 1 - newest
    flip_byte(cfg.device_path, geometry.area_offset(closing_area) + geometry.block_align + 3)
    reopened = open_raw(cfg)
    try:
        stats = reopened.stats()
        # The older checkpoint knew all five objects too (written after the last store).
        assert stats["recovered_from_checkpoint"] == 5
        assert stats["checkpoints_unusable"] == 1
        assert load(reopened, keys, [len(d) for d in data]) == ([True] * 5, data)
    finally:
        reopened.close()


@pytest.mark.parametrize("part", ["header", "body"])
def test_a_newest_checkpoint_that_cannot_be_read_falls_back_to_the_other(
    tmp_path: Path, part: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = config(tmp_path / "dev.img", meta_enable_periodic=False)
    keys, data = make_keys(3), data_for(3)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    assert store(adapter, keys, data) == [True] * 3
    assert backend.checkpoint()
    geometry = backend.geometry
    adapter.close()
    newest = backend._areas._area
    fail_reads_at(monkeypatch, geometry.area_offset(newest) + (geometry.block_align if part == "body" else 0))
    reopened = open_raw(cfg)  # raised EIO before: the adapter did not open
    try:
        assert reopened.stats()["recovered_from_checkpoint"] == 3
        assert reopened.stats()["checkpoints_unusable"] == 1
        assert load(reopened, keys, [len(d) for d in data]) == ([True] * 3, data)
    finally:
        reopened.close()


def test_a_checkpoint_of_a_newer_format_is_counted_logged_and_outranked(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import zlib

    from lmcache_plugin_raw_block.checkpoint import _CRC, _HEADER

    cfg = config(tmp_path / "dev.img", meta_enable_periodic=False)
    keys, data = make_keys(3), data_for(3)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    assert store(adapter, keys, data) == [True] * 3
    assert backend.checkpoint()
    geometry = backend.geometry
    adapter.close()  # the final checkpoint goes to the other area: made a newer server's
    newest = backend._areas._area
    offset = geometry.area_offset(newest)
    with open(cfg.device_path, "r+b") as device:
        device.seek(offset)
        fields = list(_HEADER.unpack(device.read(_HEADER.size)))
        fields[1] += 1  # the version
        newer_seq = fields[3]
        header = _HEADER.pack(*fields)
        device.seek(offset)
        device.write(header + _CRC.pack(zlib.crc32(header)))
    with caplog.at_level(logging.WARNING):
        reopened = open_raw(cfg)
    try:
        assert reopened.stats()["recovered_from_checkpoint"] == 3
        assert reopened.stats()["checkpoints_unusable"] == 1
        assert "format version" in caplog.text
        # Every checkpoint written from now on outranks it, so a newer server never
        # takes it for newer than what this one wrote.
        assert backend_of(reopened)._areas.seq > newer_seq
    finally:
        reopened.close()


def test_a_checkpointed_object_whose_slot_header_is_damaged_is_dropped_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = config(tmp_path / "dev.img")
    keys, data = make_keys(3), data_for(3)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    assert store(adapter, keys, data) == [True] * 3
    entry = backend.table.lookup(keys[1:2])[0]
    assert entry is not None
    adapter.close()
    flip_byte(cfg.device_path, backend.geometry.slot_offset(entry.slot) + 60)
    with caplog.at_level(logging.WARNING):
        reopened = open_raw(cfg)
    try:
        assert reopened.stats()["recovery_dropped_slots"] == 1
        assert "1 objects of checkpoint" in caplog.text
        assert f"e.g. slot {entry.slot} ({keys[1].file_stem()})" in caplog.text
        assert client(reopened).lookup_and_lock(keys).found == [True, False, True]
        reopened.unlock([keys[0], keys[2]])
    finally:
        reopened.close()


def test_without_any_valid_checkpoint_every_slot_header_is_read(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img", slots=12)
    keys, data = make_keys(4), data_for(4)
    adapter = open_raw(cfg)
    geometry = backend_of(adapter).geometry
    assert store(adapter, keys, data) == [True] * 4
    adapter.close()
    for area in (0, 1):
        flip_byte(cfg.device_path, geometry.area_offset(area) + 9)  # both headers damaged
    reopened = open_raw(cfg)
    try:
        stats = reopened.stats()
        assert stats["recovery_headers_read"] == 12
        assert stats["recovered_from_headers"] == 4
        assert load(reopened, keys, [len(d) for d in data]) == ([True] * 4, data)
    finally:
        reopened.close()


def test_checking_a_checkpoint_holds_a_bounded_number_of_slot_headers(tmp_path: Path) -> None:
    """Start-up reads the header of every checkpointed object; read all at once they
    would take header_bytes of memory per object (4 GiB for a million slots)."""
    import tracemalloc

    header_bytes, count = 64 << 10, 768
    cfg = RawBlockConfig(
        device_path=str(tmp_path / "dev.img"),
        slot_bytes=header_bytes + 4096,
        header_bytes=header_bytes,
        capacity_bytes=(1 << 20) + count * (header_bytes + 4096),
        meta_total_bytes=1 << 20,
        meta_enable_periodic=False,
    )
    keys = make_keys(count)
    adapter = open_raw(cfg)
    assert backend_of(adapter).geometry.slot_count == count
    for start in range(0, count, 64):
        batch = keys[start : start + 64]
        assert store(adapter, batch, [b"x" * 100] * len(batch)) == [True] * len(batch)
    adapter.close()
    tracemalloc.start()
    try:
        reopened = open_raw(cfg)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    try:
        assert reopened.stats()["recovered_from_checkpoint"] == count
        assert peak < count * header_bytes // 2, f"{peak >> 20} MiB held while checking the checkpoint"
    finally:
        reopened.close()


def test_deletes_are_not_undone_by_a_clean_restart(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    keys, data = make_keys(3), data_for(3)
    adapter = open_raw(cfg)
    assert store(adapter, keys, data) == [True] * 3
    assert adapter.delete(keys[1:2]) == [True]
    adapter.close()
    reopened = open_raw(cfg)
    try:
        assert client(reopened).lookup_and_lock(keys).found == [True, False, True]
        reopened.unlock([keys[0], keys[2]])
        assert reopened.stats().get("recovered_from_headers", 0) == 0, (
            "the freed slot's old header is not brought back"
        )
    finally:
        reopened.close()


def test_a_changed_geometry_reformats_the_device(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    keys, data = make_keys(2), data_for(2)
    adapter = open_raw(cfg)
    assert store(adapter, keys, data) == [True, True]
    adapter.close()
    changed = config(tmp_path / "dev.img", slot_bytes=2 * cfg.slot_bytes, slots=8)
    reopened = open_raw(changed)
    try:
        assert reopened.stats()["device_formats"] == 1
        assert client(reopened).lookup_and_lock(keys).found == [False, False]
        assert reopened.used_bytes() == 0
    finally:
        reopened.close()


def test_load_checkpoint_on_init_false_starts_empty(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    adapter = open_raw(cfg)
    assert store(adapter, make_keys(2), data_for(2)) == [True, True]
    adapter.close()
    fresh = open_raw(config(tmp_path / "dev.img", load_checkpoint_on_init=False))
    try:
        assert list(fresh.iter_keys()) == []
        assert fresh.stats()["device_formats"] == 1
    finally:
        fresh.close()


def test_trusting_the_checkpoint_still_verifies_every_load(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img", meta_verify_on_load=False)
    keys, data = make_keys(2), data_for(2)
    adapter = open_raw(cfg)
    assert store(adapter, keys, data) == [True, True]
    slot = backend_of(adapter).table.lookup(keys[:1])[0]
    assert slot is not None
    geometry = plan_geometry(cfg, backend_of(adapter)._device.size)
    adapter.close()
    flip_byte(cfg.device_path, geometry.slot_offset(slot.slot) + 20)  # inside its slot header
    reopened = open_raw(cfg)
    try:
        stats = reopened.stats()
        assert stats["recovered_from_checkpoint"] == 2 and stats.get("recovery_headers_read", 0) > 0
        loaded, contents = load(reopened, keys, [len(d) for d in data])
        assert loaded == [False, True] and contents[1] == data[1]
        assert reopened.stats()["corrupt_records_removed"] == 1
        assert client(reopened).lookup_and_lock(keys[:1]).found == [False]
    finally:
        reopened.close()


def test_trusting_the_checkpoint_after_a_crash_keeps_a_store_into_a_reused_slot(tmp_path: Path) -> None:
    # meta_verify_on_load false trusts a checkpoint written at shutdown; after a crash a
    # checkpointed slot may hold an acknowledged store of another key, which only its
    # header tells.
    cfg = config(tmp_path / "dev.img", slots=4, meta_enable_periodic=False, meta_verify_on_load=False)
    old_keys, new_keys = make_keys(1), make_keys(1, start=10)
    old, new = data_for(1), data_for(1, seed=1)
    adapter = open_raw(cfg)
    assert store(adapter, old_keys, old) == [True]
    assert backend_of(adapter).checkpoint()
    assert adapter.delete(old_keys) == [True]  # slot 0 is free again ...
    assert store(adapter, new_keys, new) == [True]  # ... and holds the new key, acknowledged
    crash(adapter)
    reopened = open_raw(cfg)
    try:
        assert client(reopened).lookup_and_lock(old_keys + new_keys).found == [False, True]
        reopened.unlock(new_keys)
        assert load(reopened, new_keys, [len(new[0])]) == ([True], new)
    finally:
        reopened.close()


@pytest.mark.parametrize("damaged", ["body", "header"])
def test_a_clean_checkpoint_is_not_trusted_when_a_newer_one_was_passed_over(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damaged: str
) -> None:
    # A clean checkpoint is the device's final state only while nothing newer exists: once
    # a later run wrote a checkpoint (its start-up one) and stores, that one being
    # unreadable at the next start -- its body, or its header (then it may have been the
    # newest all the same) -- must not make the older clean one trusted unread: a slot it
    # lists may hold an acknowledged store of another key since.  Either damage is
    # counted and logged.
    cfg = config(tmp_path / "dev.img", slots=4, meta_enable_periodic=False, meta_verify_on_load=False)
    old_keys, new_keys = make_keys(1), make_keys(1, start=10)
    old, new = data_for(1), data_for(1, seed=1)
    adapter = open_raw(cfg)
    assert store(adapter, old_keys, old) == [True]
    adapter.close()  # a clean checkpoint listing the old key in slot 0
    adapter = open_raw(cfg)  # trusts it, and writes its start-up checkpoint (not clean)
    backend = backend_of(adapter)
    startup_area = backend._areas._area
    assert adapter.delete(old_keys) == [True]  # slot 0 is free again ...
    assert store(adapter, new_keys, new) == [True]  # ... and holds the new key, acknowledged
    crash(adapter)
    geometry = backend.geometry
    # the body's first block, or the header's sequence number
    offset = geometry.block_align + 3 if damaged == "body" else 30
    flip_byte(cfg.device_path, geometry.area_offset(startup_area) + offset)
    with caplog.at_level(logging.WARNING):
        reopened = open_raw(cfg)
    try:
        assert reopened.stats()["checkpoints_unusable"] == 1
        if damaged == "header":
            assert f"checkpoint header of area {startup_area} is damaged" in caplog.text
        assert client(reopened).lookup_and_lock(old_keys + new_keys).found == [False, True]
        reopened.unlock(new_keys)
        assert load(reopened, new_keys, [len(new[0])]) == ([True], new)
    finally:
        reopened.close()
    again = open_raw(cfg)  # the damaged area was overwritten: nothing passed over now
    try:
        assert again.stats().get("checkpoints_unusable", 0) == 0
    finally:
        again.close()


def test_serde_records_keep_their_l1_size_and_other_chains_are_kept_as_misses(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    keys = make_keys(2)
    data = [bytes(50_000), b"ab" * 20_000]
    adapter = open_raw(cfg, serde=(ZlibSerde(),))
    assert store(adapter, keys, data) == [True, True]
    stored = adapter.used_bytes()
    assert stored < sum(map(len, data))
    adapter.close()
    plain = open_raw(cfg)  # no serde chain: the records are intact but unreadable here
    try:
        assert client(plain).lookup_and_lock(keys).found == [False, False]
        assert plain.stats()["serde_chain_mismatch"] >= 1
        assert len(list(plain.iter_keys())) == 2, "kept, not deleted"
    finally:
        plain.close()
    again = open_raw(cfg, serde=(ZlibSerde(),))
    try:
        result = client(again).lookup_and_lock(keys)
        assert result.sizes == [len(d) for d in data], "L1 sizes from the slot headers"
        again.unlock(keys)
        assert load(again, keys, [len(d) for d in data]) == ([True, True], data)
        assert again.used_bytes() == stored
    finally:
        again.close()


def _rewrite_as_newer_format(cfg: RawBlockConfig, closed: RawBlockBackend, keys: list[ObjectKey]) -> None:
    """Turn the records of ``keys`` in the slots of ``closed`` (a closed backend of the
    device of ``cfg``) into intact ones of a newer format version."""
    with open(cfg.device_path, "r+b") as device:
        for entry in closed.table.lookup(keys):
            assert entry is not None
            offset = closed.geometry.slot_offset(entry.slot)
            device.seek(offset)
            newer = as_newer_format(device.read(4096), closed.identity, entry.slot)
            device.seek(offset)
            device.write(newer)


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "trusted"])
def test_a_record_of_a_newer_format_is_kept_as_a_miss(tmp_path: Path, verify: bool) -> None:
    """A slot whose record a newer server wrote (before a downgrade) is intact: at start-up
    (headers checked, or the clean checkpoint trusted) and at every load it is a miss that
    is kept -- listed and accounted, so eviction can reclaim its slot -- and counted
    ``record_version_unknown``, never dropped or removed as damage."""
    cfg = config(tmp_path / "dev.img", meta_verify_on_load=verify)
    keys, data = make_keys(2), data_for(2)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    assert store(adapter, keys, data) == [True, True]
    adapter.close()
    _rewrite_as_newer_format(cfg, backend, keys[:1])
    reopened = open_raw(cfg)
    try:
        assert set(reopened.iter_keys()) == set(keys), "listed"
        assert reopened.used_bytes() == sum(map(len, data)), "accounted"
        loaded, contents = load(reopened, keys, [len(d) for d in data])
        assert loaded == [False, True]
        assert contents[1] == data[1]
        stats = reopened.stats()
        assert stats["record_version_unknown"] == 1  # at start-up (verified) or the load
        assert stats.get("corrupt_records_removed", 0) == 0
        assert stats["slots_used"] == 2, "its slot is not freed"
    finally:
        reopened.close()
    again = open_raw(cfg)
    try:
        assert len(list(again.iter_keys())) == 2, "still there for the server that reads it"
    finally:
        again.close()


@pytest.mark.parametrize("verify", [True, False], ids=["verified", "trusted"])
def test_a_record_of_a_newer_format_is_no_hit_and_goes_when_evicted_or_replaced(
    tmp_path: Path, verify: bool
) -> None:
    """A newer format's record kept in the slot index must not be found by every lookup
    only for its load to fail (a device read of the whole slot each time): once it is
    known (at start-up, or at its first load when the checkpoint is trusted) lookups miss
    it without a read; it stays accounted until a delete (the L2 eviction's) frees its
    slot, or a store of its key replaces it."""
    cfg = config(tmp_path / "dev.img", meta_verify_on_load=verify)
    keys, data = make_keys(3), data_for(3)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    assert store(adapter, keys, data) == [True, True, True]
    adapter.close()
    _rewrite_as_newer_format(cfg, backend, keys[:2])
    reopened = open_raw(cfg)
    try:
        if not verify:  # the trusted checkpoint lists them: their first load tells
            assert load(reopened, keys[:2], [len(d) for d in data[:2]])[0] == [False, False]
        read = backend_of(reopened)._io.read
        slots_read: list[int] = []

        def counted_read(slot: int, buffer: memoryview) -> bytes:
            slots_read.append(slot)
            return read(slot, buffer)

        backend_of(reopened)._io.read = counted_read  # type: ignore[method-assign]
        for _request in range(3):
            assert client(reopened).lookup_and_lock(keys).found == [False, False, True]
            reopened.unlock(keys[2:])
        assert slots_read == [], "a record known unreadable was read again"
        assert reopened.stats()["record_version_unknown"] == 2
        assert reopened.used_bytes() == sum(map(len, data)), "still accounted"
        assert reopened.delete(keys[:1]) == [True]  # what the L2 eviction does
        assert backend_of(reopened).table.used_slots == 2
        assert store(reopened, keys[1:2], data[1:2]) == [True]
        assert load(reopened, keys[1:2], [len(data[1])]) == ([True], data[1:2])
    finally:
        reopened.close()


# -- slots that failed with I/O errors --------------------------------------------------------


def failing_device_config(path: Path) -> RawBlockConfig:
    """A few hundred small slots and no periodic checkpoint: only the backend's own
    checkpoints happen."""
    return RawBlockConfig(
        device_path=str(path),
        slot_bytes=8192,
        capacity_bytes=300 * 8192 + (1 << 20),
        meta_enable_periodic=False,
    )


def fail_writes(monkeypatch: pytest.MonkeyPatch, count: int) -> list[int]:
    """Make the next ``count`` slot writes fail with EIO (each quarantines its slot);
    returns the list the failed slots are appended to."""
    write = RawBlockBackend._write_slot
    failed: list[int] = []

    def failing(self: RawBlockBackend, claim: Claim, header: bytes, payload: memoryview) -> None:
        if len(failed) < count:
            failed.append(claim.slot)
            raise OSError(errno.EIO, "injected media error")
        write(self, claim, header, payload)

    monkeypatch.setattr(RawBlockBackend, "_write_slot", failing)
    return failed


def test_a_write_after_hundreds_of_failed_ones_is_recovered_after_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recovery scans the slots free at the last checkpoint and stops at a long run of
    empty ones; slots quarantined since are empty.  The backend checkpoints them before
    the run gets that long, so the write after them is still found."""
    cfg = failing_device_config(tmp_path / "dev.img")
    adapter = open_raw(cfg)
    failed = fail_writes(monkeypatch, SCAN_WINDOW + 8)
    doomed = make_keys(SCAN_WINDOW + 8)
    for start in range(0, len(doomed), 16):
        batch = doomed[start : start + 16]
        assert store(adapter, batch, [b"x" * 100] * len(batch)) == [False] * len(batch)
    assert sorted(failed) == list(range(SCAN_WINDOW + 8)), "the lowest free slots, each once"
    stats = adapter.stats()
    assert stats["slots_quarantined"] == SCAN_WINDOW + 8
    assert stats["checkpoints_written"] >= (SCAN_WINDOW + 8) // UNSAVED_QUARANTINE_MAX
    assert stats.get("stores_paused", 0) == 0
    keys = make_keys(2, start=1000)
    small = [pattern(7, 4000), pattern(8, 3000)]  # fit a slot's payload room
    assert store(adapter, keys, small) == [True, True]
    crash(adapter)
    reopened = open_raw(cfg)
    try:
        assert load(reopened, keys, [len(d) for d in small]) == ([True, True], small)
    finally:
        reopened.close()


def test_stores_pause_while_failed_slots_cannot_be_checkpointed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = failing_device_config(tmp_path / "dev.img")
    adapter = open_raw(cfg)
    try:
        fail_writes(monkeypatch, UNSAVED_QUARANTINE_MAX)
        write_checkpoint = CheckpointAreas.write
        monkeypatch.setattr(CheckpointAreas, "write", failing_checkpoint_write)
        keys = make_keys(UNSAVED_QUARANTINE_MAX)
        assert store(adapter, keys, [b"x" * 100] * len(keys)) == [False] * len(keys)
        with caplog.at_level(logging.WARNING, logger="lmcache_plugin_raw_block"):
            assert store(adapter, make_keys(3, start=1000), [b"y" * 100] * 3) == [False] * 3
        stats = adapter.stats()
        assert stats["stores_paused"] == 3
        assert stats["checkpoint_failures"] >= 1
        assert any("stores are paused until a checkpoint succeeds" in r.getMessage() for r in caplog.records)
        monkeypatch.setattr(CheckpointAreas, "write", write_checkpoint)
        assert store(adapter, make_keys(3, start=1000), [b"y" * 100] * 3) == [True] * 3, "resumed"
        assert adapter.stats()["stores_paused"] == 3
    finally:
        adapter.close()


def failing_checkpoint_write(self: CheckpointAreas, *args: object, **kwargs: object) -> None:
    raise OSError(errno.EIO, "injected checkpoint failure")


def fail_reads_at(monkeypatch: pytest.MonkeyPatch, unreadable: int) -> None:
    """Reads of the device at offset ``unreadable`` fail with EIO (``monkeypatch.undo``
    makes the media error a transient one)."""
    read_at = BlockDevice.read_at

    def failing(self: BlockDevice, offset: int, length: int) -> bytes:
        if offset == unreadable:
            raise OSError(errno.EIO, "injected media error")
        return read_at(self, offset, length)

    monkeypatch.setattr(BlockDevice, "read_at", failing)


def one_key_behind_a_clean_checkpoint(
    tmp_path: Path,
) -> tuple[RawBlockConfig, Geometry, list[ObjectKey], tuple[list[ObjectKey], list[bytes]]]:
    """A 4-slot device whose checkpoints are trusted at start-up (meta_verify_on_load
    false), closed cleanly with one key stored (in slot 0, listed by the clean checkpoint,
    the newest, in area 1); its geometry, that key, and a new key with its bytes."""
    cfg = config(tmp_path / "dev.img", slots=4, meta_enable_periodic=False, meta_verify_on_load=False)
    old_keys, new_keys = make_keys(1), make_keys(1, start=10)
    adapter = open_raw(cfg)
    geometry = backend_of(adapter).geometry
    assert store(adapter, old_keys, data_for(1)) == [True]
    adapter.close()
    return cfg, geometry, old_keys, (new_keys, data_for(1, seed=1))


def reuse_slot_crash_and_reopen(
    adapter: BackendAdapter,
    cfg: RawBlockConfig,
    old_keys: list[ObjectKey],
    new: tuple[list[ObjectKey], list[bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> BackendAdapter:
    """Delete ``old_keys`` (freeing slot 0), store the new keys (into the lowest free slot),
    crash, undo the injected failures and reopen: an acknowledged store must be found with
    its bytes, a refused one counted as paused.  Returns the reopened adapter."""
    new_keys, data = new
    assert adapter.delete(old_keys) == [True]
    acknowledged = store(adapter, new_keys, data)
    if acknowledged != [True]:
        assert adapter.stats()["stores_paused"] == 1
    crash(adapter)
    monkeypatch.undo()
    reopened = open_raw(cfg)
    if acknowledged == [True]:
        try:
            found = client(reopened).lookup_and_lock(new_keys).found
            assert found == [True], "an acknowledged store was lost"
            reopened.unlock(new_keys)
            assert load(reopened, new_keys, [len(data[0])]) == ([True], data)
        except BaseException:
            reopened.close()
            raise
    return reopened


def test_stores_after_a_clean_checkpoint_that_cannot_be_superseded_survive_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # meta_verify_on_load false trusts a checkpoint written at shutdown.  When no
    # checkpoint can be written after it (its start-up checkpoint failed), it stays the
    # newest, and a store into a slot it lists -- freed by a delete, then reused -- is
    # seen by nobody after a crash: such a store is refused (counted) instead.
    cfg, _, old_keys, (new_keys, new) = one_key_behind_a_clean_checkpoint(tmp_path)
    monkeypatch.setattr(CheckpointAreas, "write", failing_checkpoint_write)
    adapter = open_raw(cfg)
    assert adapter.stats()["checkpoint_failures"] == 1
    reopened = reuse_slot_crash_and_reopen(adapter, cfg, old_keys, (new_keys, new), monkeypatch)
    try:
        assert reopened.stats().get("corrupt_records_removed", 0) == 0
    finally:
        reopened.close()
    # Once a checkpoint can be written again, stores resume.
    again = open_raw(cfg)
    try:
        assert store(again, new_keys, new) == [True]
    finally:
        again.close()


def test_a_checkpoint_passed_over_at_start_up_never_outranks_the_later_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Both areas unusable at start-up (one damaged, the other's body unreadable for the
    # moment): the run starts from the slot headers and checkpoints from scratch.  Its
    # checkpoints must still outrank the one passed over, which may read again after a
    # crash: a clean one there, trusted (meta_verify_on_load false), would list a slot
    # this run freed and reused, losing the acknowledged store in it.
    cfg, geometry, old_keys, (new_keys, new) = one_key_behind_a_clean_checkpoint(tmp_path)
    # area 0: the start-up checkpoint, damaged; area 1: the clean one, newest, unreadable
    flip_byte(cfg.device_path, geometry.area_offset(0) + geometry.block_align + 3)
    fail_reads_at(monkeypatch, geometry.area_offset(1) + geometry.block_align)
    adapter = open_raw(cfg)
    assert adapter.stats()["checkpoints_unusable"] == 2
    assert adapter.delete(old_keys) == [True]  # slot 0 is free again ...
    assert store(adapter, new_keys, new) == [True]  # ... and holds the new key, acknowledged
    crash(adapter)
    monkeypatch.undo()  # the media error was transient
    reopened = open_raw(cfg)
    try:
        assert client(reopened).lookup_and_lock(new_keys).found == [True], "an acknowledged store was lost"
        reopened.unlock(new_keys)
        assert load(reopened, new_keys, [len(new[0])]) == ([True], new)
    finally:
        reopened.close()


def test_the_smallest_metadata_region_accepted_holds_a_checkpoint(tmp_path: Path) -> None:
    # A metadata region whose checkpoint areas have no room past their header block
    # never holds a checkpoint: every restart, clean ones too, would read every slot
    # header and bring back every deleted object.  Such a size is refused instead.
    from lmcache_tiers.plugin import FieldError

    accepted = []
    for blocks in range(1, 7):
        try:
            cfg = RawBlockConfig(
                device_path=str(tmp_path / f"dev{blocks}.img"),
                slot_bytes=SLOT,
                meta_total_bytes=blocks * 4096,
                capacity_bytes=blocks * 4096 + 4 * SLOT,
            )
        except FieldError:
            continue
        accepted.append(blocks)
        keys = make_keys(2)
        adapter = open_raw(cfg)
        try:
            assert store(adapter, keys, [b"x" * 100] * 2) == [True, True]
            assert adapter.delete(keys[:1]) == [True]
        finally:
            adapter.close()
        reopened = open_raw(cfg)
        try:
            stats = reopened.stats()
            assert stats.get("checkpoint_too_large", 0) == 0, f"{blocks} blocks hold no checkpoint"
            assert client(reopened).lookup_and_lock(keys).found == [False, True], "a delete was undone"
            reopened.unlock(keys[1:])
        finally:
            reopened.close()
    assert accepted


@pytest.mark.parametrize("part", ["header", "body"])
def test_a_clean_checkpoint_passed_over_at_start_up_is_not_left_newest(
    tmp_path: Path, part: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The newest checkpoint, the clean one of the last shutdown, cannot be read at
    # start-up for the moment, and no checkpoint can be written to supersede it.  Once it
    # reads again a restart after a crash trusts it (meta_verify_on_load false): a store
    # into a slot it lists, freed by a delete, would be seen by nobody.  Such a store is
    # refused (counted) until a checkpoint succeeds, as after a clean checkpoint read.
    cfg, geometry, old_keys, (new_keys, new) = one_key_behind_a_clean_checkpoint(tmp_path)
    # area 1: the clean checkpoint, newest, listing the old key in slot 0
    fail_reads_at(monkeypatch, geometry.area_offset(1) + (geometry.block_align if part == "body" else 0))
    monkeypatch.setattr(CheckpointAreas, "write", failing_checkpoint_write)
    adapter = open_raw(cfg)
    assert adapter.stats()["checkpoints_unusable"] == 1
    reuse_slot_crash_and_reopen(adapter, cfg, old_keys, (new_keys, new), monkeypatch).close()


def test_checkpoints_passed_over_in_both_areas_are_both_superseded_before_stores_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Neither checkpoint header can be read at start-up for the moment: the run numbers
    # its checkpoints from 1, and its first one overwrites area 0 only.  Area 1 still
    # holds the clean checkpoint of the last shutdown, of a higher number: read again
    # after a crash it would be trusted, losing a store into a slot it lists.  Stores
    # must wait until area 1 is superseded too.
    cfg, geometry, old_keys, (new_keys, new) = one_key_behind_a_clean_checkpoint(tmp_path)
    read_at = BlockDevice.read_at
    unreadable = {geometry.area_offset(0), geometry.area_offset(1)}

    def failing(self: BlockDevice, offset: int, length: int) -> bytes:
        if offset in unreadable:
            raise OSError(errno.EIO, "injected media error")
        return read_at(self, offset, length)

    monkeypatch.setattr(BlockDevice, "read_at", failing)
    adapter = open_raw(cfg)
    assert adapter.stats()["checkpoints_unusable"] == 2
    reuse_slot_crash_and_reopen(adapter, cfg, old_keys, (new_keys, new), monkeypatch).close()


def test_a_superseded_record_of_another_chain_does_not_hide_the_newer_write(tmp_path: Path) -> None:
    check_a_superseded_record_of_another_chain_does_not_hide_the_newer_write(config(tmp_path / "dev.img"))


def _checkpoint_bug(self: CheckpointAreas, *args: object, **kwargs: object) -> None:
    raise RuntimeError("injected checkpoint bug")


def test_a_periodic_checkpoint_raising_a_bug_is_counted_and_the_checkpoints_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An exception other than an I/O error must not end the checkpoint thread: the
    periodic checkpoints would stop for good (a crash then recovers from an ever older
    one), with nothing counted and only a traceback on stderr."""
    adapter = open_raw(config(tmp_path / "dev.img", meta_checkpoint_interval_sec=1))
    try:
        written = adapter.stats()["checkpoints_written"]
        write_checkpoint = CheckpointAreas.write
        monkeypatch.setattr(CheckpointAreas, "write", _checkpoint_bug)
        with caplog.at_level(logging.WARNING, logger="lmcache_plugin_raw_block"):
            assert store(adapter, make_keys(1), [b"x" * 100]) == [True]  # a change to checkpoint
            for _ in range(600):
                if adapter.stats().get("checkpoint_failures", 0):
                    break
                time.sleep(0.05)
        assert adapter.stats().get("checkpoint_failures", 0) >= 1
        assert "injected checkpoint bug" in caplog.text
        monkeypatch.setattr(CheckpointAreas, "write", write_checkpoint)
        for _ in range(600):
            if adapter.stats()["checkpoints_written"] > written:
                break
            time.sleep(0.05)
        assert adapter.stats()["checkpoints_written"] > written, "the periodic checkpoints ended"
    finally:
        adapter.close()


def test_every_thread_of_the_adapter_is_named_for_it(tmp_path: Path) -> None:
    """A thread dump of a server with two slot-store adapters (raw_block, dax) must say
    whose each load and store worker is: every thread names its adapter."""
    before = set(threading.enumerate())
    adapter = open_raw(config(tmp_path / "dev.img", meta_checkpoint_interval_sec=1))
    try:
        keys = make_keys(2)
        data = [pattern(1, 3000), pattern(2, 3000)]
        assert store(adapter, keys, data) == [True, True]
        assert load(adapter, keys, [len(d) for d in data]) == ([True, True], data)
        names = sorted(thread.name for thread in threading.enumerate() if thread not in before)
    finally:
        adapter.close()
    assert any("load" in name for name in names) and any("store" in name for name in names), names
    assert [name for name in names if adapter.name not in name] == []


def _another_checkpoint_bug(self: CheckpointAreas, *args: object, **kwargs: object) -> None:
    raise ValueError("injected second checkpoint bug")


def _wait_checkpoint_failures(adapter: BackendAdapter, count: int) -> None:
    for _ in range(600):
        if adapter.stats().get("checkpoint_failures", 0) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} checkpoint failures counted")


def test_a_later_periodic_checkpoint_bug_is_named_in_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the first failure is logged with its traceback; a later one, maybe another
    bug, must still say what it is, not only that the checkpoint failed again."""
    adapter = open_raw(config(tmp_path / "dev.img", meta_checkpoint_interval_sec=1))
    write_checkpoint = CheckpointAreas.write
    try:
        monkeypatch.setattr(CheckpointAreas, "write", _checkpoint_bug)
        with caplog.at_level(logging.WARNING, logger="lmcache_plugin_raw_block"):
            assert store(adapter, make_keys(1), [b"x" * 100]) == [True]  # a change to checkpoint
            _wait_checkpoint_failures(adapter, 1)
            # The first failure is counted after its write raised: the next periodic
            # checkpoint, an interval later, meets the second bug.
            monkeypatch.setattr(CheckpointAreas, "write", _another_checkpoint_bug)
            _wait_checkpoint_failures(adapter, 2)
        assert "ValueError: injected second checkpoint bug" in caplog.text
    finally:
        monkeypatch.setattr(CheckpointAreas, "write", write_checkpoint)
        adapter.close()
