"""The conformance tests of ``lookup_and_lock_now`` (the ImmediateLookups capability).

Every adapter runs them: one that cannot answer at once must say so (None) and hold
nothing; one that answers must answer what a submitted lookup answers, with its hits
pinned the same way.  A backend declaring ``IMMEDIATE_MISSES`` / ``IMMEDIATE_HITS`` must
also really answer those lookups at once (after its start-up scan).
"""

from __future__ import annotations

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.base import requires
from lmcache_tiers.testing.l2_support import (
    IMMEDIATE_HITS,
    IMMEDIATE_MISSES,
    BufferPool,
    L2SuiteBase,
    make_keys,
)

#: why a declared capability failed when nothing was answered at once
_NOT_ANSWERED = (
    "lookup_and_lock_now answered None (not now): a backend declaring {capability} defines"
    " contains_many_now(keys) answering these lookups from memory; drop the capability otherwise"
)


class ImmediateLookupTests(L2SuiteBase):
    """``lookup_and_lock_now`` agrees with ``submit_lookup_and_lock``, pins included."""

    def test_immediate_lookup_agrees_with_a_submitted_one(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(4, start=300)
        ok, data = self.store(adapter, pool, [keys[0], keys[2]])
        assert ok == [True, True]
        self.wait_scanned(adapter)
        now = adapter.lookup_and_lock_now(keys)
        if now is None:
            assert IMMEDIATE_HITS not in self.capabilities, _NOT_ANSWERED.format(capability="IMMEDIATE_HITS")
            self.assert_no_pins(adapter)  # "not now" holds nothing
            return
        submitted = self.client(adapter).lookup_and_lock(keys)
        assert (now.found, now.sizes) == (submitted.found, submitted.sizes)
        assert now.found == [True, False, True, False]
        assert now.sizes == [len(data[0]), 0, len(data[1]), 0]
        hits = [keys[0], keys[2]]
        adapter.unlock(hits)  # the submitted lookup's pins
        assert adapter.delete(hits) == [False, False], "an immediate hit must stay pinned"
        loaded, contents = self.load(adapter, pool, hits, [now.sizes[0], now.sizes[2]])
        assert loaded == [True, True] and contents == data
        adapter.unlock(hits)
        self.assert_no_pins(adapter)
        assert adapter.delete(hits) == [True, True]

    def test_immediate_lookup_of_absent_keys(self, adapter: L2Adapter) -> None:
        keys = make_keys(3, start=400)
        self.wait_scanned(adapter)
        now = adapter.lookup_and_lock_now(keys)
        if IMMEDIATE_MISSES in self.capabilities or IMMEDIATE_HITS in self.capabilities:
            declared = "IMMEDIATE_MISSES" if IMMEDIATE_MISSES in self.capabilities else "IMMEDIATE_HITS"
            assert now is not None, _NOT_ANSWERED.format(capability=declared)
        if now is not None:
            assert (now.found, now.sizes) == ([False] * 3, [0] * 3)
        self.assert_no_pins(adapter)
        assert adapter.lookup_and_lock_now([]) in (None, ([], []))

    @requires(IMMEDIATE_MISSES)
    def test_immediate_misses_become_hits_once_stored(self, adapter: L2Adapter, pool: BufferPool) -> None:
        (key,) = make_keys(1, start=500)
        self.wait_scanned(adapter)
        now = adapter.lookup_and_lock_now([key])
        assert now is not None, _NOT_ANSWERED.format(capability="IMMEDIATE_MISSES")
        assert now == ([False], [0]), f"an immediate lookup of a key never stored answered {now}"
        ok, data = self.store(adapter, pool, [key])
        assert ok == [True]
        now = adapter.lookup_and_lock_now([key])
        if now is None:  # hits may need the worker thread
            assert IMMEDIATE_HITS not in self.capabilities, _NOT_ANSWERED.format(capability="IMMEDIATE_HITS")
            now = self.client(adapter).lookup_and_lock([key])
        assert (now.found, now.sizes) == ([True], [len(data[0])])
        adapter.unlock([key])
        assert adapter.delete([key]) == [True]
        assert adapter.lookup_and_lock_now([key]) == ([False], [0])
        self.assert_no_pins(adapter)

    def test_no_immediate_answer_after_close(self, adapter: L2Adapter) -> None:
        adapter.close()
        assert adapter.lookup_and_lock_now(make_keys(2, start=600)) is None
