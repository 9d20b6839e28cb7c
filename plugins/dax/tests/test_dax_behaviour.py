"""dax beyond the conformance suite: restarts, damage, readers and generations, several
mappings, eviction with pinned keys, capacity across restarts."""

from __future__ import annotations

import logging
import threading

import pytest
from dax_helpers import SLOT, backend_of, client, config, flip_byte, load, open_dax, shm_dir, size_gb, store
from lmcache_plugin_dax import DaxConfig, DaxDevice
from slot_helpers import (
    ZlibSerde,
    as_newer_format,
    check_an_object_replaced_by_another_size_is_a_counted_miss,
    lru_controller,
)

from lmcache_tiers.l2.adapter import BackendCloseFailed
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.threads import joined, wait_until


def data_for(count: int, seed: int = 0) -> list[bytes]:
    return [pattern(seed * 1000 + i, SLOT - i * 977) for i in range(count)]


def test_a_restart_finds_the_committed_objects_and_their_usage() -> None:
    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        keys, data = make_keys(5), data_for(5)
        adapter = open_dax(cfg)
        assert store(adapter, keys, data) == [True] * 5
        assert adapter.delete(keys[4:]) == [True]
        adapter.close()
        reopened = open_dax(cfg)
        try:
            assert reopened.stats()["recovered_objects"] == 4
            assert reopened.used_bytes() == sum(map(len, data[:4]))
            assert reopened.usage() == 4 / 16
            assert load(reopened, keys[:4], [len(d) for d in data[:4]]) == ([True] * 4, data[:4])
            assert client(reopened).lookup_and_lock(keys[4:]).found == [False]
        finally:
            reopened.close()


def test_persist_enabled_false_starts_empty_as_lmcache_does() -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img"))
        assert store(adapter, make_keys(2), data_for(2)) == [True, True]
        adapter.close()
        fresh = open_dax(config(directory / "dax.img", persist_enabled=False))
        try:
            assert list(fresh.iter_keys()) == []
        finally:
            fresh.close()


def test_a_mapping_reformatted_for_another_geometry_is_counted() -> None:
    """A changed geometry drops every object of the mapping: logged and counted, as
    raw_block counts its formats."""
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img"))
        try:
            assert adapter.stats()["device_formats"] == 1, "a blank file is formatted"
            assert store(adapter, make_keys(2), data_for(2)) == [True, True]
        finally:
            adapter.close()
        same = open_dax(config(directory / "dax.img"))
        try:
            assert same.stats().get("device_formats", 0) == 0
        finally:
            same.close()
        smaller = open_dax(config(directory / "dax.img", slots=8))
        try:
            assert smaller.stats()["device_formats"] == 1
            assert list(smaller.iter_keys()) == []
        finally:
            smaller.close()


def test_a_reformat_for_another_geometry_names_what_changed(caplog: pytest.LogCaptureFixture) -> None:
    """docs/upgrading.md: another geometry reformats the mapping "with one WARNING naming
    what changed" -- the operator's edit that dropped the cache, as raw_block names it."""
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img"))
        try:
            assert store(adapter, make_keys(2), data_for(2)) == [True, True]
        finally:
            adapter.close()
        with caplog.at_level(logging.WARNING, logger="lmcache_plugin_dax"):
            smaller = open_dax(config(directory / "dax.img", slots=8))
        try:
            assert smaller.stats()["device_formats"] == 1
        finally:
            smaller.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "its geometry changed (" in warnings[0] and "slot_count 16 -> 8" in warnings[0], warnings[0]
    assert "its objects are dropped" in warnings[0], warnings[0]


