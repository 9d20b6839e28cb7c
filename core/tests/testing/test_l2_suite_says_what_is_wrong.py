"""The L2 conformance suite's failures name the defect: a load that filled less than its
buffer, a lookup claiming objects no load delivers, a deleted key still found, backend
calls that raised -- not a bare ``AssertionError`` or another defect's message."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Sequence

import pytest
from l2_backends import DictBackend, DictConfig

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter, ObjectSize, create_adapter
from lmcache_tiers.testing.l2 import (
    CAPACITY,
    EVICTION,
    IMMEDIATE_MISSES,
    PERSISTENCE,
    BufferPool,
    L2AdapterSuite,
)
from lmcache_tiers.testing.l2_support import changes, page_aligned_buffer


class _SuiteOn(L2AdapterSuite):
    """The suite on one backend class, built directly (not through the plugin registry)."""

    component_name = "test_dict"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    def __init__(self, backend: type[DictBackend]) -> None:
        self.backend = backend

    def make_config(self) -> DictConfig:
        return DictConfig(namespace=uuid.uuid4().hex, capacity=256 << 10)

    def open_adapter(self, config: L2AdapterConfig, l1_buffer: memoryview) -> L2Adapter:
        return create_adapter(self.backend, config, self.make_context(config, l1_buffer))


def failure_of(backend: type[DictBackend], name: str, capabilities: frozenset[str] = frozenset()) -> str:
    """The assertion message of suite test ``name`` run against ``backend``, declaring
    ``capabilities`` too."""
    suite = _SuiteOn(backend)
    suite.capabilities = _SuiteOn.capabilities | capabilities
    l1_buffer = page_aligned_buffer(suite.l1_buffer_size)
    opened = [suite.open_adapter(suite.make_config(), l1_buffer)]
    fixtures = {
        "adapter": opened[0],
        "pool": BufferPool(l1_buffer),
        "reopen_adapter": lambda previous: suite.reopen(previous, l1_buffer, opened),
    }
    test = getattr(suite, name)
    try:
        with pytest.raises(AssertionError) as failure:
            test(**{parameter: fixtures[parameter] for parameter in inspect.signature(test).parameters})
    finally:
        for adapter in opened:
            adapter.close()
    return str(failure.value)


class ShortLoads(DictBackend):
    """Loads report success having filled all but the last byte of each buffer."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            found = [self.objects.get(key) for key in keys]
        for data, buffer in zip(found, buffers, strict=True):
            if data is not None:
                buffer[:-1] = data[:-1]
        return [data is not None for data in found]


