"""nixl_store: a load whose buffer is not the size of the key's object is a counted miss."""

from __future__ import annotations

import pytest
from nixl_helpers import Arena, client, open_pool, pool_config, scratch_dir

from lmcache_tiers.testing.l2 import make_keys, pattern


def test_an_object_replaced_by_another_size_since_the_lookup_is_a_counted_miss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The lookup said 64 KiB, then the key's object was replaced by one of 128 KiB (a
    store racing the load): the load of a 64 KiB buffer reads nothing, is counted and
    logged as the slot stores do, and the object stays."""
    arena = Arena()
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=4), arena.view)
        try:
            backend = adapter.backend
            (key,) = make_keys(1)
            assert client(adapter).store([key], [arena.filled(pattern(1, 64 << 10))]) == [True]
            assert client(adapter).lookup_and_lock([key]).found == [True]
            newer = pattern(2, 128 << 10)
            assert backend.put_many([key], [arena.filled(newer)]) == [True]
            buffer = arena.take(64 << 10)
            assert backend.get_many_into([key], [buffer]) == [False]
            adapter.unlock([key])
            assert bytes(buffer) == bytes(64 << 10), "nothing is read into a buffer of another size"
            assert adapter.stats().get("load_size_changed", 0) == 1
            assert any(
                "not loaded: it is 131072 bytes in its slot, the load buffer 65536" in r.message
                for r in caplog.records
            )
            assert backend.contains_many([key]) == [128 << 10], "the object is kept"
        finally:
            adapter.close()