@pytest.mark.parametrize("where", ["slot", "index entry"])
def test_a_flipped_byte_is_a_miss_removed_for_good(where: str) -> None:
    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        keys, data = make_keys(2), data_for(2)
        adapter = open_dax(cfg)
        try:
            assert store(adapter, keys, data) == [True, True]
            backend = backend_of(adapter)
            entry = backend.table.lookup(keys[:1])[0]
            assert entry is not None
            region, local = backend._place(entry.slot)
            layout = region.layout
            offset = layout.slot_offset(local) + 1234 if where == "slot" else layout.entry_offset(local) + 40
            flip_byte(cfg.device_path, offset)  # through the file: the mapping is shared
            loaded, contents = load(adapter, keys, [len(d) for d in data])
            assert loaded == [False, True] and contents[1] == data[1]
            assert adapter.stats()["corrupt_records_removed"] == 1
            assert adapter.used_bytes() == len(data[1]), "released as it was removed"
            assert int(region.commits[local]) == 0, "uncommitted, so a restart does not bring it back"
        finally:
            adapter.close()
        reopened = open_dax(cfg)
        try:
            assert client(reopened).lookup_and_lock(keys).found == [False, True]
            reopened.unlock(keys[1:])
        finally:
            reopened.close()


def test_a_damaged_index_entry_is_dropped_at_restart(caplog: pytest.LogCaptureFixture) -> None:
    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        keys, data = make_keys(3), data_for(3)
        adapter = open_dax(cfg)
        assert store(adapter, keys, data) == [True] * 3
        region, local = backend_of(adapter)._place(backend_of(adapter).table.lookup(keys[1:2])[0].slot)  # type: ignore[union-attr]
        offset = region.layout.entry_offset(local) + 100
        adapter.close()
        flip_byte(cfg.device_path, offset)
        with caplog.at_level(logging.WARNING):
            reopened = open_dax(cfg)
        try:
            assert reopened.stats()["recovery_dropped_slots"] == 1
            assert "1 committed index entries dropped: they do not verify" in caplog.text
            assert f"e.g. slot {local}" in caplog.text
            assert client(reopened).lookup_and_lock(keys).found == [True, False, True]
            reopened.unlock([keys[0], keys[2]])
        finally:
            reopened.close()


def test_a_superblock_of_a_newer_format_is_reformatted_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        adapter = open_dax(cfg)
        assert store(adapter, make_keys(1), data_for(1)) == [True]
        adapter.close()
        with open(cfg.device_path, "r+b") as mapping:
            mapping.seek(8)  # after the magic: the superblock's format version
            mapping.write((2).to_bytes(4, "little"))
        with caplog.at_level("WARNING", logger="lmcache_plugin_dax"):
            reopened = open_dax(cfg)
        try:
            assert reopened.stats()["device_formats"] == 1
            assert "superblock is of format version 2, newer than the 1 this code reads" in caplog.text
        finally:
            reopened.close()


def test_a_record_of_a_newer_format_is_kept_as_a_miss() -> None:
    """A committed slot whose record a newer server wrote (before a downgrade) is intact:
    at restart it is counted ``record_version_unknown`` and from then on a miss that is
    kept -- no lookup finds it, a load skips it; listed, accounted, still committed --
    never dropped as damage."""
    from lmcache_plugin_dax.layout import COMMIT_BYTES, ENTRY_BYTES

    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        keys, data = make_keys(2), data_for(2)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        assert store(adapter, keys, data) == [True, True]
        entry = backend.table.lookup(keys[:1])[0]
        assert entry is not None
        region, local = backend._place(entry.slot)
        offset, identity = region.layout.entry_offset(local) + COMMIT_BYTES, region.identity
        adapter.close()
        with open(cfg.device_path, "r+b") as mapping:
            mapping.seek(offset)
            newer = as_newer_format(mapping.read(ENTRY_BYTES - COMMIT_BYTES), identity, local)
            mapping.seek(offset)
            mapping.write(newer)
        for _restart in range(2):
            reopened = open_dax(cfg)
            try:
                assert set(reopened.iter_keys()) == set(keys), "listed"
                assert reopened.used_bytes() == sum(map(len, data)), "accounted"
                assert client(reopened).lookup_and_lock(keys).found == [False, True]
                reopened.unlock(keys[1:])
                loaded, contents = load(reopened, keys, [len(d) for d in data])
                assert loaded == [False, True]
                assert contents[1] == data[1]
                stats = reopened.stats()
                assert stats["record_version_unknown"] == 1  # at the restart: the load is skipped
                assert stats.get("corrupt_records_removed", 0) == 0
                assert stats["slots_used"] == 2
            finally:
                reopened.close()


