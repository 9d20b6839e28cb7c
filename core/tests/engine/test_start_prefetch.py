"""StorageManager.start_prefetch: a lookup with nothing left for L2 is answered at once."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_support import keys_of, mock, store

from lmcache_tiers.storage import StorageManager

Engine = Callable[..., StorageManager]
SIZE = 64 * 1024


def assert_no_read_locks(storage: StorageManager) -> None:
    stats = storage.l1.stats()
    assert (stats.write_locked, stats.read_locks) == (0, 0)


def test_an_all_l1_lookup_is_answered_with_the_locked_prefix(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(30, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)  # the L2 stores hold read locks until they are done
    # A repeated key ends the prefix, as with submit_prefetch.
    handle, locked = storage.start_prefetch(keys[:3] + keys[:1], readers=2)
    assert locked == keys[:3]
    assert storage.query_prefetch(handle) == 0  # nothing was kept to collect
    assert storage.l1.stats().read_locks == 6
    storage.release(locked, 2)
    with pytest.raises(ValueError):
        storage.start_prefetch(keys, readers=0)
    assert_no_read_locks(storage)


def test_without_adapters_the_l1_prefix_is_the_answer(engine: Engine) -> None:
    storage = engine([])
    keys = keys_of(32, 3)
    store(storage, keys[:2], SIZE)
    handle, locked = storage.start_prefetch(keys)
    assert locked == keys[:2]
    assert storage.query_prefetch(handle) == 0
    storage.release(locked)
    assert_no_read_locks(storage)


def test_l2_work_is_left_to_the_controller(engine: Engine) -> None:
    storage = engine([mock()])
    keys = keys_of(31, 3)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.l1.delete(keys[1:])
    handle, locked = storage.start_prefetch(keys)
    assert locked is None
    assert storage.wait_prefetch(handle, 10) == 3
    assert [obj.key for obj in storage.read(keys)] == keys
    storage.release(keys, 2)  # the read above and the prefetch's own lock
    assert_no_read_locks(storage)
