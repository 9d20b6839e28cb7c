"""The integrity tests of the L2 conformance suite: what a load returns is what was
stored under exactly that key, after the store completed -- not a view of the caller's
buffer, not another key's object, not an older version of the object."""

from __future__ import annotations

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.l2_support import (
    BufferPool,
    L2SuiteBase,
    changes,
    keys_differing_in_one_field,
    make_keys,
    pattern,
)


class IntegrityTests(L2SuiteBase):
    """Every adapter runs them: they need nothing beyond storing and loading."""

    def test_store_copies_the_payload_before_completing(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(2, start=700)
        data = [pattern(700 + index, size) for index, size in enumerate(self.sizes(2))]
        buffers = [pool.filled(d) for d in data]
        assert self.client(adapter).store(keys, buffers) == [True, True]
        # Once a store completed the caller reuses its memory (the L1 buffer's pages).
        for buffer in buffers:
            buffer[:] = bytes([0xA5]) * buffer.nbytes
        loaded, contents = self.lookup_and_load(adapter, pool, keys)
        assert loaded == [True, True], f"loads of 2 keys just stored answered {loaded}"
        reused = [bytes(buffer) for buffer in buffers]
        assert contents == data, (
            "a load returned what the caller wrote after the store completed"
            if any(got == caller for got, caller in zip(contents, reused, strict=True))
            else f"loads gave other bytes than were stored: {changes(contents, data)}"
        )
        self.assert_no_pins(adapter)

    def test_keys_differing_in_one_field_are_distinct_objects(
        self, adapter: L2Adapter, pool: BufferPool
    ) -> None:
        keys = keys_differing_in_one_field()
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * len(keys)
        assert set(adapter.iter_keys()) == set(keys)
        loaded, contents = self.lookup_and_load(adapter, pool, keys)
        assert loaded == [True] * len(keys), f"loads of keys just stored answered {loaded}"
        shared = [i for i, got in enumerate(contents) if got != data[i] and got in data]
        assert contents == data, (
            f"keys that differ in one field share an object: keys {shared} loaded another key's bytes"
            if shared
            else f"loads gave other bytes than were stored: {changes(contents, data)}"
        )
        assert adapter.delete(keys[:1]) == [True]
        found = self.client(adapter).lookup_and_lock(keys).found
        adapter.unlock(keys[1:])
        assert not found[0], "a lookup still found the key deleted (deleted objects must miss)"
        assert found[1:] == [True] * (len(keys) - 1), (
            f"after deleting one key a lookup found {found[1:]} of the others{self.raised(adapter)}"
            " (deleting one key must leave keys differing from it in one field)"
        )
        self.assert_no_pins(adapter)

    def test_a_load_after_an_overwrite_returns_the_new_bytes(
        self, adapter: L2Adapter, pool: BufferPool
    ) -> None:
        # The same size both times: only the bytes tell the versions apart, and the first
        # load gives a backend that keeps what it read something stale to serve.
        (key,) = make_keys(1, start=800)
        _, first = self.store(adapter, pool, [key], [self.object_size], seed=3)
        assert self.lookup_and_load(adapter, pool, [key]) == ([True], first)
        ok, second = self.store(adapter, pool, [key], [self.object_size], seed=4)
        assert ok == [True]
        assert self.lookup_and_load(adapter, pool, [key]) == ([True], second), "the old version was loaded"
        assert adapter.used_bytes() == self.stored_bytes([key], second)
        self.assert_no_pins(adapter)