def test_a_slot_being_read_is_reclaimed_only_after_its_reader_leaves() -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img", slots=2))
        try:
            backend = backend_of(adapter)
            (key,) = make_keys(1)
            assert store(adapter, [key], [b"old" * 1000]) == [True]
            (reading,) = backend.table.acquire([key])  # a load copying the old object out
            assert reading is not None
            region, local = backend._place(reading.slot)
            assert store(adapter, [key], [b"new" * 1000]) == [True]  # the overwrite takes the other slot
            assert store(adapter, make_keys(1, start=5), [b"x"]) == [False], "the read slot is not reused"
            assert int(region.commits[local]) == 0, "uncommitted as soon as it was replaced"
            backend.table.release([reading])
            assert store(adapter, make_keys(1, start=5), [b"x"]) == [True]
            assert load(adapter, [key], [3000]) == ([True], [b"new" * 1000])
        finally:
            adapter.close()


def test_a_replaced_object_read_until_after_close_does_not_come_back_at_restart() -> None:
    # The old write's slot is still read when its key is stored again and the newer
    # write deleted; the reader leaves only once close unmapped the file.  The old bytes
    # must not be that key's object after the restart.
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=4)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        (key,) = make_keys(1)
        assert store(adapter, [key], [b"old" * 1000]) == [True]
        (reading,) = backend.table.acquire([key])  # a load copying the old object out
        assert store(adapter, [key], [b"new" * 1000]) == [True]
        assert adapter.delete([key]) == [True]
        adapter.close()
        backend.table.release([reading])
        reopened = open_dax(cfg)
        try:
            assert reopened.stats().get("recovered_objects", 0) == 0
            assert client(reopened).lookup_and_lock([key]).found == [False]
        finally:
            reopened.close()


def test_a_load_of_an_object_replaced_while_it_is_copied_is_served() -> None:
    # Uncommitted when replaced, the old slot is not reused under its reader: its bytes,
    # verified, are still that write's.
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img", slots=4))
        try:
            backend = backend_of(adapter)
            (key,) = make_keys(1)
            assert store(adapter, [key], [b"old" * 1000]) == [True]
            (reading,) = backend.table.acquire([key])
            assert reading is not None
            assert store(adapter, [key], [b"new" * 1000]) == [True]
            target = bytearray(3000)
            outcomes = backend._load_group([key], [reading], [memoryview(target)])
            backend.table.release([reading])
            assert outcomes == [True]
            assert bytes(target) == b"old" * 1000
            assert adapter.stats().get("generation_mismatch", 0) == 0
        finally:
            adapter.close()


def test_a_slot_whose_generation_changed_under_a_load_is_not_served() -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img"))
        try:
            backend = backend_of(adapter)
            (key,) = make_keys(1)
            assert store(adapter, [key], [b"v" * 5000]) == [True]
            entry = backend.table.lookup([key])[0]
            assert entry is not None
            region, local = backend._place(entry.slot)
            region.commits[local] = entry.seq + 7  # as if another writer reused the slot
            assert load(adapter, [key], [5000])[0] == [False]
            assert adapter.stats()["generation_mismatch"] == 1
        finally:
            adapter.close()


