"""The failure tests of the L2 conformance suite: a store that fails is not an empty one.

A lookup answer of None means "absent", and core then releases the key's accounting and
tells listeners it was deleted (``objects_vanished``): an adapter answering None while its
store is down would forget every acknowledged write it was asked about.  It must raise
instead; core counts the failure (``backend_errors``) and answers a miss, which is safe.
"""

from __future__ import annotations

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.base import requires
from lmcache_tiers.testing.l2_support import (
    BACKEND_FAILURES,
    BufferPool,
    L2SuiteBase,
    RecordingListener,
    make_keys,
)


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
        listener = RecordingListener()
        adapter.add_listener(listener)
        with self.failing_storage(adapter):
            found = self.client(adapter).lookup_and_lock(keys).found
        adapter.unlock([key for key, hit in zip(keys, found, strict=True) if hit])
        stats = adapter.stats()
        assert stats.get("objects_vanished", 0) == 0 and listener.keys("deleted") == [], (
            "a lookup the store failed answered the stored keys absent: raise instead of returning None"
        )
        assert adapter.used_bytes() == used, "stored objects were released while the store was down"
        if found != [True] * 3:
            failures = sum(
                value for name, value in stats.items() if "error" in name or name.startswith("circuit")
            )
            assert failures > 0, "the store failed and answered misses, but no failure was counted"
        loaded, contents = self.lookup_and_load(adapter, pool, keys)
        assert loaded == [True] * 3 and contents == data, (
            "the objects were not served once the store was back"
        )
        self.assert_no_pins(adapter)
