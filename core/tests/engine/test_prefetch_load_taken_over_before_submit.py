"""A client's write of a key that a prefetch reserved to load, landing between the plan
and the submit of the load, takes that key alone out of the load: the other keys of the
load are still loaded from the adapter, and the adapter is not blamed for a submit that
never reached it (``l2_load_submit_error``)."""

from __future__ import annotations

from collections.abc import Sequence

from engine_support import keys_of, mock, payload, store, store_in_l2_only

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Object
from lmcache_tiers.storage import StorageManager

SIZE = 32 * 1024


class WriteOnRead:
    """An L1 listener that, when ``trigger`` is read-locked, reserves ``taken`` for a write
    once: a client's write of that key landing at that very moment."""

    def __init__(self, storage: StorageManager, trigger: ObjectKey, taken: ObjectKey) -> None:
        self._storage = storage
        self._trigger = trigger
        self._taken = taken
        self.reserved: dict[ObjectKey, L1Object] = {}

    def on_l1_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        pass

    def on_l1_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        if self._trigger in keys and not self.reserved:
            self.reserved = self._storage.l1.reserve_write([self._taken], [SIZE])

    def on_l1_keys_deleted(self, keys: Sequence[ObjectKey]) -> None:
        pass


def test_a_write_taking_one_planned_load_leaves_the_others_of_its_adapter_loaded(engine) -> None:
    storage = engine([mock(namespace="taken-before-submit")])
    first, taken, in_l1 = keys_of(1, 3)
    store_in_l2_only(storage, [first, taken, in_l1], SIZE)
    store(storage, [in_l1], SIZE)  # READY in L1 again: the plan read-locks it after reserving the others
    writer = WriteOnRead(storage, trigger=in_l1, taken=taken)
    storage.l1.add_listener(writer)

    hits = storage.wait_prefetch(storage.submit_prefetch([first, taken, in_l1]), 10)

    assert writer.reserved, "the write did not land between the plan and the load"
    assert hits == 1, "the key before the one the write took was not loaded"
    assert bytes(storage.view(storage.read([first])[0])) == payload(first, SIZE)
    storage.release([first], 2)
    failures = storage.status()["failures"]
    assert "l2_load_submit_error" not in failures, "the adapter was blamed for a load it never saw"
    assert failures["l1_load_taken_over_by_write"] == 1
    storage.l1.remove_listener(writer)
    storage.abort_reserved(writer.reserved)
    assert storage.flush(10)
    assert storage.adapters[0].pinned_keys() == {}
    assert storage.l1.stats().write_locked == 0
