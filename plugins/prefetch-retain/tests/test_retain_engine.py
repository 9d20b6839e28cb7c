"""``retain`` in a running StorageManager: what it keeps in L1, and what frees it."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.errors import L1OutOfMemoryError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import ComponentRegistry
from lmcache_tiers.storage import StorageManager

SIZE = 1 << 20
L1_OBJECTS = 16

Build = Callable[..., StorageManager]


@pytest.fixture(scope="module")
def registry() -> ComponentRegistry:
    return discover().registry


@pytest.fixture
def engine(registry: ComponentRegistry, request: pytest.FixtureRequest) -> Iterator[Build]:
    built: list[StorageManager] = []

    def build(**settings: Any) -> StorageManager:
        adapter = decode_adapter(registry, {"type": "mock", "namespace": f"retain-{request.node.name}"}, 0)
        config = ServerConfig(
            l1_size_gb=L1_OBJECTS * SIZE / (1 << 30),
            l2_adapters=(adapter,),
            l2_prefetch_policy="retain",
            **settings,
        )
        built.append(StorageManager(config, registry))
        return built[-1]

    yield build
    for storage in built:
        storage.close()


def keys_of(count: int, *, start: int = 0) -> list[ObjectKey]:
    return [ObjectKey("retain-test", 0, index.to_bytes(8, "big")) for index in range(start, start + count)]


def write(storage: StorageManager, keys: Sequence[ObjectKey]) -> None:
    reserved = storage.reserve_write(keys, [SIZE] * len(keys))
    for key, obj in reserved.items():
        storage.view(obj)[:] = key.chunk_hash * (SIZE // len(key.chunk_hash))
    assert all(storage.commit_write(keys))


def load_back(storage: StorageManager, keys: Sequence[ObjectKey]) -> None:
    """Prefetch ``keys`` from L2 (none is in L1) and release them as a reader would."""
    assert not any(storage.l1.contains(key) for key in keys)
    assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == len(keys)
    storage.release(keys)


def test_loaded_objects_outlive_their_reader_and_stay_evictable(engine: Build) -> None:
    storage = engine()
    keys = keys_of(4)
    write(storage, keys)
    assert storage.flush(10)
    storage.clear()
    load_back(storage, keys)
    assert all(storage.l1.contains(key) for key in keys), "retained objects outlive their reader"
    assert storage.l1.stats().read_locks == 0, "nothing stays locked once the reader is done"
    assert storage.evict(keys) == len(keys), "a retained object is an ordinary, evictable one"


def write_all_to_l2(storage: StorageManager, keys: list[ObjectKey]) -> None:
    """Write ``keys`` a few at a time (L1 holds only so many) and wait for their L2 stores."""
    for start in range(0, len(keys), 4):
        write(storage, keys[start : start + 4])
    assert storage.flush(10)


def test_loaded_objects_make_room_for_writes_under_lru(engine: Build) -> None:
    storage = engine(eviction_policy="LRU", l2_store_policy="skip_l1")
    loaded = keys_of(L1_OBJECTS)
    write_all_to_l2(storage, loaded)
    load_back(storage, loaded)
    write(storage, keys_of(4, start=100))  # L1 is full of loaded objects: eviction frees them


def test_with_noop_eviction_loaded_objects_fill_l1(engine: Build) -> None:
    """Documented: nothing deletes what ``retain`` loads when L1 never evicts."""
    storage = engine(eviction_policy="noop", l2_store_policy="skip_l1")
    loaded = keys_of(L1_OBJECTS)
    write_all_to_l2(storage, loaded)
    assert len(storage.l1) == 0, "skip_l1 emptied L1"
    load_back(storage, loaded)
    with pytest.raises(L1OutOfMemoryError):
        write(storage, keys_of(1, start=100))
    assert storage.status()["failures"]["l1_write_oom"] == 1
