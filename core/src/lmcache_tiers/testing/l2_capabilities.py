"""The capability tests of the L2 conformance suite: persistence, capacity, eviction."""

from __future__ import annotations

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.base import requires
from lmcache_tiers.testing.l2_support import (
    CAPACITY,
    EVICTION,
    PERSISTENCE,
    BufferPool,
    L2SuiteBase,
    Reopen,
    changes,
    invalid_entries,
    keys_differing_in_one_field,
    listing_differs,
    listing_note,
    make_keys,
    nonzero,
    pattern,
)


class L2CapabilityTests(L2SuiteBase):
    """Tests a backend runs only when it declares the capability they need."""

    def _stored_then_reopened(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen, salted: int
    ) -> tuple[L2Adapter, list[ObjectKey], list[bytes]]:
        """Store 3 plain and ``salted`` salted keys, then reopen the adapter."""
        keys = make_keys(3) + make_keys(salted, salt="tenant-a")
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * len(keys)
        return reopen_adapter(adapter), keys, data

    @requires(PERSISTENCE)
    def test_objects_survive_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        reopened, keys, data = self._stored_then_reopened(adapter, pool, reopen_adapter, 1)
        listed = list(reopened.iter_keys())
        assert set(listed) == set(keys), listing_differs(listed, keys, len(keys), invalid_entries(reopened))
        result = self.client(reopened).lookup_and_lock(keys)
        assert result.found == [True] * 4, (
            f"after reopening, a lookup of 4 stored keys found {result.found}{self.raised(reopened)}"
        )
        assert result.sizes == [len(d) for d in data]
        assert reopened.used_bytes() == self.stored_bytes(keys, data)
        by_salt = {
            "": self.stored_bytes(keys[:3], data[:3]),
            "tenant-a": self.stored_bytes(keys[3:], data[3:]),
        }
        assert nonzero(reopened.used_bytes_by_salt()) == by_salt
        loaded, contents = self.load(reopened, pool, keys, result.sizes)
        assert loaded == [True] * 4, (
            f"after reopening, loads of 4 keys found answered {loaded}{self.raised(reopened)}"
        )
        assert contents == data, f"after reopening, loads gave other bytes: {changes(contents, data)}"
        reopened.unlock(keys)

    @requires(PERSISTENCE)
    def test_usage_is_known_right_after_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        reopened, keys, data = self._stored_then_reopened(adapter, pool, reopen_adapter, 2)
        self.wait_scanned(reopened)
        # Before any lookup: the start-up scan accounted what the backend holds.
        assert reopened.used_bytes() == self.stored_bytes(keys, data), (
            f"after reopening, the start-up scan accounted {reopened.used_bytes()} bytes, not the"
            f" {self.stored_bytes(keys, data)} stored: list_keys() lists every stored object"
            f" with its stored size{listing_note(reopened)}"
        )
        assert nonzero(reopened.used_bytes_by_salt()) == {
            "": self.stored_bytes(keys[:3], data[:3]),
            "tenant-a": self.stored_bytes(keys[3:], data[3:]),
        }
        self._check_usage(reopened)
        assert reopened.delete(keys[:1]) == [True]
        assert reopened.used_bytes() == self.stored_bytes(keys[1:], data[1:])

    @requires(PERSISTENCE)
    def test_every_key_field_survives_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        # What a backend lists at start is decoded from its names of objects: each field
        # of a key must come back as it was stored.
        keys = keys_differing_in_one_field()
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * len(keys)
        reopened = reopen_adapter(adapter)
        self.wait_scanned(reopened)
        listed = list(reopened.iter_keys())
        assert set(listed) == set(keys), listing_differs(listed, keys, len(keys), invalid_entries(reopened))
        loaded, contents = self.lookup_and_load(reopened, pool, keys)
        assert loaded == [True] * len(keys), (
            f"after reopening, loads of keys found answered {loaded}{self.raised(reopened)}"
        )
        assert contents == data, f"after reopening, loads gave other bytes: {changes(contents, data)}"

    @requires(PERSISTENCE)
    def test_deletes_survive_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        keys = make_keys(3)
        _, data = self.store(adapter, pool, keys)
        assert adapter.delete(keys[:2]) == [True, True]
        reopened = reopen_adapter(adapter)
        self.wait_scanned(reopened)
        # Before any lookup: a listing that still names deleted objects accounts bytes
        # that are not there and offers them to the eviction policy.
        listed = list(reopened.iter_keys())
        assert set(listed) == {keys[2]}, (
            listing_differs(listed, keys[2:], len(keys), invalid_entries(reopened)) + " (2 were deleted)"
        )
        assert reopened.used_bytes() == self.stored_bytes(keys[2:], data[2:])
        loaded, contents = self.lookup_and_load(reopened, pool, keys)
        assert loaded == [False, False, True], (
            f"after reopening, loads of 2 keys deleted and 1 kept answered {loaded}{self.raised(reopened)}"
        )
        assert contents[2] == data[2], (
            f"after reopening, the load gave other bytes: {changes(contents[2:], data[2:])}"
        )

    @requires(PERSISTENCE)
    def test_overwrites_survive_reopening(
        self, adapter: L2Adapter, pool: BufferPool, reopen_adapter: Reopen
    ) -> None:
        # What a backend rebuilds at start (an index, a log, slots) must name the newest
        # version of an overwritten object: one of the same size and one of another size.
        keys = make_keys(2, start=900)
        self.store(adapter, pool, keys, [self.object_size, self.object_size], seed=5)
        ok, data = self.store(adapter, pool, keys, [self.object_size, self.object_size // 2], seed=6)
        assert ok == [True, True]
        reopened = reopen_adapter(adapter)
        self.wait_scanned(reopened)
        used, newest = reopened.used_bytes(), self.stored_bytes(keys, data)
        assert used == newest, (
            f"after reopening, {used} bytes were accounted, not the {newest} of the newest versions"
            + (
                f": the start-up scan ignored {invalid_entries(reopened)} listed entries as invalid"
                " (list_keys() yields (key, stored size) pairs)"
                if invalid_entries(reopened)
                else ": nothing outlived close(), or list_keys() listed nothing"
                if used == 0
                else ": the listing's sizes are not the stored sizes (a record header counted?)"
                " or an older version was accounted"
            )
        )
        loaded, contents = self.lookup_and_load(reopened, pool, keys)
        assert loaded == [True, True], (
            f"after reopening, loads of 2 keys answered {loaded}{self.raised(reopened)}"
        )
        assert contents == data, (
            f"after reopening, loads gave other bytes than the newest versions: {changes(contents, data)}"
        )

    @requires(CAPACITY)
    def test_store_beyond_capacity_fails(self, adapter: L2Adapter, pool: BufferPool) -> None:
        stored, refused = self._fill(adapter, pool)
        assert stored, "not even one object fitted"
        assert 0.0 < adapter.usage() <= 1.0
        expected = [pattern(index, self.object_size) for index in range(len(stored))]
        assert adapter.used_bytes() == self.stored_bytes(stored, expected)
        assert self.client(adapter).lookup_and_lock([refused]).found == [False]
        # A backend with less room than it declares would make room by dropping objects
        # core admitted; what was stored before the refusal must all still be there.
        loaded, contents = self.lookup_and_load(adapter, pool, stored)
        assert loaded == [True] * len(stored), "objects stored before the adapter filled up were lost"
        assert contents == expected, f"loads gave other bytes: {changes(contents, expected)}"

    @requires(CAPACITY, EVICTION)
    def test_deleting_frees_capacity(self, adapter: L2Adapter, pool: BufferPool) -> None:
        stored, refused = self._fill(adapter, pool)
        before = adapter.usage()
        assert adapter.delete(stored[:2]) == [True, True]
        assert adapter.usage() < before
        data = pattern(77, self.object_size)
        assert self.client(adapter).store([refused], [pool.filled(data)]) == [True]
        result = self.client(adapter).lookup_and_lock([refused])
        loaded, contents = self.load(adapter, pool, [refused], result.sizes)
        assert loaded == [True], f"the load of the key stored once room was made answered {loaded}"
        assert contents == [data], f"the load gave other bytes: {changes(contents, [data])}"
        adapter.unlock([refused])
