"""The slot table shared by raw_block and dax: lowest-first claims, generations, readers."""

from __future__ import annotations

import pytest
from lmcache_plugin_raw_block.slots import SlotEntry, SlotTable

from lmcache_tiers.testing.l2 import make_keys


def written(table: SlotTable, key_index: int, size: int = 10) -> SlotEntry:
    (claim,) = table.claim(1)
    entry = SlotEntry(claim.slot, claim.seq, size, size)
    assert table.publish(make_keys(1, start=key_index)[0], entry)
    return entry


def test_claims_take_the_lowest_free_slots_with_growing_sequence_numbers() -> None:
    table = SlotTable(8)
    claims = table.claim(3)
    assert [c.slot for c in claims] == [0, 1, 2]
    assert [c.seq for c in claims] == [1, 2, 3]
    table.abandon(claims[1])
    assert [c.slot for c in table.claim(2)] == [1, 3]
    assert len(table.claim(10)) == 4, "only what is free"
    assert table.claim(1) == []


def test_a_slot_being_read_is_reused_only_after_its_readers_leave() -> None:
    freed: list[int] = []
    table = SlotTable(2, on_free=freed.append)
    (key,) = make_keys(1)
    old = written(table, 0)
    (held,) = table.acquire([key])
    assert held == old
    newer = written(table, 0)  # an overwrite retires the old slot
    assert table.lookup([key]) == [newer]
    assert table.claim(1) == [], "the retired slot must not be handed out under its reader"
    assert freed == []
    assert table.delete([key]) == [True]
    assert freed == [newer.slot]
    table.release([held])
    assert freed == [newer.slot, old.slot]
    assert {c.slot for c in table.claim(2)} == {0, 1}


def test_on_unpublish_is_called_when_a_slot_stops_being_its_keys_object_readers_or_not() -> None:
    unpublished: list[int] = []
    table = SlotTable(4, on_unpublish=unpublished.append)
    (key,) = make_keys(1)
    old = written(table, 0)
    (held,) = table.acquire([key])
    newer = written(table, 0)
    assert unpublished == [old.slot], "at once, though still read"
    assert table.delete([key]) == [True]
    assert unpublished == [old.slot, newer.slot]
    table.release([held])
    assert unpublished == [old.slot, newer.slot], "not again when freed"


def test_delete_refuses_a_key_being_read() -> None:
    table = SlotTable(2)
    (key,) = make_keys(1)
    written(table, 0)
    entries = table.acquire([key])
    assert table.delete([key]) == [False]
    table.release(entries)
    assert table.delete([key]) == [True]


def test_an_older_write_finishing_last_does_not_replace_a_newer_one() -> None:
    freed: list[int] = []
    table = SlotTable(4, on_free=freed.append)
    (key,) = make_keys(1)
    first, second = table.claim(2)
    assert table.publish(key, SlotEntry(second.slot, second.seq, 5, 5))
    assert not table.publish(key, SlotEntry(first.slot, first.seq, 7, 7))
    assert table.lookup([key]) == [SlotEntry(second.slot, second.seq, 5, 5)]
    assert freed == [first.slot]


def test_discard_removes_only_the_entry_it_was_given() -> None:
    table = SlotTable(4)
    (key,) = make_keys(1)
    old = written(table, 0)
    new = written(table, 0)
    assert not table.discard(key, old)
    assert table.discard(key, new)
    assert table.lookup([key]) == [None]
    assert table.used_slots == 0


def test_snapshot_watches_claimed_retired_and_quarantined_slots() -> None:
    table = SlotTable(8)
    (key,) = make_keys(1)
    old = written(table, 0)
    held = table.acquire([key])
    written(table, 0)  # retires slot 0 under its reader
    pending, broken = table.claim(2)
    table.abandon(broken, quarantine=True)
    snapshot = table.snapshot()
    assert [entry.slot for _key, entry in snapshot.entries] == [1]
    assert snapshot.watched == sorted(
        [(pending.slot, pending.seq), (old.slot, snapshot.next_seq), (broken.slot, snapshot.next_seq)]
    )
    assert table.quarantined_slots == 1
    table.release(held)


def test_restore_keeps_the_newest_write_of_each_key_and_frees_the_rest() -> None:
    table = SlotTable(6)
    keys = make_keys(2)
    superseded = table.restore(
        [
            (keys[0], SlotEntry(4, 10, 1, 1)),
            (keys[0], SlotEntry(2, 12, 1, 1)),
            (keys[1], SlotEntry(3, 11, 1, 1)),
        ],
        next_seq=5,
    )
    assert superseded == [SlotEntry(4, 10, 1, 1)]
    assert table.lookup(keys) == [SlotEntry(2, 12, 1, 1), SlotEntry(3, 11, 1, 1)]
    claims = table.claim(6)
    assert [c.slot for c in claims] == [0, 1, 4, 5]
    assert claims[0].seq == 13, "sequence numbers continue past every recovered write"
    with pytest.raises(RuntimeError):
        table.restore([], next_seq=1)


#: the slot header of each device format version, as written by the code of that version;
#: a layout change without a new version would make a newer server's slots read here as
#: empty and be overwritten as free (a slot header has no version field of its own)
SLOT_HEADER_BY_VERSION = {
    1: "4c4d5452534c4f54000102030405060708090a0b0c0d0e0f07000000000000002a00000000000000"
    "e803000000000000d0070000000000001a0000000600000099464f6b95ab73756974652d6d6f64656c"
    "00c408000000000000000000a07265636f7264",
}


def test_a_slot_header_layout_change_needs_a_new_device_format_version() -> None:
    from lmcache_plugin_raw_block.slotheader import DEVICE_FORMAT_VERSION, encode_slot_header
    from lmcache_plugin_raw_block.superblock import SUPERBLOCK_VERSION

    from lmcache_tiers.plugin import ObjectKey

    assert SUPERBLOCK_VERSION == DEVICE_FORMAT_VERSION, "the superblock names the slot headers' format"
    key = ObjectKey(model_name="suite-model", kv_rank=0, chunk_hash=bytes(8), object_group=0, cache_salt="")
    header = encode_slot_header(bytes(range(16)), 7, 42, key, 1000, 2000, b"record")
    assert header.hex() == SLOT_HEADER_BY_VERSION[DEVICE_FORMAT_VERSION], (
        "slot header layout changed: bump DEVICE_FORMAT_VERSION and add its encoding here"
    )
