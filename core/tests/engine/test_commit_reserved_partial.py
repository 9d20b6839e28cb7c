"""A commit by reservation names the keys it committed: all of them when every
reservation is still its key's object (taken as they are), and only those otherwise."""

from __future__ import annotations

from collections.abc import Callable

from engine_support import keys_of, mock, payload

from lmcache_tiers.storage import StorageManager

SIZE = 4096


def test_a_commit_with_a_reservation_another_writer_holds_now_names_only_its_own_keys(
    engine: Callable[..., StorageManager],
) -> None:
    storage = engine([mock()])
    keys = keys_of(1, 4)
    reserved = storage.reserve_write(keys, [SIZE] * 4)
    for key, obj in reserved.items():
        storage.view(obj)[:] = payload(key, SIZE)
    taken = keys[1]
    storage.l1.abort_write([taken])  # as the write TTL's reaping: the key is free again
    other = storage.reserve_write([taken], [SIZE])
    assert storage.commit_reserved(reserved) == [keys[0], keys[2], keys[3]]
    assert storage.l1.get(taken) is other[taken], "another writer's reservation is left alone"
    storage.abort_reserved(other)
    assert storage.commit_reserved(reserved) == [], "a reservation is committed once"
    assert storage.flush(10)
    assert storage.status()["failures"] == {}
