"""What the bucket may hold besides good records -- damage, other writers' objects,
replaced objects, header copies in metadata that are missing or out of step with their
record -- and that none of it reaches a caller's buffer as garbage."""

from __future__ import annotations

import gc
import logging
import time
import tracemalloc
import zlib
from collections.abc import Callable

import pytest
from flipping_relay import FlippingRelay
from lmcache_plugin_s3.backend import S3Backend
from lmcache_plugin_s3.records import HEADER_BYTES, HEADER_METADATA, header_from_metadata, header_metadata
from s3_helpers import Raw, blocking, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.l2.record import RECORD_MAGIC, encode_header
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


def s3_backend(adapter: L2Adapter) -> S3Backend:
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    return backend


def stored_then_damaged(adapter: L2Adapter, raw: Raw, l1: memoryview, key: ObjectKey) -> tuple[bytes, bytes]:
    """``key`` stored, then its object's last payload byte flipped in the bucket: the
    payload stored and the intact record."""
    (data,) = store(adapter, l1, [key])
    good = raw.read(key)
    damaged = bytearray(good)
    damaged[-1] ^= 0xFF
    raw.write(key, bytes(damaged))
    return data, good


def written_before(
    monkeypatch: pytest.MonkeyPatch,
    adapter: L2Adapter,
    method: str,
    picks: Callable[[str, dict[str, object]], bool],
    write: Callable[[], None],
) -> None:
    """Another server's ``write`` into the bucket, once, just before the adapter's first
    ``client.<method>`` request that ``picks`` (its S3 operation and arguments)."""
    client = s3_backend(adapter).client
    send = getattr(client, method)
    pending = [write]

    async def another_server_writes_first(operation: str, **kwargs: object) -> object:
        if pending and picks(operation, kwargs):
            pending.pop()()
        return await send(operation, **kwargs)

    monkeypatch.setattr(client, method, another_server_writes_first)


def damaged_load_keeps_the_new_record(
    adapter: L2Adapter,
    raw: Raw,
    l1: memoryview,
    monkeypatch: pytest.MonkeyPatch,
    key: ObjectKey,
    data: bytes,
    good: bytes,
) -> dict[str, int]:
    """A load of ``key`` that reads the damaged object is a miss, and ``good`` -- the record
    another server wrote meanwhile (see :func:`written_before`) -- is kept and loads once
    that writer is gone.  The adapter's stats after the miss."""
    result = blocking(adapter).lookup_and_lock([key])
    buffer, _region = fenced(l1, result.sizes[0])
    assert blocking(adapter).load([key], [buffer]) == [False]  # the damaged one was read
    adapter.unlock([key])
    assert raw.exists(key) and raw.read(key) == good, "the record stored since was removed"
    stats = adapter.stats()
    monkeypatch.undo()
    result = blocking(adapter).lookup_and_lock([key])
    assert blocking(adapter).load([key], [buffer]) == [True] and bytes(buffer) == data
    adapter.unlock([key])
    return stats


def _second_read(operation: str, kwargs: dict[str, object]) -> bool:
    return operation == "get_object" and "IfMatch" in kwargs


def _removal(operation: str, _kwargs: dict[str, object]) -> bool:
    return operation == "delete_object"


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
    # ... as the removal did, not as an object found gone behind the adapter's back
    assert adapter.stats().get("objects_vanished", 0) == 0


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
    # Released as it was removed, not when a later lookup finds it gone.
    assert adapter.used_bytes() == 0
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert adapter.stats().get("objects_vanished", 0) == 0


