"""Objects removed behind the adapter's back (another server sharing the store, the store's
own eviction or expiry, an operator): found gone by a lookup or by the check after a delete
that did not remove them, they leave the accounting and the eviction policy."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from l2_backends import AsyncDictBackend, DictBackend, Fifo, Xor, open_dict

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, ObjectSize
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.l2_support import RecordingListener

SIZE = 1000
WATERMARK = 0.8

BACKENDS = pytest.mark.parametrize("backend", [DictBackend, AsyncDictBackend], ids=["plain", "coroutines"])


def opened(adapters: list[BackendAdapter], backend: type[DictBackend], objects: int) -> BackendAdapter:
    adapter = open_dict(backend, capacity=objects * SIZE)
    adapters.append(adapter)
    return adapter


def evicting(adapter: BackendAdapter) -> tuple[L2EvictionController, Fifo]:
    policy = Fifo()
    config = L2EvictionConfig(trigger_watermark=WATERMARK, eviction_ratio=0.2)
    controller = L2EvictionController(AdapterSlot(0, "dict", adapter), policy, config, EngineStats(1))
    controller.evict(0)  # seeds the policy (nothing stored yet): events from now on go in
    return controller, policy


def store(adapter: BackendAdapter, keys: list[ObjectKey]) -> None:
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(bytearray(SIZE)) for _ in keys]) == [
        True
    ] * len(keys)


def dict_of(adapter: BackendAdapter) -> DictBackend:
    backend = adapter.backend
    assert isinstance(backend, DictBackend)
    return backend


def remove_behind_its_back(adapter: BackendAdapter, keys: list[ObjectKey]) -> None:
    """What another server sharing the store does: the object goes, this adapter is not told."""
    backend = dict_of(adapter)
    with backend.lock:
        for key in keys:
            del backend.objects[key]


@BACKENDS
def test_an_eviction_victim_removed_behind_the_adapters_back_is_released(
    adapters: list[BackendAdapter], backend: type[DictBackend]
) -> None:
    adapter = opened(adapters, backend, 8)
    controller, policy = evicting(adapter)
    keys = make_keys(4)
    store(adapter, keys)
    remove_behind_its_back(adapter, keys[:2])

    freed = controller.evict(2 * SIZE)

    assert freed == 2 * SIZE
    assert adapter.used_bytes() == 2 * SIZE, "the bytes of the vanished objects are released"
    assert list(policy.victims()) == keys[2:], "they are no longer offered"
    assert set(dict_of(adapter).objects) == set(keys[2:]), "no live object was evicted in their place"
    stats = adapter.stats()
    assert stats["objects_vanished"] == 2
    assert stats["delete_keys_checked"] == 2
    assert stats.get("delete_keys_ok", 0) == 0
    assert controller.stats.adapter(0)["keys_evicted"] == 0, "found gone is not evicted"


@BACKENDS
def test_a_lookup_that_finds_an_accounted_key_gone_reports_it_deleted(
    adapters: list[BackendAdapter], backend: type[DictBackend]
) -> None:
    adapter = opened(adapters, backend, 8)
    _controller, policy = evicting(adapter)
    listener = RecordingListener()
    adapter.add_listener(listener)
    keys = make_keys(2)
    store(adapter, keys)
    remove_behind_its_back(adapter, keys[:1])

    assert BlockingAdapterClient(adapter).lookup_and_lock(keys).found == [False, True]
    adapter.unlock(keys[1:])

    assert adapter.used_bytes() == SIZE
    assert listener.keys("deleted") == keys[:1]
    assert list(policy.victims()) == keys[1:]
    assert adapter.stats()["objects_vanished"] == 1


def test_eviction_over_many_vanished_objects_gets_usage_under_the_watermark(
    adapters: list[BackendAdapter],
) -> None:
    adapter = opened(adapters, DictBackend, 64)
    controller, policy = evicting(adapter)
    keys = make_keys(60)
    store(adapter, keys)
    phantoms, live = keys[:55], keys[55:]
    remove_behind_its_back(adapter, phantoms)  # 55 of 64 objects: over the watermark alone
    assert adapter.usage() > WATERMARK
    checks = dict_of(adapter).calls.get("contains_many", 0)

    controller.step(set())

    assert adapter.usage() < WATERMARK
    assert set(dict_of(adapter).objects) == set(live), "the live objects are all kept"
    assert set(policy.victims()) == set(keys[12:]), "the 12 oldest were found gone and left"
    assert adapter.stats()["objects_vanished"] == 12
    # The batch grows once the bytes a released key frees are known, as with evictions.
    assert dict_of(adapter).calls["contains_many"] - checks <= 3


class StaleAnswers(DictBackend):
    """A dict whose ``contains_many`` answers as it was before a store it lets run first:
    the store of a key racing the check after its delete."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.adapter: BackendAdapter | None = None
        self.restore: list[ObjectKey] = []
        self.refuse: set[ObjectKey] = set()

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        answer = super().contains_many(keys)
        restore, self.restore = self.restore, []
        if restore:
            assert self.adapter is not None
            store(self.adapter, restore)
        return answer

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        kept = [key for key in keys if key in self.refuse]  # cannot be removed (e.g. denied)
        deleted = super().delete_many([key for key in keys if key not in self.refuse])
        outcome = iter(deleted)
        return [False if key in kept else next(outcome) for key in keys]


