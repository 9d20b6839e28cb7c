"""A damaged object counts as removed (``corrupt_records_removed``, logged "removed") only
once its removal took: one the store kept -- replaced by another writer before the
removal, or a removal that failed -- is counted by what happened to it instead, as the
file stores and redis count theirs."""

from __future__ import annotations

import logging

import pytest
from lmcache_plugin_s3.backend import S3Backend
from lmcache_plugin_s3.client import S3RequestError
from s3_helpers import Raw, blocking, fresh_prefix

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10


@pytest.fixture
def prefix() -> str:
    return fresh_prefix("removal-counts")


def s3_backend(adapter: L2Adapter) -> S3Backend:
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    return backend


def stored_then_damaged(adapter: L2Adapter, raw: Raw, l1: memoryview, key: ObjectKey) -> bytes:
    """``key`` stored, then its object's last byte flipped in the bucket; the intact record."""
    buffer = l1[:SIZE]
    buffer[:] = pattern(3, SIZE)
    assert blocking(adapter).store([key], [buffer]) == [True]
    good = raw.read(key)
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    raw.write(key, bytes(damaged))
    return good


def load_once(adapter: L2Adapter, l1: memoryview, key: ObjectKey) -> bool:
    result = blocking(adapter).lookup_and_lock([key])
    assert result.found == [True]
    try:
        (loaded,) = blocking(adapter).load([key], [l1[SIZE : 2 * SIZE]])
    finally:
        adapter.unlock([key])
    return loaded


def test_a_damaged_object_whose_removal_fails_is_not_counted_removed(
    adapter: L2Adapter,
    raw: Raw,
    l1: memoryview,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (key,) = make_keys(1)
    stored_then_damaged(adapter, raw, l1, key)
    client = s3_backend(adapter).client
    call = client.call

    async def removals_fail(method: str, **kwargs: object) -> object:
        if method == "delete_object":
            raise S3RequestError("no complete answer within request_timeout_s=30")
        return await call(method, **kwargs)

    monkeypatch.setattr(client, "call", removals_fail)
    with caplog.at_level(logging.WARNING):
        assert load_once(adapter, l1, key) is False
    assert raw.exists(key), "the removal failed: the damaged object is still in the bucket"
    stats = adapter.stats()
    assert stats.get("corrupt_remove_failures", 0) == 1
    assert stats.get("corrupt_records_removed", 0) == 0, "counted removed, yet still in the bucket"
    assert not any("a miss, removed" in record.getMessage() for record in caplog.records)


def test_a_damaged_object_replaced_before_its_removal_is_not_counted_removed(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    (key,) = make_keys(1)
    good = stored_then_damaged(adapter, raw, l1, key)
    client = s3_backend(adapter).client
    call = client.call

    async def another_server_stores_first(method: str, **kwargs: object) -> object:
        if method == "delete_object":
            raw.write(key, good)
        return await call(method, **kwargs)

    monkeypatch.setattr(client, "call", another_server_stores_first)
    assert load_once(adapter, l1, key) is False
    assert raw.read(key) == good, "the record stored since was removed"
    stats = adapter.stats()
    assert stats.get("corrupt_replaced_before_removal", 0) == 1
    assert stats.get("corrupt_records_removed", 0) == 0, "counted removed, yet the store kept the object"


def test_a_damaged_object_removed_is_counted_once(adapter: L2Adapter, raw: Raw, l1: memoryview) -> None:
    (key,) = make_keys(1)
    stored_then_damaged(adapter, raw, l1, key)
    assert load_once(adapter, l1, key) is False
    assert not raw.exists(key)
    stats = adapter.stats()
    assert stats.get("corrupt_records_removed", 0) == 1
    assert stats.get("corrupt_remove_failures", 0) == 0
