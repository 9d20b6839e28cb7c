"""A server restarted with an edited config over what the old config stored in the bucket
(docs/upgrading.md, "Changing the configuration between restarts"): every load is the
stored bytes or a counted miss, and nothing of another prefix is listed, evicted or removed."""

from __future__ import annotations

import time
import zlib
from pathlib import Path
from typing import Any

import msgspec
import pytest
from s3_helpers import Raw, blocking, fresh_prefix, s3_config

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.l2_restarts import _eviction_controller
from lmcache_tiers.testing.seaweedfs import SeaweedS3

SIZE = 32 << 10
GIB = 1 << 30


def zstd() -> tuple[Serde, ...]:
    component = load_registry().get(Kind.SERDE, "zstd")
    return (component.create(component.config()),)


def open_s3(
    seaweed: SeaweedS3, prefix: str, l1: memoryview, serde: tuple[Serde, ...] = (), **fields: Any
) -> L2Adapter:
    registry = load_registry()
    config = s3_config(seaweed, prefix, **fields)
    context = AdapterContext(
        index=0, name="0:s3", config=config, serde=serde, l1_buffer=l1, l1_capacity=l1.nbytes
    )
    adapter = create_adapter(
        registry.get(Kind.L2_ADAPTER, "s3").load(), config, context, registry=registry, type_name="s3"
    )
    deadline = time.monotonic() + 60
    while adapter.stats().get("scan_running"):
        assert time.monotonic() < deadline, "the start-up scan never finished"
        time.sleep(0.02)
    return adapter


def store(
    adapter: L2Adapter, l1: memoryview, keys: list[ObjectKey], sizes: list[int] | None = None
) -> list[bytes]:
    sizes = sizes or [SIZE] * len(keys)
    data, buffers, offset = [], [], 0
    for index, size in enumerate(sizes):
        data.append(pattern(100 + index, size))
        buffers.append(l1[offset : offset + size])
        buffers[-1][:] = data[-1]
        offset += size
    assert blocking(adapter).store(keys, buffers) == [True] * len(keys)
    return data


def load(adapter: L2Adapter, l1: memoryview, keys: list[ObjectKey]) -> list[bytes | None]:
    client = blocking(adapter)
    found = client.lookup_and_lock(keys)
    hits = [(key, size) for key, hit, size in zip(keys, found.found, found.sizes, strict=True) if hit]
    base, buffers = 8 << 20, []
    for _key, size in hits:
        buffers.append(l1[base : base + size])
        base += size
    loaded = client.load([key for key, _ in hits], buffers)
    adapter.unlock([key for key, _ in hits])
    contents = {key: bytes(buffer) for (key, _), buffer, ok in zip(hits, buffers, loaded, strict=True) if ok}
    return [contents.get(key) for key in keys]


@pytest.mark.parametrize("change", ["added", "removed"])
def test_a_changed_serde_chain_makes_the_old_records_counted_misses_that_stay_accounted(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter], change: str
) -> None:
    prefix = fresh_prefix("chain")
    before, after = ((), zstd()) if change == "added" else (zstd(), ())
    keys = make_keys(3)
    first = open_s3(seaweed, prefix, l1, before)
    store(first, l1, keys)
    stored_bytes = first.used_bytes()
    first.close()
    again = open_s3(seaweed, prefix, l1, after)
    opened.append(again)
    assert again.used_bytes() == stored_bytes
    assert load(again, l1, keys) == [None] * 3
    assert again.stats()["serde_chain_mismatch"] >= 3
    raw = Raw(seaweed, prefix)
    assert all(raw.exists(key) for key in keys), "kept: the old chain reads them again"
    assert again.delete(keys) == [True] * 3
    assert again.used_bytes() == 0 and not any(raw.exists(key) for key in keys)