def test_damage_a_second_read_does_not_find_is_no_reason_to_remove_the_object(
    seaweed: SeaweedS3, prefix: str, raw: Raw, l1: memoryview, opened: list[L2Adapter]
) -> None:
    # A byte flipped on the way (a faulty link, a middlebox: plain HTTP has only TCP's
    # checksum) fails the record's checksum as damage in the store does -- but the object
    # in the store is an intact, acknowledged write, and removing it loses it.
    with FlippingRelay(seaweed.endpoint) as relay:
        adapter = open_adapter(s3_config(seaweed, prefix, endpoint_url=relay.endpoint), l1)
        opened.append(adapter)
        (key,) = make_keys(1)
        data = store(adapter, l1, [key])
        result = blocking(adapter).lookup_and_lock([key])
        buffer, region = fenced(l1, result.sizes[0])
        relay.flip_once(after=HEADER_BYTES + SIZE // 2)  # past the HTTP head: in the payload
        assert blocking(adapter).load([key], [buffer]) == [True]
        adapter.unlock([key])
        assert relay.flipped == 1, "no byte was flipped: the test tested nothing"
        assert bytes(buffer) == data[0] and canaries_intact(region, SIZE)
        assert raw.exists(key), "an intact object was removed for damage done on the way"
        stats = adapter.stats()
        assert stats["damage_not_repeated"] == 1 and stats.get("corrupt_records_removed", 0) == 0


def test_a_load_read_again_for_damage_no_longer_holds_the_first_reads_payload(
    seaweed: SeaweedS3, prefix: str, l1: memoryview, opened: list[L2Adapter]
) -> None:
    # The damage raises through the frame that read the payload, and the exception's
    # traceback and the request's task hold each other: without the payload dropped, only
    # the cycle collector frees it, so the second read of a large record ran with the
    # first one's bytes still held -- twice the load's memory.  The collector is off here
    # so the outcome does not depend on when it happens to run.
    size = 2 << 20
    with FlippingRelay(seaweed.endpoint) as relay:
        adapter = open_adapter(s3_config(seaweed, prefix, endpoint_url=relay.endpoint), l1)
        opened.append(adapter)
        (key,) = make_keys(1)
        data = store(adapter, l1, [key], size=size)
        result = blocking(adapter).lookup_and_lock([key])
        buffer, _region = fenced(l1, result.sizes[0])
        backend = s3_backend(adapter)
        request = backend.client.request
        held_at_second_read: list[int] = []

        async def measured(method: str, **kwargs: object) -> object:
            if method == "get_object" and "IfMatch" in kwargs:
                held_at_second_read.append(tracemalloc.get_traced_memory()[0] - baseline)
            return await request(method, **kwargs)

        backend.client.request = measured  # type: ignore[method-assign]
        gc.collect()
        gc.disable()
        tracemalloc.start()
        try:
            baseline = tracemalloc.get_traced_memory()[0]
            relay.flip_once(after=HEADER_BYTES + size // 2)  # past the HTTP head: in the payload
            loaded = blocking(adapter).load([key], [buffer])
        finally:
            tracemalloc.stop()
            gc.enable()
            del backend.client.request
        adapter.unlock([key])
    assert relay.flipped == 1, "no byte was flipped: the test tested nothing"
    assert loaded == [True] and bytes(buffer) == data[0]
    assert len(held_at_second_read) == 1
    assert held_at_second_read[0] < size // 2, f"{held_at_second_read[0]} bytes held at the second read"


def test_a_lookup_reading_damage_a_second_read_does_not_find_keeps_the_object(
    seaweed: SeaweedS3, prefix: str, raw: Raw, l1: memoryview, opened: list[L2Adapter]
) -> None:
    # A record without a header copy (an older writer's) is looked up by its own header:
    # a byte flipped on the way there is no damage of the object either.
    (key,) = make_keys(1)
    payload = pattern(3, SIZE)
    record = encode_header(key, payload, align=HEADER_BYTES) + payload
    raw.write(key, record)  # no metadata: no copy
    with FlippingRelay(seaweed.endpoint) as relay:
        adapter = open_adapter(s3_config(seaweed, prefix, endpoint_url=relay.endpoint), l1)
        opened.append(adapter)
        relay.flip_once(after=100, marker=RECORD_MAGIC)  # inside the header
        result = blocking(adapter).lookup_and_lock([key])
        assert relay.flipped == 1, "no byte was flipped: the test tested nothing"
        assert result.found == [True] and result.sizes == [SIZE]
        buffer, _region = fenced(l1, SIZE)
        assert blocking(adapter).load([key], [buffer]) == [True] and bytes(buffer) == payload
        adapter.unlock([key])
    assert raw.exists(key) and raw.read(key) == record, "an intact object was removed"
    stats = adapter.stats()
    assert stats["damage_not_repeated"] == 1 and stats.get("corrupt_records_removed", 0) == 0


def test_a_lookup_whose_damaged_object_is_replaced_before_its_second_read_fails(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Neither absent (core would release the new object's bytes) nor damage: a failure.
    (key,) = make_keys(1)
    payload = pattern(3, SIZE)
    good = encode_header(key, payload, align=HEADER_BYTES) + payload
    damaged = bytearray(good)
    damaged[100] ^= 0xFF  # inside the header: its crc fails
    raw.write(key, bytes(damaged))  # no metadata: the lookup reads the record's header
    # the good record, between the two reads
    written_before(monkeypatch, adapter, "request", _second_read, lambda: raw.write(key, good))
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert raw.exists(key) and raw.read(key) == good, "the record stored since was removed"
    stats = adapter.stats()
    assert stats["replaced_before_reread"] == 1 and stats["backend_errors"] == 1
    assert stats.get("corrupt_records_removed", 0) == 0
    monkeypatch.undo()
    result = blocking(adapter).lookup_and_lock([key])
    assert result.found == [True]
    adapter.unlock([key])


def test_a_damaged_record_replaced_before_its_second_read_is_kept(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    (key,) = make_keys(1)
    data, good = stored_then_damaged(adapter, raw, l1, key)
    # the good record again, between the two reads
    written_before(monkeypatch, adapter, "request", _second_read, lambda: raw.write(key, good))
    stats = damaged_load_keeps_the_new_record(adapter, raw, l1, monkeypatch, key, data, good)
    assert stats["replaced_before_reread"] == 1 and stats.get("corrupt_records_removed", 0) == 0


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


def test_another_keys_record_under_this_name_is_a_miss_that_is_kept(
    adapter: L2Adapter, raw: Raw, l1: memoryview
) -> None:
    mine, theirs = make_keys(2)
    store(adapter, l1, [theirs])
    raw.write(mine, raw.read(theirs))
    assert blocking(adapter).lookup_and_lock([mine, theirs]).found == [False, True]
    adapter.unlock([theirs])
    buffer, region = fenced(l1, SIZE)
    assert blocking(adapter).load([mine], [buffer]) == [False]  # a load with no lookup first
    assert canaries_intact(region, SIZE)
    assert raw.exists(mine) and raw.exists(theirs), "another writer's intact record: never deleted"
    stats = adapter.stats()
    assert stats["foreign_records"] == 2 and stats.get("corrupt_records_removed", 0) == 0


def test_a_stored_key_another_writer_replaced_is_released_and_logged_as_replaced(
    adapter: L2Adapter, raw: Raw, l1: memoryview, caplog: pytest.LogCaptureFixture
) -> None:
    """The lookup reads another key's record under a key this adapter stored: kept, and
    this adapter's bytes released as vanished -- said to be replaced in the store, not
    removed from it (the object is still there)."""
    mine, theirs = make_keys(2)
    store(adapter, l1, [mine, theirs])
    before = adapter.used_bytes()
    raw.write(mine, raw.read(theirs))
    with caplog.at_level(logging.WARNING):
        assert blocking(adapter).lookup_and_lock([mine]).found == [False]
    assert raw.exists(mine), "another writer's intact record: never deleted"
    stats = adapter.stats()
    assert stats["foreign_records"] == 1 and stats["objects_vanished"] == 1
    assert 0 < adapter.used_bytes() < before
    said = [m for m in (r.getMessage() for r in caplog.records) if "accounted object" in m]
    assert len(said) == 1 and "replaced in the store by a record this adapter keeps" in said[0], said


def test_an_fs_record_in_the_folder_is_never_removed_by_a_lookup(adapter: L2Adapter, raw: Raw) -> None:
    """An ``fs`` adapter on ``s3://<bucket>/<prefix>`` names its record of a salted key
    ``<name>.bin``: this codec's name of the key whose salt has ".bin" added.  A lookup
    of that key reads the fs record, intact, of another key: the fs server's object."""
    from lmcache_tiers.l2.files import record_name

    (base,) = make_keys(1)
    fs_key = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant")
    mine = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant.bin")
    fs_name = raw.names.folder + record_name(fs_key)
    assert raw.names.of(mine) == fs_name
    payload = pattern(9, SIZE)
    raw.write(fs_name, encode_header(fs_key, payload, align=4096) + payload)
    assert blocking(adapter).lookup_and_lock([mine]).found == [False]
    assert raw.exists(fs_name), "the fs server's acknowledged write is kept"
    assert adapter.stats()["foreign_records"] == 1


def test_an_fs_record_the_listing_took_for_a_key_is_never_deleted(
    seaweed: SeaweedS3, prefix: str, l1: memoryview, raw: Raw
) -> None:
    """The start-up listing reads names only, so it accounts an fs record of a salted key
    as this codec's key with ".bin" added to its salt; deleting that key (as the L2
    eviction does with what the listing found) must not remove the fs server's object."""
    from lmcache_tiers.l2.files import record_name

    (base,) = make_keys(1)
    fs_key = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant")
    mine = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant.bin")
    own = make_keys(1, start=5)
    payload = pattern(9, SIZE)
    fs_name = raw.names.folder + record_name(fs_key)
    raw.write(fs_name, encode_header(fs_key, payload, align=4096) + payload)
    first = open_adapter(s3_config(seaweed, prefix), l1)
    try:
        store(first, l1, own)
    finally:
        first.close()
    adapter = open_adapter(s3_config(seaweed, prefix), l1)
    try:
        deadline = time.monotonic() + 60
        while adapter.stats().get("scan_running"):
            assert time.monotonic() < deadline, "the start-up scan never finished"
            time.sleep(0.02)
        assert set(adapter.iter_keys()) == {mine, *own}
        assert adapter.delete([mine, *own]) == [False, True]
        assert raw.exists(fs_name), "the fs server's acknowledged write was deleted"
        assert not raw.exists(own[0])
        assert adapter.stats()["foreign_records"] >= 1
        assert adapter.used_bytes() == 0, "the foreign record is no longer accounted"
    finally:
        adapter.close()


def test_a_foreign_record_a_delete_finds_is_counted_once(adapter: L2Adapter, raw: Raw) -> None:
    """The delete that finds another key's record counts and logs it; the check core makes
    next (is the key absent?) reads the same record and must not count it again."""
    from lmcache_tiers.l2.files import record_name

    (base,) = make_keys(1)
    fs_key = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant")
    mine = ObjectKey(base.model_name, base.kv_rank, base.chunk_hash, base.object_group, "tenant.bin")
    payload = pattern(9, SIZE)
    fs_name = raw.names.folder + record_name(fs_key)
    raw.write(fs_name, encode_header(fs_key, payload, align=4096) + payload)
    assert adapter.delete([mine]) == [False]
    assert raw.exists(fs_name)
    assert adapter.stats()["foreign_records"] == 1


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
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")  # intact: its crc taken again
    raw.write(key, bytes(header) + payload)
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert raw.exists(key), "a newer server sharing the bucket may read it"
    assert adapter.stats()["record_version_unknown"] == 1


@pytest.mark.parametrize("copy", [False, True], ids=["no-copy", "header-copy"])
def test_a_delete_keeps_a_record_of_an_unknown_format_version(
    adapter: L2Adapter, raw: Raw, l1: memoryview, copy: bool
) -> None:
    """A newer server sharing the bucket replaced a record this one stored: the delete (the
    L2 eviction's) must leave that server's object, release the key's bytes (no record of
    this adapter any more) and count it once -- not again in the check core makes next."""
    (key,) = make_keys(1)
    store(adapter, l1, [key])
    assert adapter.used_bytes() == SIZE
    payload = pattern(6, SIZE)
    header = bytearray(encode_header(key, payload, align=4096))
    header[4:6] = (99).to_bytes(2, "little")  # a format a newer server might write
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")  # intact: its crc taken again
    raw.write(key, bytes(header) + payload, header_metadata(bytes(header)) if copy else None)
    assert adapter.delete([key]) == [False]
    assert raw.exists(key), "a newer server's acknowledged write was deleted"
    assert adapter.used_bytes() == 0, "a record this server cannot read is still accounted"
    stats = adapter.stats()
    assert stats["record_version_unknown"] == 1
    assert stats.get("corrupt_records_removed", 0) == 0


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
    (key,) = make_keys(1)
    data, good = stored_then_damaged(adapter, raw, l1, key)
    # the good record again, between the read and the removal
    written_before(monkeypatch, adapter, "call", _removal, lambda: raw.write(key, good))
    stats = damaged_load_keeps_the_new_record(adapter, raw, l1, monkeypatch, key, data, good)
    assert stats.get("corrupt_records_removed", 0) == 0 and stats["corrupt_replaced_before_removal"] == 1


def test_an_empty_object_replaced_before_its_removal_is_kept(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An empty object has no header to read (the ranged GET is refused); its removal must
    # still be conditional on the object that was judged, as every other removal is.
    (key,) = make_keys(1)
    data = store(adapter, l1, [key])
    good = raw.read(key)
    raw.write(key, b"")
    # the good record again, between the lookup and the removal
    written_before(monkeypatch, adapter, "call", _removal, lambda: raw.write(key, good))
    assert blocking(adapter).lookup_and_lock([key]).found == [False]  # the empty one was judged
    assert raw.exists(key) and raw.read(key) == good, "the record stored since was removed"
    stats = adapter.stats()
    assert stats.get("corrupt_records_removed", 0) == 0 and stats["corrupt_replaced_before_removal"] == 1
    monkeypatch.undo()
    result = blocking(adapter).lookup_and_lock([key])
    buffer, _region = fenced(l1, result.sizes[0])
    assert blocking(adapter).load([key], [buffer]) == [True] and bytes(buffer) == data[0]
    adapter.unlock([key])


def test_a_lookup_request_that_fails_is_never_taken_for_an_absent_object(
    adapter: L2Adapter, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Core releases the accounted bytes of a key a lookup answers absent (removed behind
    # the adapter's back); a request that failed says nothing about the object.
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


def fail_requests_on(backend: S3Backend, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request on the object ``name`` fails (a connection reset); the others go out."""
    request = backend.client.request

    async def failing_on_name(method: str, **kwargs: object) -> object:
        if kwargs.get("Key") == name:
            raise ConnectionError("connection reset by peer")
        return await request(method, **kwargs)

    monkeypatch.setattr(backend.client, "request", failing_on_name)


def test_a_batch_that_fails_part_way_reports_its_done_keys_and_reaches_the_breaker(
    adapter: L2Adapter, l1: memoryview, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store, load or delete of which one request failed while the others were done:
    # the done keys are accounted, and the call counts as failed (backend_errors, the
    # circuit breaker) -- answered alone, a service failing one request in every batch
    # would never be seen by the breaker.
    keys = make_keys(3)
    store(adapter, l1, keys[:2])
    found = blocking(adapter).lookup_and_lock(keys[:2])
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    fail_requests_on(backend, backend.names.of(keys[1]), monkeypatch)
    buffers = [l1[index * SIZE : (index + 1) * SIZE] for index in range(2)]
    assert blocking(adapter).load(keys[:2], buffers) == [True, False]
    adapter.unlock(keys[:2])
    assert found.found == [True, True]
    assert adapter.stats()["backend_errors"] == 1, "a load that failed part-way went unseen"
    stored_buffers = [l1[4 << 20 : (4 << 20) + SIZE], l1[(4 << 20) + SIZE : (4 << 20) + 2 * SIZE]]
    assert blocking(adapter).store([keys[2], keys[1]], stored_buffers) == [True, False]
    assert adapter.stats()["backend_errors"] == 2, "a store that failed part-way went unseen"
    assert adapter.delete([keys[0], keys[1]]) == [True, False]
    stats = adapter.stats()
    # the delete, and the lookup core asks of the key it did not delete (which fails whole)
    assert stats["backend_errors"] == 4, "a delete that failed part-way went unseen"
    assert stats["load_request_failures"] == stats["store_request_failures"] == 1
    assert stats["delete_request_failures"] == 1
    assert not raw.exists(keys[0]) and raw.exists(keys[1]) and raw.exists(keys[2])
    assert adapter.used_bytes() == 2 * SIZE, "the keys done were not accounted as done"


def answers_without_etags(backend: S3Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service's answers reach the adapter without an ETag (as from a store that sends none)."""
    request = backend.client.request

    async def without_etag(method: str, **kwargs: object) -> object:
        answer = await request(method, **kwargs)
        if isinstance(answer, dict):
            answer.pop("ETag", None)
        return answer

    monkeypatch.setattr(backend.client, "request", without_etag)


def test_an_object_read_without_an_etag_is_never_removed_unconditionally(
    adapter: L2Adapter, l1: memoryview, raw: Raw, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Removing an object is conditional on the ETag of the one judged: without one, the
    # removal could take a record another server stored there since.  The object is
    # kept, counted: damage is a miss each time (never its bytes) until a store
    # replaces it, and a delete fails.
    damaged, intact = make_keys(2)
    raw.write(damaged, b"not a record" * 1000)
    store(adapter, l1, [intact])
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    answers_without_etags(backend, monkeypatch)
    assert blocking(adapter).lookup_and_lock([damaged]).found == [False]
    assert adapter.delete([intact]) == [False]
    assert raw.exists(damaged) and raw.exists(intact)
    stats = adapter.stats()
    assert stats.get("corrupt_records_removed", 0) == 0
    assert stats["corrupt_kept_without_etag"] == 1
    assert stats["delete_kept_without_etag"] == 1


# -- the header copy in each object's metadata (what makes a lookup one HEAD) ---------------


@pytest.fixture
def requests(adapter: L2Adapter, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The S3 operations the adapter sends, in order (the calls themselves go through)."""
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    sent: list[str] = []
    request = backend.client.request

    async def recorded(method: str, **kwargs: object) -> object:
        sent.append(method)
        return await request(method, **kwargs)

    monkeypatch.setattr(backend.client, "request", recorded)
    return sent


def record(key: ObjectKey, size: int = SIZE, seed: int = 3) -> tuple[bytes, bytes]:
    """(header slot, payload) of a record of ``key``, as the adapter writes it."""
    payload = pattern(seed, size)
    return encode_header(key, payload, align=HEADER_BYTES), payload


def test_the_copy_gives_back_the_header_slot_byte_for_byte() -> None:
    (key,) = make_keys(1)
    header, _payload = record(key)
    assert header_from_metadata({"Metadata": header_metadata(header)}) == header
    # Zero bytes at the end of the fields are stripped with the padding and come back with it.
    slot = b"fields\0\0" + bytes(HEADER_BYTES - 12) + b"crc!"
    assert header_from_metadata({"Metadata": header_metadata(slot)}) == slot
    assert header_from_metadata({"Metadata": {}}) is None
    assert header_from_metadata({}) is None


def test_a_header_too_long_for_s3_metadata_gets_no_copy() -> None:
    assert header_metadata(bytes(range(256)) * (HEADER_BYTES // 256)) == {}


@pytest.mark.parametrize("text", ["not base64!", "", "QUJD" * 2000], ids=["garbage", "empty", "too-long"])
def test_a_copy_that_is_not_a_header_slot_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        header_from_metadata({"Metadata": {HEADER_METADATA: text}})


def test_a_stored_record_carries_its_copy_and_a_lookup_is_one_head(
    adapter: L2Adapter, raw: Raw, l1: memoryview, requests: list[str]
) -> None:
    (key,) = make_keys(1)
    l1[:SIZE] = pattern(5, SIZE)
    assert blocking(adapter).store([key], [l1[:SIZE]]) == [True]
    header = raw.read(key)[:HEADER_BYTES]
    assert header_from_metadata({"Metadata": raw.metadata(key)}) == header
    requests.clear()
    result = blocking(adapter).lookup_and_lock([key])
    assert result.found == [True] and result.sizes == [SIZE]
    assert requests == ["head_object"]
    buffer = l1[SIZE : 2 * SIZE]
    assert blocking(adapter).load([key], [buffer]) == [True] and bytes(buffer) == pattern(5, SIZE)
    adapter.unlock([key])
    assert adapter.stats().get("header_copy_unusable", 0) == 0


def test_a_record_without_a_copy_is_found_by_its_own_header(
    adapter: L2Adapter, raw: Raw, requests: list[str]
) -> None:
    (key,) = make_keys(1)
    header, payload = record(key)
    raw.write(key, header + payload)  # a writer that stores no copy
    result = blocking(adapter).lookup_and_lock([key])
    assert result.found == [True] and result.sizes == [SIZE]
    adapter.unlock([key])
    assert requests == ["head_object", "get_object"]
    assert adapter.stats().get("header_copy_unusable", 0) == 0, "no copy is not an unusable one"


def _copies(key: ObjectKey, other: ObjectKey) -> dict[str, dict[str, str]]:
    return {
        "not-a-header": {HEADER_METADATA: "bm90IGEgaGVhZGVy"},
        "another-keys-header": header_metadata(record(other)[0]),
        "of-a-longer-record": header_metadata(record(key, size=2 * SIZE)[0]),
    }


@pytest.mark.parametrize("copy", ["not-a-header", "another-keys-header", "of-a-longer-record"])
def test_a_copy_out_of_step_with_its_record_leaves_the_answer_to_the_record(
    adapter: L2Adapter, raw: Raw, l1: memoryview, requests: list[str], copy: str
) -> None:
    key, other = make_keys(2)
    header, payload = record(key)
    raw.write(key, header + payload, metadata=_copies(key, other)[copy])
    result = blocking(adapter).lookup_and_lock([key])
    assert result.found == [True] and result.sizes == [SIZE], "the record itself is intact"
    assert requests == ["head_object", "get_object"]
    buffer = l1[:SIZE]
    assert blocking(adapter).load([key], [buffer]) == [True] and bytes(buffer) == payload
    adapter.unlock([key])
    stats = adapter.stats()
    assert stats["header_copy_unusable"] == 1
    assert stats.get("corrupt_records_removed", 0) == 0 and raw.exists(key), "a copy never removes an object"


def test_a_record_damaged_under_an_intact_copy_fails_its_load_and_is_removed(
    adapter: L2Adapter, raw: Raw, l1: memoryview
) -> None:
    (key,) = make_keys(1)
    header, payload = record(key)
    damaged = bytearray(header)
    damaged[HEADER_BYTES - 1] ^= 0xFF  # the record's own header crc
    raw.write(key, bytes(damaged) + payload, metadata=header_metadata(header))
    result = blocking(adapter).lookup_and_lock([key])
    assert result.found == [True], "the copy and the object's size agree: a hit until the load"
    buffer = l1[:SIZE]
    buffer[:] = bytes(SIZE)
    assert blocking(adapter).load([key], [buffer]) == [False]
    assert bytes(buffer) == bytes(SIZE), "nothing of a damaged record is handed out"
    adapter.unlock([key])
    assert not raw.exists(key)
    assert adapter.stats()["corrupt_records_removed"] == 1


def test_a_copy_of_another_serde_chain_is_a_miss_that_is_kept(
    adapter: L2Adapter, raw: Raw, requests: list[str]
) -> None:
    (key,) = make_keys(1)
    payload = pattern(9, SIZE)
    header = encode_header(key, payload, serde=("zstd",), align=HEADER_BYTES)
    raw.write(key, header + payload, metadata=header_metadata(header))
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert requests == ["head_object"]
    assert raw.exists(key)
    assert adapter.stats()["serde_chain_mismatch"] == 1


def test_a_record_replaced_between_the_delete_check_and_the_removal_is_kept(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete reads what is under the name, then removes it in a batch: another server
    storing the key in between has its record kept (the removal is conditional on the
    ETag read), counted and reported not deleted, so core asks about the key again."""
    keys = make_keys(2)
    store(adapter, l1, keys)
    replaced, gone = keys
    payload = pattern(77, SIZE)  # another server's record of the key: other bytes, other ETag
    newer = encode_header(replaced, payload, align=4096) + payload
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    call = backend.client.call

    async def another_server_stores_first(method: str, **kwargs: object) -> object:
        if method == "delete_objects":
            raw.write(replaced, newer)  # between the check and the removal
        return await call(method, **kwargs)

    monkeypatch.setattr(backend.client, "call", another_server_stores_first)
    assert adapter.delete(keys) == [False, True]
    assert raw.exists(replaced) and raw.read(replaced) == newer, "a record stored since was removed"
    assert not raw.exists(gone)
    stats = adapter.stats()
    assert stats["delete_replaced_before_removal"] == 1
    assert stats.get("delete_request_failures", 0) == 0


def test_a_record_removed_between_the_delete_check_and_the_removal_is_deleted(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another server deleting the key between the delete's check and the removal leaves
    what the delete wanted: the key is gone.  A service that answers the conditional
    removal of a missing object "no such key" (SeaweedFS does) must not make it a failed
    delete request, counted and logged as one."""
    keys = make_keys(2)
    store(adapter, l1, keys)
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    call = backend.client.call

    async def another_server_deletes_first(method: str, **kwargs: object) -> object:
        if method == "delete_objects":
            raw.fs.rm_file(raw.path(keys[0]))  # between the check and the removal
        return await call(method, **kwargs)

    monkeypatch.setattr(backend.client, "call", another_server_deletes_first)
    assert adapter.delete(keys) == [True, True]
    assert not raw.exists(keys[0]) and not raw.exists(keys[1])
    assert adapter.stats().get("delete_request_failures", 0) == 0


def test_a_damaged_record_whose_ranged_read_names_no_etag_is_removed_only_if_unchanged_since_the_head(
    adapter: L2Adapter, raw: Raw, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lookup's ranged read answered without an ETag: the removal of the damage it found
    # is conditional on the HEAD's ETag, so a record stored since is kept -- never an
    # unconditional removal.
    (key,) = make_keys(1)
    store(adapter, l1, [key])
    good = raw.read(key)
    raw.write(key, b"not a record" * 1000)  # no header copy in its metadata: the record is read
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    assert isinstance(backend, S3Backend)
    request = backend.client.request

    async def ranged_reads_without_etag(method: str, **kwargs: object) -> object:
        if method == "delete_object":
            raw.write(key, good)  # another server stores, between the read and the removal
        answer = await request(method, **kwargs)
        if method == "get_object" and isinstance(answer, dict):
            answer.pop("ETag", None)
        return answer

    monkeypatch.setattr(backend.client, "request", ranged_reads_without_etag)
    assert blocking(adapter).lookup_and_lock([key]).found == [False]
    assert raw.exists(key) and raw.read(key) == good, "the record stored since was removed"
    stats = adapter.stats()
    assert stats["corrupt_replaced_before_removal"] == 1
    assert stats.get("corrupt_kept_without_etag", 0) == 0