def test_objects_are_spread_over_every_mapping_and_found_after_a_restart() -> None:
    with shm_dir() as directory:
        cfg = DaxConfig(
            slot_bytes=SLOT,
            devices=(
                DaxDevice(device_path=str(directory / "a.img"), max_dax_size_gb=size_gb(4)),
                DaxDevice(device_path=str(directory / "b.img"), max_dax_size_gb=size_gb(8)),
            ),
        )
        keys, data = make_keys(10), data_for(10)
        adapter = open_dax(cfg)
        assert adapter.stats()["slots_total"] == 12
        assert store(adapter, keys, data) == [True] * 10
        regions = backend_of(adapter).regions
        assert [len(region.committed()) for region in regions] == [4, 6]
        adapter.close()
        reopened = open_dax(cfg)
        try:
            assert load(reopened, keys, [len(d) for d in data]) == ([True] * 10, data)
        finally:
            reopened.close()


def test_a_write_made_while_a_mapping_was_left_out_wins_over_that_mappings_older_write() -> None:
    # A run with mapping b only leaves many writes there; a run with a only stores the
    # same key again, numbering its writes from what a holds.  Listing both again, the
    # key is the newer write, not b's older one (a chunk stored again under another
    # layout would otherwise come back in the old one).
    with shm_dir() as directory:
        a = DaxDevice(device_path=str(directory / "a.img"), max_dax_size_gb=size_gb(8))
        b = DaxDevice(device_path=str(directory / "b.img"), max_dax_size_gb=size_gb(8))
        (key,) = make_keys(1)
        fillers = make_keys(6, start=100)
        only_b = open_dax(DaxConfig(slot_bytes=SLOT, devices=(b,)))
        assert store(only_b, fillers, data_for(6)) == [True] * 6
        assert store(only_b, [key], [b"old" * 1000]) == [True]
        only_b.close()
        only_a = open_dax(DaxConfig(slot_bytes=SLOT, devices=(a,)))
        assert store(only_a, [key], [b"new" * 1000]) == [True]
        only_a.close()
        both = open_dax(DaxConfig(slot_bytes=SLOT, devices=(a, b)))
        try:
            assert load(both, [key], [3000]) == ([True], [b"new" * 1000])
            assert both.stats()["recovery_dropped_slots"] == 1  # b's older write, uncommitted
        finally:
            both.close()


def test_objects_larger_than_a_slot_are_refused_and_counted() -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img"))
        try:
            assert store(adapter, make_keys(2), [b"a" * SLOT, b"b" * (SLOT + 1)]) == [True, False]
            assert adapter.stats()["object_too_large"] == 1
        finally:
            adapter.close()


def test_an_object_replaced_by_another_size_since_the_lookup_is_a_counted_miss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img"))
        try:
            check_an_object_replaced_by_another_size_is_a_counted_miss(adapter, caplog)
        finally:
            adapter.close()


def test_eviction_frees_slots_and_skips_pinned_keys() -> None:
    with shm_dir() as directory:
        adapter = open_dax(config(directory / "dax.img", slots=4))
        try:
            controller = lru_controller(adapter, watermark=0.75, ratio=0.5)
            keys = make_keys(4)
            assert store(adapter, keys, [pattern(i, 1000) for i in range(4)]) == [True] * 4
            assert adapter.usage() == 1.0
            assert client(adapter).lookup_and_lock(keys[3:]).found == [True]  # pinned by a prefetch
            controller.evict(2000)
            remaining = set(adapter.iter_keys())
            assert keys[3] in remaining and len(remaining) == 2
            adapter.unlock(keys[3:])
            controller.evict(1000)
            assert keys[3] not in set(adapter.iter_keys()), "retried in the next cycle"
            commits = backend_of(adapter).regions[0].committed()
            assert len(commits) == 1, "evicted slots are uncommitted"
        finally:
            adapter.close()


