"""``skip_l1`` in a running StorageManager: what the store controller deletes on its word."""

from __future__ import annotations

import threading
import types
from collections.abc import Iterator, Sequence

import pytest

from lmcache_tiers.config import AdapterSpec, L2AdapterConfig, ServerConfig
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, BackendContext
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import ComponentRegistry, KindRegistry
from lmcache_tiers.storage import StorageManager

MiB = 1 << 20
#: Larger than half the write-back bytes one adapter may have in flight (64 MiB), so a
#: second object's store waits in the controller while the first one's runs.
BIG = 40 * MiB


class HeldConfig(L2AdapterConfig):
    """In-memory adapter whose stores of chosen keys wait until the test lets them go."""


class HeldBackend:
    """A dict of bytes; a store of a key in ``held`` waits for ``release``."""

    concurrency = 4

    def __init__(self, config: HeldConfig, context: BackendContext) -> None:
        self.held: set[ObjectKey] = set()
        self.release = threading.Event()
        self.waiting = threading.Semaphore(0)  # one per held store that started waiting
        self.data: dict[ObjectKey, bytes] = {}
        self._lock = threading.Lock()

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        if self.held & set(keys):
            self.waiting.release()
            self.release.wait(30)
        with self._lock:
            for key, payload in zip(keys, payloads, strict=True):
                self.data[key] = bytes(payload)
        return [True] * len(keys)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        with self._lock:
            return [len(self.data[key]) if key in self.data else None for key in keys]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        with self._lock:
            for key, buffer in zip(keys, buffers, strict=True):
                buffer[:] = self.data[key]
        return [True] * len(keys)

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self._lock:
            return [self.data.pop(key, None) is not None for key in keys]

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self._lock:
            return [(key, len(data)) for key, data in self.data.items()]

    def capacity(self) -> None:
        return None


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("held", HeldBackend, HeldConfig)


def held_registry() -> ComponentRegistry:
    module = types.ModuleType("skip_l1_test_adapters")
    module.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    return discover(extra_plugins={"skip-l1-test-adapters": module}).registry


@pytest.fixture
def storage() -> Iterator[StorageManager]:
    config = ServerConfig(
        l1_size_gb=0.25,
        l2_adapters=(AdapterSpec(type="held", config=HeldConfig()),),
        l2_store_policy="skip_l1",
    )
    built = StorageManager(config, held_registry())
    yield built
    backend(built).release.set()  # a test that failed midway must not leave a store parked
    built.close()


def backend(storage: StorageManager) -> HeldBackend:
    adapter = storage.adapters[0]
    assert isinstance(adapter, BackendAdapter) and isinstance(adapter.backend, HeldBackend)
    return adapter.backend


def key_of(index: int) -> ObjectKey:
    return ObjectKey("skip-l1-test", 0, index.to_bytes(8, "big"))


def write(storage: StorageManager, keys: Sequence[ObjectKey], fill: bytes) -> None:
    reserved = storage.reserve_write(keys, [BIG] * len(keys))
    assert list(reserved) == list(keys)
    for obj in reserved.values():
        storage.view(obj)[:] = fill * BIG
    assert all(storage.commit_write(keys))


def read_back(storage: StorageManager, key: ObjectKey) -> bytes:
    assert storage.wait_prefetch(storage.submit_prefetch([key]), 10) == 1
    (obj,) = storage.read([key])
    try:
        return bytes(storage.view(obj)[:1])
    finally:
        storage.release([key], 2)


def test_a_rewritten_key_keeps_its_new_bytes(storage: StorageManager) -> None:
    """The first batch's first object is stored and leaves L1; the key is written again,
    with other bytes, while the batch's second store runs.  When that batch ends, skip_l1
    may drop what the batch stored -- not the newer object, whose store is still waiting."""
    held = backend(storage)
    first, second = key_of(1), key_of(2)
    held.held.add(second)
    write(storage, [first, second], b"o")
    assert held.waiting.acquire(timeout=10), "the second object's store never started"
    assert held.data.get(first) == b"o" * BIG

    assert storage.evict([first]) == 1  # stored in L2: an operator may drop it from L1
    write(storage, [first], b"n")  # a newer object of the same key, not yet stored
    held.release.set()
    assert storage.flush(10)

    assert read_back(storage, first) == b"n", "the acknowledged rewrite was lost"
    assert storage.status()["store"]["skipped_gone"] == 0, "the rewrite's store was skipped"
