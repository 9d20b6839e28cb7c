"""An object larger than this server's L1 is a miss whichever way its size is learnt --
counted as ``record_l1_size_past_capacity`` and logged, the object kept for a server with
a larger L1 that shares the store -- also from a backend that reports only plain stored
sizes under a serde chain that changes none."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
from l2_backends import DictBackend, DictConfig

from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

L1_CAPACITY = 64 << 10
LARGE = b"x" * (2 * L1_CAPACITY)  # more than all of the smaller server's L1
SMALL = b"y" * (L1_CAPACITY // 4)


def open_plain(namespace: str, l1_capacity: int | None) -> BackendAdapter:
    """A dict adapter whose backend reports plain ``int`` sizes, no serde, this L1."""
    config = DictConfig(namespace=namespace)
    facts = AdapterContext(index=0, name="0:t", config=config, l1_capacity=l1_capacity)
    adapter = create_adapter(DictBackend, config, facts)
    assert isinstance(adapter, BackendAdapter)
    wait_scanned(adapter)
    return adapter


def open_sharing_pair(adapters: list[BackendAdapter]) -> tuple[BackendAdapter, BackendAdapter]:
    """Two plain adapters sharing one store: one with an L1 of ``L1_CAPACITY``, one with
    no L1 bound (a server with a larger L1); both closed at teardown."""
    namespace = uuid.uuid4().hex
    smaller = open_plain(namespace, L1_CAPACITY)
    larger = open_plain(namespace, None)
    adapters.extend([smaller, larger])
    return smaller, larger


def wait_scanned(adapter: BackendAdapter) -> None:
    deadline = time.monotonic() + 10
    while adapter.stats().get("scan_running", 0):
        assert time.monotonic() < deadline, "the start-up scan never finished"
        time.sleep(0.01)


def assert_kept_miss(smaller: BackendAdapter, larger: BackendAdapter, keys, caplog) -> None:  # type: ignore[no-untyped-def]
    with caplog.at_level(logging.WARNING):
        result = BlockingAdapterClient(smaller).lookup_and_lock(keys)
    assert result.found == [False], "an object larger than L1 is a miss"
    assert smaller.stats().get("record_l1_size_past_capacity", 0) == 1
    assert "more than L1's" in caplog.text
    assert smaller.pinned_keys() == {}
    larger_client = BlockingAdapterClient(larger)
    assert larger_client.lookup_and_lock(keys).found == [True], "kept for the larger server"
    larger.unlock(keys)


def test_a_plain_size_of_an_unaccounted_key_past_l1_is_a_kept_miss(adapters, caplog) -> None:  # type: ignore[no-untyped-def]
    smaller, larger = open_sharing_pair(adapters)
    keys = make_keys(1)
    assert BlockingAdapterClient(larger).store(keys, [memoryview(LARGE)]) == [True]

    assert_kept_miss(smaller, larger, keys, caplog)
    assert smaller.l1_size_of(keys[0]) is None, "a miss is not adopted into the accounting"
    assert smaller.stats().get("lookup_adopted", 0) == 0


def test_a_plain_size_of_an_overwritten_key_past_l1_is_a_kept_miss(adapters, caplog) -> None:  # type: ignore[no-untyped-def]
    smaller, larger = open_sharing_pair(adapters)
    keys = make_keys(1)
    assert BlockingAdapterClient(smaller).store(keys, [memoryview(SMALL)]) == [True]
    assert BlockingAdapterClient(larger).store(keys, [memoryview(LARGE)]) == [True]  # overwrites it

    assert_kept_miss(smaller, larger, keys, caplog)
    # Accounted here already (and known to the eviction policy): its usage follows the
    # object now in the store, or this adapter would overrun its capacity by the difference.
    assert smaller.used_bytes() == larger.used_bytes() == len(LARGE)
    assert smaller.l1_size_of(keys[0]) == len(LARGE)


@pytest.mark.parametrize("size", [len(SMALL), L1_CAPACITY])
def test_a_plain_size_that_fits_l1_is_a_hit(adapters, size: int) -> None:  # type: ignore[no-untyped-def]
    smaller, larger = open_sharing_pair(adapters)
    keys = make_keys(1)
    assert BlockingAdapterClient(larger).store(keys, [memoryview(b"z" * size)]) == [True]
    assert BlockingAdapterClient(smaller).lookup_and_lock(keys).sizes == [size]
    smaller.unlock(keys)
    assert smaller.stats().get("record_l1_size_past_capacity", 0) == 0