@pytest.mark.parametrize("evict", [False, True])
def test_capacity_is_held_across_three_restarts(evict: bool) -> None:
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=8)
        for run in range(4):
            adapter = open_dax(cfg)
            try:
                if run:
                    assert adapter.usage() == (1.0 if not evict else adapter.usage())
                    assert adapter.usage() <= 1.0
                controller = lru_controller(adapter, watermark=0.75, ratio=0.25) if evict else None
                for key in make_keys(8, start=run * 100):
                    stored = store(adapter, [key], [pattern(run, 3000)])
                    if controller is not None:
                        controller.step(set())
                    if not evict and run:
                        assert stored == [False], "a full mapping refuses new objects after a restart"
                    assert adapter.usage() <= 1.0
                objects = len(set(adapter.iter_keys()))
                assert objects <= 8 and adapter.stats()["slots_used"] == objects
                assert len(backend_of(adapter).regions[0].committed()) == objects
            finally:
                adapter.close()


def test_serde_records_keep_their_l1_size_and_other_chains_are_kept_as_misses() -> None:
    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        keys = make_keys(2)
        data = [bytes(50_000), b"ab" * 20_000]
        adapter = open_dax(cfg, serde=(ZlibSerde(),))
        assert store(adapter, keys, data) == [True, True]
        adapter.close()
        plain = open_dax(cfg)
        try:
            assert client(plain).lookup_and_lock(keys).found == [False, False]
            assert len(list(plain.iter_keys())) == 2, "kept, not deleted"
        finally:
            plain.close()
        again = open_dax(cfg, serde=(ZlibSerde(),))
        try:
            result = client(again).lookup_and_lock(keys)
            assert result.sizes == [len(d) for d in data]
            again.unlock(keys)
            assert load(again, keys, [len(d) for d in data]) == ([True, True], data)
        finally:
            again.close()


def test_a_delete_after_close_is_refused_not_acknowledged_and_lost() -> None:
    # Once close drained, the mapping is no longer written: a delete that said True would
    # leave the commit word set, and the restart would bring the key back.
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=4)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        (key,) = make_keys(1)
        assert store(adapter, [key], [b"kept" * 100]) == [True]
        adapter.close()
        assert backend.delete_many([key]) == [False], "refused: the mapping is gone"
        reopened = open_dax(cfg)
        try:
            assert client(reopened).lookup_and_lock([key]).found == [True], "what was not deleted is kept"
        finally:
            reopened.close()


def test_a_write_replaced_while_close_drains_is_uncommitted_before_the_unmapping() -> None:
    # A store still running when close begins replaces a key: its old slot's commit word
    # is cleared while the mapping is still mapped, before close unmaps it.
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=4)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        (key,) = make_keys(1)
        assert store(adapter, [key], [b"old" * 100]) == [True]
        with backend._in_flight.use():  # a store still running
            closer = threading.Thread(target=adapter.close, daemon=True)
            closer.start()
            wait_until(lambda: backend._in_flight._closed, "the close to stop new calls", interval=0.001)
            assert backend.table.delete([key]) == [True]  # as its replace would unpublish it
        joined(closer, "the close after the running store ended")
        reopened = open_dax(cfg)
        try:
            assert client(reopened).lookup_and_lock([key]).found == [False], (
                "the unpublished write stays gone"
            )
        finally:
            reopened.close()


def test_a_superseded_record_of_another_chain_does_not_hide_the_newer_write() -> None:
    # A crash between a write's commit and the uncommit of the write it replaced leaves
    # both committed; the older, of another serde chain, must not make the key a miss.
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=4)
        (key,) = make_keys(1)
        zipped = open_dax(cfg, serde=(ZlibSerde(),))
        assert store(zipped, [key], [bytes(3000)]) == [True]
        (old,) = backend_of(zipped).table.lookup([key])
        assert old is not None
        region, local = backend_of(zipped)._place(old.slot)
        commit_at = region.layout.entry_offset(local)
        zipped.close()
        plain = open_dax(cfg)
        assert store(plain, [key], [b"new" * 1000]) == [True]
        plain.close()
        with open(directory / "dax.img", "r+b") as image:  # the crash: old still committed
            image.seek(commit_at)
            image.write(old.seq.to_bytes(8, "little"))
        reopened = open_dax(cfg)
        try:
            assert reopened.stats().get("recovered_objects", 0) == 1
            assert reopened.stats().get("serde_chain_mismatch", 0) == 0
            assert load(reopened, [key], [3000]) == ([True], [b"new" * 1000])
            assert len(backend_of(reopened).regions[0].committed()) == 1, "the older uncommitted"
        finally:
            reopened.close()


