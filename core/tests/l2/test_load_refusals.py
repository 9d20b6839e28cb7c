"""Every key a load refuses before the backend sees it is counted and explained in a log
line: a buffer of the wrong size, a key a delete is working on, an object whose encoded
size core does not know, a record of another serde chain."""

from __future__ import annotations

import logging
import uuid

import pytest
from l2_backends import DictBackend, Xor, open_dict

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

SIZE = 1000


def load_one(adapter: BackendAdapter, size: int = SIZE) -> list[bool]:
    client = BlockingAdapterClient(adapter, timeout=30)
    return client.load(make_keys(1), [memoryview(bytearray(size))])


def stored_adapter(adapters: list[BackendAdapter], **options: object) -> BackendAdapter:
    adapter = open_dict(**options)  # type: ignore[arg-type]
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    assert client.store(make_keys(1), [memoryview(bytes(SIZE))]) == [True]
    return adapter


def refused(adapter: BackendAdapter, counter: str, caplog: pytest.LogCaptureFixture) -> None:
    assert adapter.stats().get(counter) == 1, counter
    assert adapter.stats()["load_keys_failed"] == 1
    assert adapter.pinned_keys() == {}, "the load's own pin is dropped"
    key = make_keys(1)[0].file_stem()
    assert any(key in record.getMessage() for record in caplog.records), "explained in a log line"


def test_a_buffer_of_the_wrong_size_is_counted_and_logged(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = stored_adapter(adapters)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        assert load_one(adapter, SIZE - 1) == [False]
    refused(adapter, "load_size_mismatch", caplog)


def test_a_key_a_delete_is_working_on_is_counted_and_logged(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    adapter = stored_adapter(adapters)
    pins = adapter.state.pins
    assert pins.begin_delete(make_keys(1)) == [True]  # a delete of it in flight
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
            assert load_one(adapter) == [False]
    finally:
        pins.end_delete(make_keys(1))
    refused(adapter, "load_skipped_deleting", caplog)
    assert load_one(adapter) == [True], "once the delete is over, the key loads"


def test_an_encoded_object_of_unknown_size_is_counted_and_logged(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    namespace = uuid.uuid4().hex
    # Stored by another server sharing the store after the start-up scan: this adapter
    # never accounted it, and a load without a lookup cannot know how many encoded bytes
    # to stage.
    adapter = open_dict(DictBackend, namespace=namespace, serde=[Xor()])
    adapters.append(adapter)
    stored_adapter(adapters, namespace=namespace, serde=[Xor()])  # after the scan
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        assert load_one(adapter) == [False]
    refused(adapter, "load_size_unknown", caplog)


def test_a_record_of_another_serde_chain_is_counted_and_logged(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    namespace = uuid.uuid4().hex
    stored_adapter(adapters, namespace=namespace, serde=[Xor()], records=True)
    adapter = open_dict(DictBackend, namespace=namespace, records=True)
    adapters.append(adapter)
    client = BlockingAdapterClient(adapter, timeout=30)
    assert client.lookup_and_lock(make_keys(1)).found == [False], "its record was read: a miss"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        assert load_one(adapter) == [False]
    refused(adapter, "load_skipped_unreadable", caplog)
