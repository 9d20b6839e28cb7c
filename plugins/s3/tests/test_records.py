"""What the bucket may hold besides good records -- damage, other writers' objects,
replaced objects -- and that none of it reaches a caller's buffer as garbage."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from s3_helpers import Raw, blocking, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.seaweedfs import SeaweedS3

SIZE = 64 << 10
CANARY = 0xA5


@pytest.fixture
def prefix() -> str:
    return fresh_prefix("records")


@pytest.fixture
def l1() -> memoryview:
    return memoryview(bytearray(8 << 20))


@pytest.fixture
def adapter(seaweed: SeaweedS3, prefix: str, l1: memoryview) -> Iterator[L2Adapter]:
    adapter = open_adapter(s3_config(seaweed, prefix), l1)
    yield adapter
    adapter.close()


@pytest.fixture
def raw(seaweed: SeaweedS3, prefix: str) -> Raw:
    return Raw(seaweed, prefix)


def store(adapter: L2Adapter, l1: memoryview, keys: list[ObjectKey], size: int = SIZE) -> list[bytes]:
    data = [pattern(index + 7, size) for index in range(len(keys))]
    offset = 4 << 20
    buffers = []
    for payload in data:
        buffers.append(l1[offset : offset + size])
        buffers[-1][:] = payload
        offset += size
    assert blocking(adapter).store(keys, buffers) == [True] * len(keys)
    return data


def fenced(l1: memoryview, size: int) -> tuple[memoryview, memoryview]:
    """A load buffer of ``size`` bytes with canary bytes on both sides: (buffer, region)."""
    region = l1[: size + 2 * 4096]
    region[:] = bytes([CANARY]) * region.nbytes
    return region[4096 : 4096 + size], region


def canaries_intact(region: memoryview, size: int) -> bool:
    outside = bytes(region[:4096]) + bytes(region[4096 + size :])
    return outside == bytes([CANARY]) * len(outside)


def test_a_garbage_object_is_a_miss_and_is_removed(adapter: L2Adapter, raw: Raw) -> None:
    (key,) = make_keys(1)
    raw.write(key, b"not a record" * 1000)
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert not raw.exists(key)
    assert adapter.stats()["corrupt_records_removed"] == 1


@pytest.mark.parametrize("damage", ["truncated", "extended", "empty"])
def test_an_object_of_the_wrong_length_is_removed(
    adapter: L2Adapter, raw: Raw, l1: memoryview, damage: str
) -> None:
    (key,) = make_keys(1)
    store(adapter, l1, [key])
    record = raw.read(key)
    raw.write(key, {"truncated": record[:-100], "extended": record + b"x" * 100, "empty": b""}[damage])
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert not raw.exists(key)
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert adapter.used_bytes() == 0, "the miss released the bytes"


def test_a_damaged_payload_fails_the_load_only_inside_the_buffer(
    adapter: L2Adapter, raw: Raw, l1: memoryview
) -> None:
    (key,) = make_keys(1)
    store(adapter, l1, [key])
    record = bytearray(raw.read(key))
    record[-1] ^= 0xFF
    raw.write(key, bytes(record))
    result = blocking(adapter).lookup_and_lock([key])
    assert result.found == [True]  # the header is intact; the payload is checked on load
    buffer, region = fenced(l1, result.sizes[0])
    assert blocking(adapter).load([key], [buffer]) == [False]
    assert canaries_intact(region, buffer.nbytes)
    adapter.unlock([key])
    assert not raw.exists(key)
    assert adapter.stats()["corrupt_records_removed"] == 1


def test_a_record_replaced_by_a_longer_one_is_never_copied_past_the_buffer(
    seaweed: SeaweedS3, prefix: str, adapter: L2Adapter, raw: Raw, l1: memoryview
) -> None:
    (key,) = make_keys(1)
    store(adapter, l1, [key])
    result = blocking(adapter).lookup_and_lock([key])
    assert result.sizes == [SIZE]
    # Another writer replaces the object with a record twice as long.
    other = open_adapter(s3_config(seaweed, prefix), l1, index=1)
    try:
        store(other, l1, [key], size=2 * SIZE)
    finally:
        other.close()
    buffer, region = fenced(l1, SIZE)
    assert blocking(adapter).load([key], [buffer]) == [False]
    assert canaries_intact(region, SIZE) and bytes(buffer) == bytes([CANARY]) * SIZE, "nothing was copied"
    adapter.unlock([key])
    assert raw.exists(key), "a replaced record is not damaged: kept"
    stats = adapter.stats()
    assert stats["load_size_changed"] == 1 and stats.get("corrupt_records_removed", 0) == 0


def test_a_header_that_lies_about_the_length_is_caught_before_copying(
    adapter: L2Adapter, raw: Raw, l1: memoryview
) -> None:
    (key,) = make_keys(1)
    payload = pattern(3, SIZE)
    header = encode_header(key, payload, align=4096)
    # A header for SIZE bytes followed by far more: a load must not trust the header alone.
    raw.write(key, header + payload + pattern(4, SIZE))
    buffer, region = fenced(l1, SIZE)
    assert blocking(adapter).load([key], [buffer]) == [False]
    assert canaries_intact(region, SIZE)
    assert not raw.exists(key)


def test_another_keys_record_under_this_name_is_removed(adapter: L2Adapter, raw: Raw, l1: memoryview) -> None:
    mine, theirs = make_keys(2)
    store(adapter, l1, [theirs])
    raw.write(mine, raw.read(theirs))
    assert blocking(adapter).lookup_and_lock([mine, theirs]).found == [False, True]
    adapter.unlock([theirs])
    assert not raw.exists(mine) and raw.exists(theirs)


def test_a_record_of_another_serde_chain_is_a_miss_that_is_kept(adapter: L2Adapter, raw: Raw) -> None:
    (key,) = make_keys(1)
    payload = pattern(5, SIZE)
    raw.write(key, encode_header(key, payload, serde=("zstd",), align=4096) + payload)
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert raw.exists(key), "readable again once its chain is configured: never deleted"
    stats = adapter.stats()
    assert stats["serde_chain_mismatch"] == 1 and stats.get("corrupt_records_removed", 0) == 0


def test_a_record_of_an_unknown_format_version_is_a_miss_that_is_kept(adapter: L2Adapter, raw: Raw) -> None:
    (key,) = make_keys(1)
    payload = pattern(6, SIZE)
    header = bytearray(encode_header(key, payload, align=4096))
    header[4:6] = (99).to_bytes(2, "little")  # a format a newer server might write
    raw.write(key, bytes(header) + payload)
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert raw.exists(key), "a newer server sharing the bucket may read it"
    assert adapter.stats()["record_version_unknown"] == 1


@pytest.mark.parametrize("cut", [0, 4, 60], ids=["empty", "tiny", "header-prefix"])
def test_an_object_too_short_for_a_record_fails_a_load_and_is_removed(
    adapter: L2Adapter, raw: Raw, l1: memoryview, cut: int
) -> None:
    (key,) = make_keys(1)
    raw.write(key, encode_header(key, pattern(8, SIZE), align=4096)[:cut])
    buffer, region = fenced(l1, SIZE)
    assert blocking(adapter).load([key], [buffer]) == [False]  # a load with no lookup first
    assert canaries_intact(region, SIZE)
    assert not raw.exists(key)
    assert adapter.stats()["corrupt_records_removed"] == 1


def test_a_damaged_record_replaced_before_its_removal_is_kept(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_plugin_s3.backend import S3Backend

    (key,) = make_keys(1)
    data = store(adapter, l1, [key])
    good = raw.read(key)
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    raw.write(key, bytes(damaged))
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    call = backend.client.call

    async def another_server_stores_first(method: str, **kwargs: object) -> object:
        if method == "delete_object":
            raw.write(key, good)  # the good record again, between the read and the removal
        return await call(method, **kwargs)

    monkeypatch.setattr(backend.client, "call", another_server_stores_first)
    result = blocking(adapter).lookup_and_lock([key])
    buffer, _region = fenced(l1, result.sizes[0])
    assert blocking(adapter).load([key], [buffer]) == [False]  # the damaged one was read
    adapter.unlock([key])
    assert raw.exists(key) and raw.read(key) == good, "the record stored since was removed"
    stats = adapter.stats()
    assert stats["corrupt_records_removed"] == 1 and stats["corrupt_replaced_before_removal"] == 1
    monkeypatch.undo()
    result = blocking(adapter).lookup_and_lock([key])
    assert blocking(adapter).load([key], [buffer]) == [True] and bytes(buffer) == data[0]
    adapter.unlock([key])


def test_a_lookup_request_that_fails_is_never_taken_for_an_absent_object(
    adapter: L2Adapter, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Core releases the accounted bytes of a key a lookup answers absent (removed behind
    # the adapter's back); a request that failed says nothing about the object.
    from lmcache_plugin_s3.backend import S3Backend

    keys = make_keys(3)
    store(adapter, l1, keys)
    used = adapter.used_bytes()
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    lookup = backend._lookup
    failing = backend.names.of(keys[1])

    async def one_request_fails(key: ObjectKey) -> object:
        if backend.names.of(key) == failing:
            raise ConnectionError("connection reset by peer")
        return await lookup(key)

    monkeypatch.setattr(backend, "_lookup", one_request_fails)
    assert blocking(adapter).lookup_and_lock(keys).found == [False] * 3  # a failed batch: misses
    stats = adapter.stats()
    assert adapter.used_bytes() == used, "a failed request released an object's bytes"
    assert stats["lookup_request_failures"] == 1 and stats.get("objects_vanished", 0) == 0
    monkeypatch.undo()
    assert blocking(adapter).lookup_and_lock(keys).found == [True] * 3
    adapter.unlock(keys)