def test_a_key_stored_again_while_its_absence_is_checked_stays_accounted(
    adapters: list[BackendAdapter],
) -> None:
    adapter = opened(adapters, StaleAnswers, 8)
    backend = dict_of(adapter)
    assert isinstance(backend, StaleAnswers)
    backend.adapter = adapter
    _controller, policy = evicting(adapter)
    phantom, restored = make_keys(2)
    store(adapter, [phantom, restored])
    remove_behind_its_back(adapter, [phantom, restored])
    backend.restore = [restored]  # stored again between the delete and the answer

    assert adapter.delete([phantom, restored]) == [False, False]

    assert adapter.used_bytes() == SIZE
    assert adapter.l1_size_of(restored) == SIZE, "the new store's entry is kept"
    assert adapter.l1_size_of(phantom) is None
    assert list(policy.victims()) == [restored]
    assert adapter.stats()["objects_vanished"] == 1


def test_a_key_whose_delete_fails_but_that_exists_stays_accounted(adapters: list[BackendAdapter]) -> None:
    adapter = opened(adapters, StaleAnswers, 8)
    backend = dict_of(adapter)
    assert isinstance(backend, StaleAnswers)
    controller, policy = evicting(adapter)
    stuck, phantom, live = make_keys(3)
    store(adapter, [stuck, phantom, live])
    backend.refuse = {stuck}
    remove_behind_its_back(adapter, [phantom])

    assert controller.evict(2 * SIZE) == 2 * SIZE

    assert adapter.l1_size_of(stuck) == SIZE, "still there: still accounted"
    assert list(policy.victims()) == [stuck], "and offered again next cycle"
    assert set(backend.objects) == {stuck}
    stats = adapter.stats()
    assert stats["objects_vanished"] == 1 and stats["delete_keys_checked"] == 2
    assert stats["delete_keys_ok"] == 1


def test_a_record_of_another_serde_chain_is_not_taken_for_gone(adapters: list[BackendAdapter]) -> None:
    namespace = uuid.uuid4().hex
    first = open_dict(serde=[Xor()], namespace=namespace, records=True)
    keys = make_keys(2)
    BlockingAdapterClient(first).store(keys, [memoryview(b"abc")] * 2)
    first.close()
    second = open_dict(namespace=namespace, records=True)
    adapters.append(second)
    listener = RecordingListener()
    second.add_listener(listener)
    used = second.used_bytes()
    assert used > 0, "listed by the start-up scan"

    assert BlockingAdapterClient(second).lookup_and_lock(keys).found == [False, False]

    assert second.used_bytes() == used, "kept, so accounted (and evictable)"
    assert listener.keys("deleted") == []
    assert "objects_vanished" not in second.stats()


