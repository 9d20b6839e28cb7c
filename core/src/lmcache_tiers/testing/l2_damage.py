"""The damage test of the L2 conformance suite: an object changed where the backend keeps
it is never handed out.

A store that passes every round trip can still return a record a disk or a network
changed, unless its loads verify what they read (``read_record_header`` and
``verify_payload``, or a check of the store's own).  Only the plugin's test knows where
its objects live, so it damages one (``damage_stored``) and declares ``DETECTS_DAMAGE``.
"""

from __future__ import annotations

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.base import requires
from lmcache_tiers.testing.l2_support import DETECTS_DAMAGE, BufferPool, L2SuiteBase, make_keys


class DamageTests(L2SuiteBase):
    """Run for adapters whose suite can change a stored object's bytes (``damage_stored``)."""

    @requires(DETECTS_DAMAGE)
    def test_a_damaged_object_is_never_loaded(self, adapter: L2Adapter, pool: BufferPool) -> None:
        keys = make_keys(2, start=1300)
        ok, data = self.store(adapter, pool, keys)
        assert ok == [True, True], f"stores of 2 keys answered {ok}"
        self.damage_stored(adapter, keys[0])
        loaded, contents = self.lookup_and_load(adapter, pool, keys)
        assert not loaded[0], "a load of an object damaged in the store succeeded" + (
            " with the damaged bytes: verify what a load reads"
            " (read_record_header, then verify_payload) and fail it when it does not verify"
            if contents[0] != data[0]
            else ": damage_stored() changed nothing the load reads"
        )
        assert loaded[1] and contents[1] == data[1], "the object next to the damaged one must still load"
        found = self.client(adapter).lookup_and_lock(keys[:1]).found
        adapter.unlock(keys[:1])
        assert found == [False], (
            "a lookup after the failed load still found the damaged object: remove a damaged record"
            " (context.kept_record answers False for damage) so it is not offered again"
        )
        self.assert_no_pins(adapter)