def test_another_salt_misses_and_the_old_salts_objects_stay_accounted(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    prefix = fresh_prefix("salt")
    old = make_keys(2, salt="old")
    first = open_s3(seaweed, prefix, l1)
    data = store(first, l1, old)
    first.close()
    again = open_s3(seaweed, prefix, l1)
    opened.append(again)
    assert again.used_bytes_by_salt() == {"old": 2 * SIZE}
    assert load(again, l1, make_keys(2, salt="new")) == [None, None]
    assert load(again, l1, old) == data


def test_a_lowered_capacity_accounts_everything_and_eviction_brings_it_under(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    prefix = fresh_prefix("capacity")
    keys = make_keys(5)
    sizes = [4 * SIZE] + [SIZE] * 4
    first = open_s3(seaweed, prefix, l1)
    store(first, l1, keys, sizes)
    first.close()
    capacity = 2 * SIZE
    eviction = L2EvictionConfig(eviction_policy="LRU", trigger_watermark=0.8, eviction_ratio=0.5)
    again = open_s3(seaweed, prefix, l1, max_capacity_gb=capacity / GIB, eviction=eviction)
    opened.append(again)
    assert again.used_bytes() == sum(sizes)
    assert again.stats()["scan_objects_past_capacity"] == 1
    controller = _eviction_controller(again, eviction)
    for _attempt in range(5):
        if again.used_bytes() <= capacity:
            break
        controller.evict(again.used_bytes() - capacity)  # type: ignore[attr-defined]
    assert again.used_bytes() <= capacity
    raw = Raw(seaweed, prefix)
    assert not raw.exists(keys[0])
    assert sum(SIZE for key in keys[1:] if raw.exists(key)) == again.used_bytes()


@pytest.mark.parametrize("moved", ["to-parent", "to-child"])
def test_a_prefix_moved_to_a_parent_or_a_child_never_touches_the_other_prefixes_objects(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter], moved: str
) -> None:
    parent = fresh_prefix("moved")
    child = f"{parent}/child"
    mine, theirs = (parent, child) if moved == "to-parent" else (child, parent)
    their_keys = make_keys(2, start=50)
    other = open_s3(seaweed, theirs, l1)
    store(other, l1, their_keys)
    other.close()
    my_keys = make_keys(2)
    adapter = open_s3(seaweed, mine, l1, max_capacity_gb=(4 * SIZE) / GIB)
    opened.append(adapter)
    assert adapter.stats()["scan_keys"] == 0 and adapter.used_bytes() == 0
    store(adapter, l1, my_keys)
    assert load(adapter, l1, their_keys) == [None, None]
    assert adapter.delete(their_keys + my_keys) == [False, False, True, True]
    raw = Raw(seaweed, theirs)
    assert all(raw.exists(key) for key in their_keys)


def aesgcm(key_file: str, *retired: str) -> tuple[Serde, ...]:
    from lmcache_plugin_serde_aesgcm import AesGcmConfig

    component = load_registry().get(Kind.SERDE, "aesgcm")
    config = msgspec.convert({"key_file": key_file, "read_key_files": list(retired)}, AesGcmConfig)
    return (component.create(config),)


def test_a_rotated_aesgcm_key_reads_the_old_records_only_with_the_old_key_retired(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter], tmp_path: Path
) -> None:
    old_key, new_key = tmp_path / "old.key", tmp_path / "new.key"
    for path, byte in ((old_key, 1), (new_key, 2)):
        path.write_bytes(bytes([byte]) * 32)
        path.chmod(0o600)
    prefix = fresh_prefix("rotated")
    keys = make_keys(2)
    first = open_s3(seaweed, prefix, l1, aesgcm(str(old_key)))
    data = store(first, l1, keys)
    first.close()
    rotated = open_s3(seaweed, prefix, l1, aesgcm(str(new_key)))
    assert load(rotated, l1, keys) == [None, None]
    assert rotated.used_bytes() == first.used_bytes()
    rotated.close()
    raw = Raw(seaweed, prefix)
    assert all(raw.exists(key) for key in keys)
    retired = open_s3(seaweed, prefix, l1, aesgcm(str(new_key), str(old_key)))
    opened.append(retired)
    assert load(retired, l1, keys) == data


def test_records_of_a_newer_format_listed_at_start_are_kept_and_leave_the_accounting_on_delete(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    """A newer server sharing the prefix wrote records this one does not read: listed and
    accounted (their size is real), each lookup a counted miss, and a delete (an eviction)
    releases them from the usage without removing them."""
    prefix = fresh_prefix("format")
    raw = Raw(seaweed, prefix)
    keys = make_keys(2)
    for index, key in enumerate(keys):
        payload = pattern(index, SIZE)
        header = bytearray(encode_header(key, payload, align=4096))
        header[4:6] = (99).to_bytes(2, "little")
        header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")
        raw.write(key, bytes(header) + payload)
    adapter = open_s3(seaweed, prefix, l1)
    opened.append(adapter)
    assert adapter.used_bytes() == 2 * SIZE
    assert load(adapter, l1, keys) == [None, None]
    assert adapter.stats()["record_version_unknown"] >= 2
    assert adapter.delete(keys) == [False, False]
    assert adapter.used_bytes() == 0
    assert all(raw.exists(key) for key in keys)