@BACKENDS
def test_objects_another_server_stored_are_evictable_once_a_lookup_finds_them(
    adapters: list[BackendAdapter], backend: type[DictBackend]
) -> None:
    # Two servers sharing one store: what the other one stores after this adapter's start
    # is accounted here when a lookup finds it, and must then be evictable here too, or
    # its bytes would count towards this adapter's usage for good.
    namespace = uuid.uuid4().hex
    here = open_dict(backend, capacity=4 * SIZE, namespace=namespace)
    there = open_dict(backend, capacity=4 * SIZE, namespace=namespace)
    adapters.extend([here, there])
    controller, policy = evicting(here)
    listener = RecordingListener()
    here.add_listener(listener)
    keys = make_keys(4)
    store(there, keys)

    assert BlockingAdapterClient(here).lookup_and_lock(keys).found == [True] * 4
    here.unlock(keys)
    assert here.used_bytes() == 4 * SIZE
    assert listener.keys("stored") == keys
    assert list(policy.victims()) == keys
    assert here.stats()["lookup_adopted"] == 4

    assert controller.evict(2 * SIZE) == 2 * SIZE
    assert here.used_bytes() == 2 * SIZE
    # found again: known now, not adopted twice
    assert BlockingAdapterClient(here).lookup_and_lock(keys[2:]).found == [True, True]
    here.unlock(keys[2:])
    assert here.stats()["lookup_adopted"] == 4


def _record_of_another_chain(
    adapters: list[BackendAdapter], backend: type[DictBackend] = DictBackend
) -> tuple[ObjectKey, BackendAdapter]:
    """A key stored by a server with a serde chain, and an adapter without it on the same
    store (which lists the record at start-up but cannot read it)."""
    namespace = uuid.uuid4().hex
    other = open_dict(serde=[Xor()], namespace=namespace, records=True)
    adapters.append(other)
    key = make_keys(1)[0]
    assert BlockingAdapterClient(other).store([key], [memoryview(b"abc")]) == [True]
    here = open_dict(backend, namespace=namespace, records=True)
    adapters.append(here)
    return key, here


def test_a_record_of_another_serde_chain_removed_behind_the_adapters_back_is_released(
    adapters: list[BackendAdapter],
) -> None:
    # Two servers sharing a store with different serde chains: this one cannot read the
    # other's record (a miss, kept), and the other one removes it.  The check after this
    # adapter's delete must find it gone, or its bytes stay accounted and it stays the
    # eviction victim for good.
    key, here = _record_of_another_chain(adapters)
    assert here.used_bytes() > 0, "listed by the start-up scan"
    assert BlockingAdapterClient(here).lookup_and_lock([key]).found == [False]
    assert here.stats()["serde_chain_mismatch"] == 1
    remove_behind_its_back(here, [key])

    assert here.delete([key]) == [False]

    assert here.used_bytes() == 0
    assert here.stats()["objects_vanished"] == 1


def test_a_record_of_another_serde_chain_that_is_still_there_stays_accounted(
    adapters: list[BackendAdapter],
) -> None:
    key, here = _record_of_another_chain(adapters, StaleAnswers)
    backend = dict_of(here)
    assert isinstance(backend, StaleAnswers)
    backend.refuse = {key}  # its delete fails: the record stays
    used = here.used_bytes()
    assert BlockingAdapterClient(here).lookup_and_lock([key]).found == [False]

    assert here.delete([key]) == [False]

    assert here.used_bytes() == used
    assert "objects_vanished" not in here.stats()
    assert BlockingAdapterClient(here).lookup_and_lock([key]).found == [False], "still a miss"


def wait_for_scan(adapter: BackendAdapter) -> None:
    deadline = time.monotonic() + 10
    while adapter.stats()["scan_running"]:
        assert time.monotonic() < deadline, "the start-up scan never ended"
        time.sleep(0.01)


def put_behind_its_back(adapter: BackendAdapter, keys: list[ObjectKey]) -> None:
    """What another server sharing the store does after this adapter's start-up scan."""
    backend = dict_of(adapter)
    with backend.lock:
        for key in keys:
            backend.objects[key] = bytes(SIZE)


