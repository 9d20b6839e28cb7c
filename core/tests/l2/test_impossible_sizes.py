"""A size no object can have -- past ``MAX_OBJECT_BYTES`` -- listed by ``list_keys`` or
answered by ``contains_many``: refused as a bad answer (counted, logged), never accounted.
Accounted, it would make the usage absurd, every store would be refused for capacity and
eviction would delete valid objects to make room that can never be made.  A size past the
backend's capacity only is an object a run with a larger capacity stored: accounted and
counted (``scan_objects_past_capacity``, ``lookup_objects_past_capacity``)."""

from __future__ import annotations

import logging

import pytest
from l2_backends import (
    DictBackend,
    DictConfig,
    keys_of,
    namespace_holding,
    open_dict,
    store_blank,
    wait_until,
)

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, L2Adapter, ObjectSize, create_adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient

HUGE = 2**70
SIZE = 200


class ListingAbsurdSizes(DictBackend):
    """Lists what it holds, plus one key at ``listed_size`` that no object can have."""

    listed_size: object = HUGE

    def list_keys(self) -> list[tuple[ObjectKey, object]]:  # type: ignore[override]
        absurd = ObjectKey("absurd", 0, b"\0" * 8)
        return [*DictBackend.list_keys(self), (absurd, ListingAbsurdSizes.listed_size)]


