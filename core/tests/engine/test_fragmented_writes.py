"""A write larger than every free extent while L1 has the room in total (fragmentation).

Evicting the write's size in the policy's order frees that many bytes, but maybe in pieces
none of which holds the object.  Eviction goes on until the write fits; a write that no
eviction can fit (locked objects lie between the pieces) is refused before anything is
evicted for it.
"""

from __future__ import annotations

import itertools

import pytest
from engine_support import MiB, keys_of, payload, store

from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.storage import StorageManager


def fragment(storage: StorageManager, size: int) -> list:
    """Fill the 64 MiB L1 with 63 objects of ``size`` (1 MiB) and evict every other one:
    half of L1 is free, in holes of ``size`` bytes between the even objects."""
    resident = keys_of(1, 63)
    assert len(store(storage, resident, size)) == 63
    assert storage.evict(resident[1::2]) == 31
    assert storage.l1.fragmentation() == 1 - 1 / 32  # 32 holes of one object each
    return resident[0::2]


def touch(storage: StorageManager, keys: list) -> None:
    """Read ``keys`` so that a least-recently-used policy offers the others first."""
    assert len(storage.read(keys)) == len(keys)
    storage.release(keys)


def test_a_write_over_every_free_extent_evicts_until_it_fits(engine) -> None:
    storage = engine([], eviction_trigger_watermark=1.0)  # no background eviction in the way
    kept = fragment(storage, MiB)
    # The least recently used objects lie apart: evicting 16 MiB of them frees 16 MiB in
    # 3 MiB pieces, and only evicting more joins the holes into a 16 MiB extent.
    touch(storage, kept[0::2])
    big = keys_of(2, 1)
    assert store(storage, big, 16 * MiB) == big
    [obj] = storage.read(big)
    assert bytes(storage.view(obj)) == payload(big[0], 16 * MiB)
    storage.release(big)
    assert "l1_write_oom" not in storage.failures()


def locked_apart(storage: StorageManager) -> tuple[list, list]:
    """Fragment L1 and read-lock the objects at 20 and 40 MiB: evicting every other object
    would leave free spans of 20, 19 and 23 MiB.  Returns (kept objects, locked ones)."""
    kept = fragment(storage, MiB)
    barriers = [kept[10], kept[20]]
    assert len(storage.read(barriers)) == 2
    return kept, barriers


@pytest.mark.parametrize(
    ("count", "size", "refusal"),
    [
        # none of the spans holds 24 MiB, though 54 MiB could be freed
        (1, 24 * MiB, "hold only 0 of its 1 objects of 25165824 bytes or more"),
        # each of three 20 MiB objects fits in one, and 60 MiB in 62, but only two at once
        (3, 20 * MiB, "hold only 2 of its 3 objects of 20971520 bytes or more"),
    ],
)
def test_a_write_no_eviction_can_fit_is_refused_before_evicting(
    engine, count: int, size: int, refusal: str
) -> None:
    storage = engine([], eviction_trigger_watermark=1.0)
    kept, barriers = locked_apart(storage)
    with pytest.raises(L1OutOfMemoryError, match=refusal):
        store(storage, keys_of(2, count), size)
    assert storage.status()["eviction"]["l1"]["evicted_keys"] == 0
    assert storage.failures()["l1_write_oom"] == 1
    assert all(storage.l1.contains(key) for key in kept)
    storage.release(barriers)
    assert store(storage, keys_of(3, 1), 24 * MiB)  # fits once the locks are gone


def test_a_write_that_evicts_past_a_few_locked_objects_does_not_scan_them(engine, monkeypatch) -> None:
    # The widest span eviction can free is at least the reclaimable bytes over one more
    # than the extents no eviction frees: with 4 locked 1 MiB objects among 63 in a
    # 64 MiB L1 (below 100%: the background eviction stays out of it), over 11 MiB.  A
    # write of 2 MiB that must evict is then known to fit without the scan of every
    # locked extent (sorted, under the L1 lock: O(locked) per write of a full L1,
    # hundreds of milliseconds with 100k locks).
    storage = engine([], eviction_trigger_watermark=1.0)
    resident = keys_of(1, 63)
    assert len(store(storage, resident, MiB)) == 63
    assert len(storage.read(resident[::16])) == 4
    scans = []
    exact = storage.l1.reclaimable_spans
    monkeypatch.setattr(storage.l1, "reclaimable_spans", lambda: scans.append(1) or exact())
    big = keys_of(2, 1)
    assert store(storage, big, 2 * MiB) == big
    assert storage.status()["eviction"]["l1"]["evicted_keys"] > 0  # it did have to evict
    assert scans == []
    storage.release(resident[::16])