@BACKENDS
def test_listed_objects_never_accounted_that_vanish_do_not_stall_eviction(
    adapters: list[BackendAdapter], backend: type[DictBackend]
) -> None:
    # Keys the eviction policy was seeded with from the listing, that this adapter never
    # accounted (stored by another server after its start-up scan), then removed by that
    # server: their deletes answer False, and unless they leave the policy, a run of
    # DELETE_BATCH of them at its head ends every cycle before anything is evicted.
    adapter = opened(adapters, backend, 100)
    wait_for_scan(adapter)
    theirs = make_keys(100)
    put_behind_its_back(adapter, theirs)
    controller, policy = evicting(adapter)
    assert list(policy.victims()) == theirs, "seeded from the listing"
    remove_behind_its_back(adapter, theirs)
    ours = make_keys(90, start=100)
    store(adapter, ours)
    assert adapter.usage() == pytest.approx(0.9)
    checks = dict_of(adapter).calls.get("contains_many", 0)

    controller.step(set())

    assert adapter.usage() < WATERMARK
    assert set(dict_of(adapter).objects) >= set(ours[-60:]), "live objects beyond the round are kept"
    # Batches of victims found absent grow, as batches of evicted ones do.
    assert dict_of(adapter).calls["contains_many"] - checks <= 8
    assert not set(policy.victims()) & set(theirs), "the vanished keys left the policy"
    assert "l2_eviction_delete_failed" not in controller.stats.failures()
    assert adapter.stats()["delete_keys_absent"] == 100
    assert "objects_vanished" not in adapter.stats(), "never accounted: nothing was released"


class AbsentListener(RecordingListener):
    def on_l2_keys_absent(self, adapter: BackendAdapter, keys: Sequence[ObjectKey]) -> None:
        self._add("absent", adapter, keys)


def test_a_delete_tells_listeners_of_unaccounted_keys_found_absent_apart_from_deletes(
    adapters: list[BackendAdapter],
) -> None:
    adapter = opened(adapters, StaleAnswers, 8)
    backend = dict_of(adapter)
    assert isinstance(backend, StaleAnswers)
    listener, plain = AbsentListener(), RecordingListener()  # one without the callback
    adapter.add_listener(listener)
    adapter.add_listener(plain)
    ours, absent, stuck = make_keys(3)
    store(adapter, [ours])
    put_behind_its_back(adapter, [stuck])
    backend.refuse = {stuck}  # there, and its delete fails
    checks = backend.calls.get("contains_many", 0)

    assert adapter.delete([ours]) == [True]
    assert backend.calls.get("contains_many", 0) == checks, "no check when every delete succeeds"

    assert adapter.delete([absent, stuck]) == [False, False]

    assert listener.keys("absent") == [absent], "a key still there is not absent"
    assert listener.keys("deleted") == plain.keys("deleted") == [ours], "never stored: not deleted"
    stats = adapter.stats()
    assert stats["delete_keys_absent"] == 1
    assert stats["delete_keys_checked"] == 2
    assert "objects_vanished" not in stats


class ScannedDuringCheck(DictBackend):
    """A dict whose ``contains_many`` lets the start-up scan account keys from a listing
    older than its answer."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.adapter: BackendAdapter | None = None
        self.listed: list[ObjectKey] = []

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        answer = super().contains_many(keys)
        listed, self.listed = self.listed, []
        if listed:
            assert self.adapter is not None
            self.adapter.state.accounting.add_scanned([(key, ObjectSize(SIZE, SIZE)) for key in listed])
        return answer


def test_an_unaccounted_key_the_scan_accounts_during_the_check_is_released(
    adapters: list[BackendAdapter],
) -> None:
    adapter = opened(adapters, ScannedDuringCheck, 8)
    backend = dict_of(adapter)
    assert isinstance(backend, ScannedDuringCheck)
    backend.adapter = adapter
    listener = AbsentListener()
    adapter.add_listener(listener)
    key = make_keys(1)[0]
    backend.listed = [key]

    assert adapter.delete([key]) == [False]

    assert adapter.used_bytes() == 0, "its bytes are not accounted for good"
    assert listener.keys("deleted") == [key] and listener.keys("absent") == []
    assert adapter.stats()["objects_vanished"] == 1
