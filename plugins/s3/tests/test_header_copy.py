"""The copy of each record's header in its object's metadata: what makes a lookup one HEAD,
and why a copy that is missing, unreadable or out of step with its object never decides
more than the record's own header would."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from lmcache_plugin_s3.backend import S3Backend
from lmcache_plugin_s3.records import HEADER_BYTES, HEADER_METADATA, header_from_metadata, header_metadata
from s3_helpers import Raw, blocking, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.seaweedfs import SeaweedS3

SIZE = 64 << 10


@pytest.fixture
def prefix() -> str:
    return fresh_prefix("header-copy")


@pytest.fixture
def l1() -> memoryview:
    return memoryview(bytearray(4 << 20))


@pytest.fixture
def adapter(seaweed: SeaweedS3, prefix: str, l1: memoryview) -> Iterator[L2Adapter]:
    adapter = open_adapter(s3_config(seaweed, prefix), l1)
    yield adapter
    adapter.close()


@pytest.fixture
def raw(seaweed: SeaweedS3, prefix: str) -> Raw:
    return Raw(seaweed, prefix)


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
