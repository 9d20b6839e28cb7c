"""The failure tests of the L2 conformance suite: a store that fails is not an empty one.

A lookup answer of None means "absent", and core then releases the key's accounting and
tells listeners it was deleted (``objects_vanished``): an adapter answering None while its
store is down would forget every acknowledged write it was asked about.  It must raise
instead; core counts the failure (``backend_errors``) and answers a miss, which is safe.
Both lookup paths are asked (``lookup_and_lock_now`` answers from the caller's thread),
and a load during the outage must fail or give the stored bytes, never others.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.base import requires
from lmcache_tiers.testing.l2_support import (
    BACKEND_FAILURES,
    BufferPool,
    L2SuiteBase,
    RecordingListener,
    make_keys,
)


def counted_failures(stats: Mapping[str, float]) -> float:
    """The failures an adapter counted: backend errors and calls its circuit refused."""
    return sum(value for name, value in stats.items() if "error" in name or name.startswith("circuit"))


class BackendFailureTests(L2SuiteBase):
    """Run for adapters whose suite can make their store fail (``failing_storage``)."""

    @requires(BACKEND_FAILURES)
    def test_a_failing_backend_is_not_taken_for_an_empty_one(
        self, adapter: L2Adapter, pool: BufferPool
    ) -> None:
        keys = make_keys(3, start=900)
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True] * 3
        used = adapter.used_bytes()
        failures_before = counted_failures(adapter.stats())
        listener = RecordingListener()
        adapter.add_listener(listener)
        with self.failing_storage(adapter):
            # The immediate path first: once failures open the circuit it is not asked.
            self._lookup_now_and_unlock(adapter, keys)
            found = self.client(adapter).lookup_and_lock(keys).found
            loaded, contents = self.load(adapter, pool, keys, [len(d) for d in data])
            adapter.unlock([key for key, hit in zip(keys, found, strict=True) if hit])
        stats = adapter.stats()
        assert stats.get("objects_vanished", 0) == 0 and listener.keys("deleted") == [], (
            "a lookup the store failed answered the stored keys absent: raise instead of returning None"
        )
        assert adapter.used_bytes() == used, "stored objects were released while the store was down"
        wrong = [
            key
            for key, hit, got, want in zip(keys, loaded, contents, data, strict=True)
            if hit and got != want
        ]
        assert not wrong, f"a load while the store was down returned other bytes ({wrong[0]} first)"
        assert found != [True] * 3 or loaded != [True] * 3, (
            "failing_storage() did not make the store fail: every lookup and load succeeded"
        )
        assert counted_failures(stats) > failures_before, (
            "the store failed and answered misses, but no failure was counted"
        )
        loaded, contents = self.lookup_and_load(adapter, pool, keys)
        assert loaded == [True] * 3 and contents == data, (
            "the objects were not served once the store was back"
        )
        self.assert_no_pins(adapter)

    def _lookup_now_and_unlock(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None:
        """``lookup_and_lock_now`` (None when the backend cannot answer from memory), its
        pins given back."""
        result = adapter.lookup_and_lock_now(keys)
        if result is not None:
            adapter.unlock([key for key, hit in zip(keys, result.found, strict=True) if hit])