def test_a_write_unpublished_while_a_close_gives_up_draining_does_not_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A copy stuck in the mapping makes close give up draining and leave the mapping in
    # place; a key deleted (or replaced) meanwhile must still have its commit word
    # cleared, or the restart brings it back with bytes it once had.
    import lmcache_plugin_dax.backend as dax_backend

    monkeypatch.setattr(dax_backend, "CLOSE_DRAIN_S", 0.05)
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=4)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        kept, deleted = make_keys(2)
        assert store(adapter, [kept, deleted], [b"kept" * 100, b"old" * 100]) == [True, True]
        with backend._in_flight.use():  # a copy that does not finish
            closer = threading.Thread(target=adapter.close, daemon=True)
            closer.start()
            wait_until(lambda: backend._in_flight._closed, "the close to stop new calls", interval=0.001)
            assert backend.table.delete([deleted]) == [True]  # a delete still running
            joined(closer, "the close giving up on a copy that does not finish")
        for region in backend.regions:
            region.close()  # what the process's exit does to the mapping left in place
        reopened = open_dax(cfg)
        try:
            assert client(reopened).lookup_and_lock([kept, deleted]).found == [True, False]
        finally:
            reopened.close()


def test_a_slot_unpublished_after_the_unmapping_stays_committed_and_is_counted() -> None:
    # A load that found its object damaged and outlived close's drain removes it only
    # once the mapping is gone: its commit word cannot be cleared any more, which is
    # counted and logged (the restart judges that write again).
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=4)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        (key,) = make_keys(1)
        assert store(adapter, [key], [b"kept" * 100]) == [True]
        (entry,) = backend.table.lookup([key])
        assert entry is not None
        adapter.close()
        assert backend.table.discard(key, entry)
        assert adapter.stats()["uncommit_after_close"] == 1
        reopened = open_dax(cfg)
        try:
            assert load(reopened, [key], [400]) == ([True], [b"kept" * 100]), "judged again, intact"
        finally:
            reopened.close()


def test_a_close_whose_uncommitting_fails_fails_and_still_unmaps_and_nothing_old_comes_back() -> None:
    # The commit word of a replaced or deleted write is cleared when it is unpublished, not
    # at close: a close that fails (counted, failing the stop) brings back no old version
    # and no deleted key, and still gives the mapping (and its lock) back.
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", slots=4)
        adapter = open_dax(cfg)
        backend = backend_of(adapter)
        replaced, deleted = make_keys(2)
        assert store(adapter, [replaced, deleted], [b"old" * 100, b"gone" * 100]) == [True, True]
        assert store(adapter, [replaced], [b"new" * 100]) == [True]
        assert backend.delete_many([deleted]) == [True]

        def failing() -> None:
            raise OSError(5, "Input/output error")

        backend._uncommit_unpublished = failing  # type: ignore[method-assign]
        with pytest.raises(BackendCloseFailed, match="Input/output error"):
            adapter.close()
        assert adapter.stats()["backend_close_failures"] == 1
        reopened = open_dax(cfg)  # the mapping's lock was given back
        try:
            assert client(reopened).lookup_and_lock([replaced, deleted]).found == [True, False]
            reopened.unlock([replaced])
            assert load(reopened, [replaced], [300]) == ([True], [b"new" * 100])
        finally:
            reopened.close()
