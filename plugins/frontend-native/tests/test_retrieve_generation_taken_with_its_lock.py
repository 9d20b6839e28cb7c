"""A RETRIEVE's slots carry the generation their extents had when L1 read-locked them.

The slots' generations used to be read from the table after the L1 lock was let go.  In
between, other threads of the server (the front end's pool, another front end's loop, the
prefetch controller) can take the object out by force and, with a release of its key
credited to its quarantined extent, give that extent back: its generation moves, a new
object is filled there, and a reader handed the moved generation would find it unchanged
after its copy and keep the other object's bytes.  With the generation taken under the
lock, the reader is told that its bytes changed (StaleReadError).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from native_keys import keys_of

from lmcache_tiers.client import Client, StaleReadError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Object
from lmcache_tiers.server.app import TiersServer

CHUNK = 256 << 10
MINE, INTRUDER = 0x5A, 0xEE


def hand_extent_over(server: TiersServer, locked: L1Object) -> L1Object:
    """What other threads may do while a RETRIEVE holds ``locked`` between its lock and
    its reply: clear it by force (its extent quarantined for the RETRIEVE's lock), store
    its key again and lock and release that new object (a release of the key is credited
    to the quarantined extent first, which then goes back), then store another key into
    the extent given back.  Returns that other key's object."""
    storage, l1 = server.storage, server.storage.l1
    key = locked.key
    assert storage.clear(force=True) >= 1
    again = l1.reserve_write([key], [CHUNK])[key]
    l1.write_object(again, memoryview(bytes([MINE]) * CHUNK))
    assert l1.finish_write([key]) == [True]
    assert l1.reserve_read_prefix([key]) == [again]
    l1.finish_read([key])  # credited to the extent the RETRIEVE still holds a lock on
    (other,) = keys_of(1)
    intruder = l1.reserve_write([other], [CHUNK])[other]
    l1.write_object(intruder, memoryview(bytes([INTRUDER]) * CHUNK))
    assert l1.finish_write([other]) == [True]
    return intruder


def pause_after_lock(server: TiersServer, between: Callable[[L1Object], None]) -> None:
    """Run ``between`` on another thread, and wait for it, right after the next read lock
    L1 hands out returns (the L1 lock let go, the RETRIEVE's reply not built yet)."""
    l1 = server.storage.l1
    lock_prefix = l1.reserve_read_prefix

    def paused(keys: list[ObjectKey], *args: Any, **kwargs: Any) -> list[L1Object]:
        objects = lock_prefix(keys, *args, **kwargs)
        del l1.reserve_read_prefix  # once
        other = threading.Thread(target=between, args=(objects[0],))
        other.start()
        other.join()
        return objects

    l1.reserve_read_prefix = paused  # type: ignore[method-assign,assignment]


def test_a_slot_handed_out_after_its_extent_changed_hands_is_stale(server: TiersServer) -> None:
    (key,) = keys_of(1)
    mine = bytes([MINE]) * CHUNK
    intruders: list[L1Object] = []
    with Client(server.endpoint) as reader:
        assert reader.store([key], [mine]) == 1
        offset = server.storage.l1.get(key).offset  # type: ignore[union-attr]
        pause_after_lock(server, lambda locked: intruders.append(hand_extent_over(server, locked)))
        with pytest.raises(StaleReadError) as stale, reader.retrieve([key]) as views:
            # the scene: the slot points at the extent another object now fills
            assert intruders and intruders[0].offset == offset
            assert bytes(views[0]) == bytes([INTRUDER]) * CHUNK
        assert stale.value.keys == [key]