class LookupRemembersDeletedKeys(DictBackend):
    """Lookups answer from every key ever stored; deleted ones are claimed but cannot load."""

    def __init__(self, config: DictConfig, context: object) -> None:
        super().__init__(config, context)  # type: ignore[arg-type]
        self.ever: dict[ObjectKey, int] = {}

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self.ever.update((key, payload.nbytes) for key, payload in zip(keys, payloads, strict=True))
        return super().put_many(keys, payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        return [self.ever.get(key) for key in keys]


class RaisesOnAMiss(DictBackend):
    """A lookup raises KeyError for a key not stored instead of answering None."""

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        with self.lock:
            return [len(self.objects[key]) for key in keys]


class LoadsStaleBytes(DictBackend):
    """Loads report success and leave the buffer as it was."""

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        return [key in self.objects for key in keys]


class ForgetsOnClose(DictBackend):
    """Keeps objects in memory only, yet is declared PERSISTENCE."""

    def close(self) -> None:
        with self.lock:
            self.objects.clear()


class NoCapacity(DictBackend):
    """Declared CAPACITY, yet tells core of none."""

    def capacity(self) -> None:
        return None


def test_changes_tell_a_short_load_from_other_bytes_and_other_sizes() -> None:
    stored = [b"abcd", b"efgh", b"ijkl", b"mn"]
    loaded = [b"abcd", b"efg\0", b"\0jkl", b"mno"]
    assert changes(loaded, stored) == (
        "object 1: bytes 3..3 of 4 differ from what was stored (its end: a load that filled less than"
        " the buffer?); object 2: bytes 0..0 of 4 differ from what was stored; object 3: 3 bytes"
        " loaded, 2 stored"
    )
    assert changes([b"x"] * 5, [b"y"] * 5).endswith("; and 2 more objects")
    assert changes(stored, stored) == "no object differs"


def test_a_short_load_is_named_as_one() -> None:
    message = failure_of(ShortLoads, "test_store_lookup_load_round_trip")
    assert message.startswith("loads reported success with other bytes: object 0: bytes")
    assert "(its end: a load that filled less than the buffer?)" in message


def test_a_short_load_is_not_taken_for_keys_sharing_an_object() -> None:
    message = failure_of(ShortLoads, "test_keys_differing_in_one_field_are_distinct_objects")
    assert "share an object" not in message
    assert "a load that filled less than the buffer?" in message


def test_stale_bytes_are_not_taken_for_the_callers_reused_buffer() -> None:
    message = failure_of(LoadsStaleBytes, "test_store_copies_the_payload_before_completing")
    assert "what the caller wrote" not in message
    assert message.startswith("loads gave other bytes than were stored: object 0: bytes 0..")


def test_a_deleted_key_still_found_is_named() -> None:
    message = failure_of(LookupRemembersDeletedKeys, "test_keys_differing_in_one_field_are_distinct_objects")
    assert message.startswith("a lookup still found the key deleted")


def test_lookups_failing_because_the_backend_raised_say_so() -> None:
    message = failure_of(RaisesOnAMiss, "test_partial_hits")
    assert message.startswith("a lookup of 3 stored keys among 5 found [False, False, False, False, False]")
    assert "backend calls raised or answered malformed results: backend_errors, see the log" in message


def test_objects_lost_at_close_are_named_as_such() -> None:
    assert failure_of(ForgetsOnClose, "test_objects_survive_reopening").startswith(
        "after reopening, the listing names 0 keys of the 4 stored; 4 missing (a backend declaring"
        " PERSISTENCE keeps objects across close()"
    )
    assert failure_of(ForgetsOnClose, "test_deletes_survive_reopening").startswith(
        "after reopening, the listing names 0 keys of the 3 stored; 1 missing"
    )
    assert failure_of(ForgetsOnClose, "test_usage_is_known_right_after_reopening").startswith(
        "after reopening, the start-up scan accounted 0 bytes, not the"
    )


def test_nothing_accounted_after_reopening_is_not_taken_for_an_older_version() -> None:
    message = failure_of(ForgetsOnClose, "test_overwrites_survive_reopening")
    assert message.endswith(": nothing outlived close(), or list_keys() listed nothing")


def test_immediate_misses_declared_without_contains_many_now_say_what_is_missing() -> None:
    # DictBackend has no contains_many_now: every immediate lookup is "not now".
    for name in ("test_immediate_lookup_of_absent_keys", "test_immediate_misses_become_hits_once_stored"):
        message = failure_of(DictBackend, name, frozenset({IMMEDIATE_MISSES}))
        assert message.startswith("lookup_and_lock_now answered None (not now): a backend declaring")
        assert "IMMEDIATE_MISSES defines contains_many_now(keys)" in message


def test_capacity_declared_without_one_says_so() -> None:
    for name in ("test_store_beyond_capacity_fails", "test_usage_is_known_right_after_reopening"):
        assert failure_of(NoCapacity, name).startswith(
            "declared CAPACITY but the adapter has no capacity (usage() is -1): the backend's capacity()"
        )


def test_lookups_of_deleted_keys_that_hit_are_named() -> None:
    assert failure_of(LookupRemembersDeletedKeys, "test_delete_reports_per_key").startswith(
        "a lookup of keys deleted or never stored found [True, False, True]"
    )
    assert failure_of(LookupRemembersDeletedKeys, "test_large_batches_round_trip").startswith(
        "a lookup found 40 of 40 keys deleted"
    )


def test_a_short_load_of_a_pinned_key_is_named() -> None:
    message = failure_of(ShortLoads, "test_pins_between_lookup_and_load_block_delete")
    assert message.startswith("the load gave other bytes: object 0: bytes")


class ListsKeysWithoutSizes(DictBackend):
    """Lists bare keys, not (key, size) pairs: the start-up scan ignores every entry."""

    def list_keys(self) -> list[ObjectKey]:  # type: ignore[override]
        with self.lock:
            return list(self.objects)


class ListsSizesPlusOne(DictBackend):
    """Lists each object one byte larger than stored (a record's header counted, say)."""

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self.lock:
            return [(key, len(value) + 1) for key, value in self.objects.items()]


def test_a_listing_the_scan_ignores_is_named() -> None:
    assert "the start-up scan ignored 4 listed entries as invalid (scan_invalid_entries)" in failure_of(
        ListsKeysWithoutSizes, "test_objects_survive_reopening"
    )
    assert failure_of(ListsKeysWithoutSizes, "test_usage_is_known_right_after_reopening").endswith(
        "(the scan ignored 5 listed entries as not (key, size) pairs)"
    )
    assert failure_of(ListsKeysWithoutSizes, "test_overwrites_survive_reopening").endswith(
        ": the start-up scan ignored 2 listed entries as invalid"
        " (list_keys() yields (key, stored size) pairs)"
    )


def test_listed_sizes_other_than_stored_are_not_only_taken_for_an_older_version() -> None:
    assert "the listing's sizes are not the stored sizes (a record header counted?)" in failure_of(
        ListsSizesPlusOne, "test_overwrites_survive_reopening"
    )