@pytest.mark.parametrize(
    ("listed_size", "capacity"),
    [(HUGE, 100_000), (HUGE, None), (ObjectSize(HUGE, SIZE), None)],
    ids=["past-capacity", "past-any-bound", "object-size"],
)
def test_the_scan_refuses_a_listed_size_no_object_can_have(
    adapters: list[L2Adapter],
    listed_size: object,
    capacity: int | None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ListingAbsurdSizes.listed_size = listed_size
    namespace = namespace_holding(keys_of("listed", 2), SIZE)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        adapter = open_dict(ListingAbsurdSizes, capacity=capacity, namespace=namespace)
        adapters.append(adapter)
        wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    assert adapter.used_bytes() == 2 * SIZE
    stats = adapter.stats()
    assert stats["scan_keys"] == 2
    assert stats["scan_invalid_entries"] == 1
    # each kind of entry ignored by its own count: "or had an impossible size (0: ...)"
    # left a reader to guess which one the entries were
    assert any(
        "1 listed entries ignored: 0 not (key, size) pairs, 1 with an impossible size" in r.getMessage()
        for r in caplog.records
    ), caplog.text
    store_blank(adapter, keys_of("after", 1), SIZE)  # admitted: the usage is what is stored


def test_the_scan_accounts_a_listed_object_larger_than_the_capacity(
    adapters: list[L2Adapter], caplog: pytest.LogCaptureFixture
) -> None:
    """A size past the capacity but not past any object's: an earlier run with a larger
    capacity stored it.  It is on the backend, so it counts in the usage, is announced
    to the eviction policy and is counted; stores are refused until it is evicted."""
    ListingAbsurdSizes.listed_size = 100_001
    namespace = namespace_holding(keys_of("listed", 2), SIZE)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        adapter = open_dict(ListingAbsurdSizes, capacity=100_000, namespace=namespace)
        adapters.append(adapter)
        wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    assert adapter.used_bytes() == 2 * SIZE + 100_001
    stats = adapter.stats()
    assert stats["scan_keys"] == 3
    assert stats["scan_objects_past_capacity"] == 1
    assert stats.get("scan_invalid_entries", 0) == 0
    assert adapter.state.accounting.get(ObjectKey("absurd", 0, b"\0" * 8)) == ObjectSize(100_001, 100_001)
    assert any("larger than the capacity" in r.getMessage() for r in caplog.records)


class AnsweringAbsurdSizes(DictBackend):
    """Answers ``answered`` as the size of every key it holds, when set."""

    answered: object = None

    def contains_many(self, keys):  # type: ignore[no-untyped-def]
        found = super().contains_many(keys)
        if AnsweringAbsurdSizes.answered is None:
            return found
        return [None if size is None else AnsweringAbsurdSizes.answered for size in found]


def open_answering(
    adapters: list[L2Adapter],
    key: ObjectKey,
    capacity: int | None,
    *,
    accounted: bool,
    l1_capacity: int | None = None,
) -> BackendAdapter:
    """An ``AnsweringAbsurdSizes`` adapter whose store holds ``key`` (``SIZE`` bytes):
    accounted (stored through it), or not (stored by another server after its scan read
    the store: it learns of it by a lookup)."""
    config = DictConfig(capacity=capacity, namespace=namespace_holding([] if accounted else [key], SIZE))
    context = AdapterContext(index=0, name="0:t", config=config, l1_capacity=l1_capacity)
    adapter = create_adapter(AnsweringAbsurdSizes, config, context)
    assert isinstance(adapter, BackendAdapter)
    adapters.append(adapter)
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    if accounted:
        store_blank(adapter, [key], SIZE)
    else:
        adapter.state.accounting.forget(key)
    return adapter


def found_when_answered(
    adapter: BackendAdapter, key: ObjectKey, answered: object, caplog: pytest.LogCaptureFixture
) -> bool:
    """Whether a lookup of ``key`` finds it while the backend answers ``answered``."""
    AnsweringAbsurdSizes.answered = answered
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
            (found,) = BlockingAdapterClient(adapter).lookup_and_lock([key]).found
    finally:
        AnsweringAbsurdSizes.answered = None
    return found


@pytest.mark.parametrize(
    ("answered", "capacity"),
    [(HUGE, 100_000), (HUGE, None), (ObjectSize(2**63, SIZE), None)],
    ids=["past-capacity", "past-any-bound", "object-size"],
)
@pytest.mark.parametrize("accounted", [True, False], ids=["accounted", "adopted"])
def test_a_lookup_refuses_a_size_no_object_can_have(
    adapters: list[L2Adapter],
    answered: object,
    capacity: int | None,
    accounted: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    key = keys_of("k", 1)[0]
    adapter = open_answering(adapters, key, capacity, accounted=accounted)
    used = adapter.used_bytes()
    assert not found_when_answered(adapter, key, answered, caplog)
    assert adapter.used_bytes() == used
    assert adapter.stats()["lookup_size_impossible"] == 1
    assert any("impossible size" in r.getMessage() for r in caplog.records)
    assert adapter.pinned_keys() == {}
    store_blank(adapter, keys_of("after", 1), SIZE)  # admitted: the usage is what is stored


@pytest.mark.parametrize("accounted", [True, False], ids=["accounted", "adopted"])
def test_a_lookup_accounts_an_object_larger_than_the_capacity(
    adapters: list[L2Adapter], accounted: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the capacity but not past any object's: stored under a larger capacity (by an
    earlier run whose listing this one could not read, or a server sharing the store).
    It is in the store, so it is a hit the usage follows -- as the start-up scan
    accounts one -- counted, and announced so that eviction can remove it."""
    key = keys_of("k", 1)[0]
    adapter = open_answering(adapters, key, 100_000, accounted=accounted)
    assert found_when_answered(adapter, key, 100_001, caplog)
    adapter.unlock([key])
    assert adapter.used_bytes() == 100_001
    stats = adapter.stats()
    assert stats["lookup_objects_past_capacity"] == 1
    assert stats.get("lookup_size_impossible", 0) == 0
    assert any("larger than the capacity" in r.getMessage() for r in caplog.records)


def test_an_object_past_the_capacity_and_l1_is_not_counted_as_accounted(
    adapters: list[L2Adapter], caplog: pytest.LogCaptureFixture
) -> None:
    """Past the capacity and past L1 too: a miss that leaves the accounting as it was
    (``record_l1_size_past_capacity``).  ``lookup_objects_past_capacity`` counts objects
    accounted, so it is not counted -- on no lookup of it -- and no line says it was."""
    key = keys_of("k", 1)[0]
    adapter = open_answering(adapters, key, 100_000, accounted=False, l1_capacity=100_000)
    for _lookup in range(2):
        assert not found_when_answered(adapter, key, 100_001, caplog)
    assert adapter.used_bytes() == 0
    stats = adapter.stats()
    assert stats["record_l1_size_past_capacity"] == 2
    assert stats.get("lookup_objects_past_capacity", 0) == 0
    assert not any("accounted and left to eviction" in r.getMessage() for r in caplog.records)


class ListingAnObjectTwice(DictBackend):
    """Lists what it holds, plus one object past the capacity twice (as a listing that
    meets one key under two names does)."""

    def list_keys(self) -> list[tuple[ObjectKey, object]]:  # type: ignore[override]
        large = (ObjectKey("large", 0, b"\0" * 8), 100_001)
        return [*DictBackend.list_keys(self), large, large]


def test_the_scan_counts_an_object_past_the_capacity_once_it_is_accounted(
    adapters: list[L2Adapter],
) -> None:
    """``scan_objects_past_capacity`` counts objects accounted: an entry the scan leaves
    out (a key accounted already) is not one more."""
    namespace = namespace_holding(keys_of("listed", 1), SIZE)
    adapter = open_dict(ListingAnObjectTwice, capacity=100_000, namespace=namespace)
    adapters.append(adapter)
    wait_until(lambda: not adapter.stats()["scan_running"], "the end of the start-up scan")
    assert adapter.used_bytes() == SIZE + 100_001
    assert adapter.stats()["scan_objects_past_capacity"] == 1