def test_a_write_that_others_keep_outrunning_evicts_at_most_what_it_could_free(engine, monkeypatch) -> None:
    # Another writer takes the room each round of eviction frees before this write can
    # (between the round and the reservation, when neither holds the L1 lock): the write
    # gives up once it has evicted what evicting every unlocked object would have freed
    # when it began, instead of evicting on for as long as the others write.  (63 of 64
    # MiB used: the background eviction, at 100%, stays out of it.)
    storage = engine([], eviction_trigger_watermark=1.0)
    assert len(store(storage, keys_of(1, 63), MiB)) == 63
    evict_now = storage.l1_eviction.evict_now
    others = iter(range(1000, 2000))

    def evict_then_another_writes(bytes_to_free: int, **kwargs) -> int:
        freed = evict_now(bytes_to_free, **kwargs)
        for prompt in itertools.islice(others, freed // MiB):  # 1000 writes, then none
            other = keys_of(prompt, 1)
            storage.l1.reserve_write(other, [MiB])
            storage.l1.finish_write(other)
        return freed

    monkeypatch.setattr(storage.l1_eviction, "evict_now", evict_then_another_writes)
    with pytest.raises(L1OutOfMemoryError):
        store(storage, keys_of(2, 1), 2 * MiB)
    monkeypatch.undo()
    assert storage.status()["eviction"]["l1"]["evicted_keys"] <= 64
    assert storage.failures()["l1_write_oom"] == 1


def test_writes_refused_before_evicting_log_one_line_per_burst(engine, caplog) -> None:
    # An L1 mostly locked refuses every write: each is counted, and the log says so once
    # (with how many more) instead of once per write.
    storage = engine([], eviction_trigger_watermark=1.0)
    _, barriers = locked_apart(storage)
    for prompt in range(2, 6):
        with pytest.raises(L1OutOfMemoryError):
            store(storage, keys_of(prompt, 1), 24 * MiB)
    assert storage.failures()["l1_write_oom"] == 4
    refusals = [record for record in caplog.records if "refused without evicting" in record.getMessage()]
    assert len(refusals) == 1, [record.getMessage() for record in refusals]
    storage.release(barriers)


def test_a_write_over_keys_being_loaded_that_cannot_fit_is_refused_before_evicting(engine) -> None:
    # A client's write takes over the keys a prefetch is loading from L2 in extents of its
    # own: the load's extent stays allocated (held) until the prefetch lets go.  Those keys
    # are in L1 already, but the write needs their room all the same: 40 MiB, where
    # evicting the 20 unlocked objects could free 24.  Counted as present, they made the
    # write look empty: it evicted every unlocked object, then was refused anyway.
    storage = engine([], eviction_trigger_watermark=1.0)  # 60 of 64 MiB: no background eviction
    resident = keys_of(1, 20)
    assert len(store(storage, resident, MiB)) == 20
    loading = keys_of(2, 1)
    loads = storage.l1.reserve_load(loading, [40 * MiB], temporary=False)
    with pytest.raises(L1OutOfMemoryError, match="needs 41943040 bytes of L1, but at most 25165824"):
        store(storage, loading, 40 * MiB)
    assert storage.status()["eviction"]["l1"]["evicted_keys"] == 0
    assert storage.failures()["l1_write_cannot_fit"] == 1
    assert all(storage.l1.contains(key) for key in resident)
    storage.l1.abort_load(loads.values())
    assert store(storage, loading, 40 * MiB) == loading  # fits once the load let go


def test_a_write_larger_than_all_of_l1_is_refused_as_such(engine) -> None:
    # Not "the rest is locked or being written": nothing is, L1 is too small for it.
    storage = engine([])
    with pytest.raises(L1OutOfMemoryError, match=r"needs 83886080 bytes of L1, but L1 holds only 67108864: "):
        store(storage, keys_of(3, 1), 80 * MiB)
    assert storage.failures()["l1_write_cannot_fit"] == 1


def test_a_write_of_keys_mostly_present_evicts_the_room_of_its_new_ones(engine) -> None:
    # A batch whose first 20 keys are in L1 already (a prompt whose prefix was stored,
    # the most recently used of it) reserves only its 2 new ones: 2 MiB where 1 is free.
    # Evicting the whole batch's size threw 22 objects out of L1 for the room of 2.
    storage = engine([], eviction_trigger_watermark=1.0)  # 63 of 64 MiB: no background eviction
    resident = keys_of(1, 63)
    assert len(store(storage, resident, MiB)) == 63
    batch = resident[:20] + keys_of(2, 2)
    assert store(storage, batch, MiB) == batch[-2:]
    assert storage.status()["eviction"]["l1"]["evicted_keys"] <= 2
