"""Helpers of the engine tests: building a StorageManager, keys, payloads, invariants."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from lmcache_tiers.config import AdapterSpec, L2AdapterConfig, ServerConfig, decode_adapter
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, BackendContext
from lmcache_tiers.registry import ComponentRegistry, KindRegistry
from lmcache_tiers.serde import SerdeContext
from lmcache_tiers.storage import StorageManager
from lmcache_tiers.testing.registries import plugins_with

MiB = 1 << 20
L1_GB = 64 / 1024  # 64 MiB: small enough for many engines per test run


class GatedConfig(L2AdapterConfig):
    """In-memory adapter whose loads can be held back by the test."""

    capacity_mb: float | None = None


class GatedBackend:
    """A dict of bytes; ``gate`` / ``store_gate`` (open by default) hold loads / stores back."""

    concurrency = 8  # several loads may wait at the gate at once

    def __init__(self, config: GatedConfig, context: BackendContext) -> None:
        self.capacity_mb = config.capacity_mb
        self.gate = threading.Event()
        self.gate.set()
        self.loads_started = threading.Semaphore(0)
        self.store_gate = threading.Event()
        self.store_gate.set()
        self.fail_loads: set[ObjectKey] = set()  # keys whose load scribbles and reports failure
        self.fail_stores: set[ObjectKey] = set()
        self._data: dict[ObjectKey, bytes] = {}
        self._lock = threading.Lock()

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self.store_gate.wait()
        done = []
        with self._lock:
            for key, payload in zip(keys, payloads, strict=True):
                if key in self.fail_stores:
                    done.append(False)
                    continue
                self._data[key] = bytes(payload)
                done.append(True)
        return done

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        with self._lock:
            return [len(self._data[key]) if key in self._data else None for key in keys]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        gate = self.gate  # the gate of the moment the load started, whatever a test swaps in later
        self.loads_started.release()
        gate.wait()
        done = []
        with self._lock:
            for key, buffer in zip(keys, buffers, strict=True):
                data = self._data.get(key)
                if key in self.fail_loads:
                    # A failing load may leave anything in its buffer, like a half transfer.
                    buffer[:] = b"\xbd" * buffer.nbytes
                if data is None or len(data) != buffer.nbytes or key in self.fail_loads:
                    done.append(False)
                    continue
                buffer[:] = data
                done.append(True)
        return done

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self._lock:
            return [self._data.pop(key, None) is not None for key in keys]

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self._lock:
            return [(key, len(data)) for key, data in self._data.items()]

    def capacity(self) -> int | None:
        return None if self.capacity_mb is None else int(self.capacity_mb * MiB)


class GatedNowBackend(GatedBackend):
    """``gated`` whose index also answers on the caller's thread (``contains_many_now``)."""

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> list[Any]:
        return self.contains_many(keys)


class RecordsBackend(GatedBackend):
    """``gated`` holding core's records (header, then payload) as persistent backends do:
    loads read the header back through ``read_record_header``."""

    def __init__(self, config: GatedConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.context = context

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        records = [
            self.context.record_header(key, payload) + bytes(payload)
            for key, payload in zip(keys, payloads, strict=True)
        ]
        return super().put_many(keys, [memoryview(record) for record in records])

    def _payload(self, key: ObjectKey) -> memoryview | None:
        data = self._data.get(key)
        if data is None:
            return None
        header = self.context.read_record_header(data, key)
        return None if header is None else memoryview(data)[header.header_len :]

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[Any]:
        with self._lock:
            payloads = [self._payload(key) for key in keys]
        return [None if payload is None else payload.nbytes for payload in payloads]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        done = []
        with self._lock:
            for key, buffer in zip(keys, buffers, strict=True):
                payload = self._payload(key)
                if payload is None or payload.nbytes != buffer.nbytes:
                    done.append(False)
                    continue
                buffer[:] = payload
                done.append(True)
        return done

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self._lock:
            found = [(key, self._payload(key)) for key in list(self._data)]
        return [(key, payload.nbytes) for key, payload in found if payload is not None]


def gated_backend(storage: StorageManager, index: int = 0) -> GatedBackend:
    """The ``gated`` backend behind adapter ``index`` of a storage manager."""
    adapter = storage.adapters[index]
    assert isinstance(adapter, BackendAdapter) and isinstance(adapter.backend, GatedBackend)
    return adapter.backend


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("gated", GatedBackend, GatedConfig)
    registry.add("gated_now", GatedNowBackend, GatedConfig)
    registry.add("records", RecordsBackend, GatedConfig)


class RecordingSerde:
    """Size-preserving serde that remembers the context of every object it encodes."""

    name = "recording"
    seen: ClassVar[list[SerdeContext]] = []

    def __init__(self, config: object) -> None:
        pass

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        RecordingSerde.seen.append(context)
        return bytes(data)

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        return data


@hookimpl
def tiers_register_serdes(registry: KindRegistry) -> None:
    registry.add("recording", RecordingSerde)


class LyingPrefetchPolicy:
    """Plans every key from adapter 0, found or not: the controller must not trust it."""

    retain_loaded = False

    def __init__(self, config: object) -> None:
        pass

    def select_load_plan(self, keys: Sequence[ObjectKey], found: Any, adapters: Any) -> dict[int, list[bool]]:
        return {0: [True] * len(keys), 7: [True] * len(keys)}


class RaisingPrefetchPolicy(LyingPrefetchPolicy):
    def select_load_plan(self, keys: Sequence[ObjectKey], found: Any, adapters: Any) -> dict[int, list[bool]]:
        raise RuntimeError("policy bug")


@hookimpl
def tiers_register_prefetch_policies(registry: KindRegistry) -> None:
    registry.add("lying", LyingPrefetchPolicy)
    registry.add("raising", RaisingPrefetchPolicy)


class GatedStorePolicy:
    """Every key to every adapter, but ``select_store_targets`` waits at ``gate`` (open by
    default): committed objects stay queued, unlocked and unstored, for as long as a test
    needs.  ``skip`` keys are sent nowhere (not meant for L2)."""

    gate = threading.Event()
    entered = threading.Semaphore(0)
    skip: ClassVar[set[ObjectKey]] = set()

    def __init__(self, config: object) -> None:
        GatedStorePolicy.gate.set()
        GatedStorePolicy.entered = threading.Semaphore(0)
        GatedStorePolicy.skip.clear()

    def select_store_targets(self, keys: Sequence[ObjectKey], adapters: Any) -> dict[int, list[ObjectKey]]:
        GatedStorePolicy.entered.release()
        GatedStorePolicy.gate.wait()
        wanted = [key for key in keys if key not in GatedStorePolicy.skip]
        return {adapter.index: wanted for adapter in adapters} if wanted else {}

    def select_l1_deletions(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        return []


@hookimpl
def tiers_register_store_policies(registry: KindRegistry) -> None:
    registry.add("gated", GatedStorePolicy)


def registry() -> ComponentRegistry:
    """The installed plugins plus the ``gated`` test adapter."""
    return plugins_with(
        "engine-test-adapters",
        tiers_register_l2_adapters=tiers_register_l2_adapters,
        tiers_register_prefetch_policies=tiers_register_prefetch_policies,
        tiers_register_serdes=tiers_register_serdes,
        tiers_register_store_policies=tiers_register_store_policies,
    ).registry


def spec(raw: dict[str, Any], index: int = 0) -> AdapterSpec:
    """An adapter spec from its ``--l2-adapter`` JSON form (as an operator writes it)."""
    return decode_adapter(registry(), raw, index)


def mock(**options: Any) -> AdapterSpec:
    return spec({"type": "mock", **options})


def make_storage(
    adapters: Sequence[AdapterSpec] = (), *, l1_gb: float = L1_GB, **settings: Any
) -> StorageManager:
    config = ServerConfig(l1_size_gb=l1_gb, l2_adapters=tuple(adapters), **settings)
    return StorageManager(config, registry())


def keys_of(prompt: int, count: int, *, model: str = "engine-test") -> list[ObjectKey]:
    """Keys of one prompt's first ``count`` chunks (prompt id makes them distinct)."""
    return [
        ObjectKey(model, 0, prompt.to_bytes(4, "big") + index.to_bytes(4, "big")) for index in range(count)
    ]


def payload(key: ObjectKey, size: int) -> bytes:
    """Deterministic bytes per key, so a hit can be checked against what was stored."""
    seed = key.chunk_hash * (size // len(key.chunk_hash) + 1)
    return seed[:size]


def store(storage: StorageManager, keys: Sequence[ObjectKey], size: int) -> list[ObjectKey]:
    """Reserve, fill and commit; returns the keys actually written (new ones)."""
    reserved = storage.reserve_write(keys, [size] * len(keys))
    for key, obj in reserved.items():
        storage.view(obj)[:] = payload(key, size)
    storage.commit_write(list(reserved))
    return list(reserved)


def store_in_l2_only(storage: StorageManager, keys: Sequence[ObjectKey], size: int) -> None:
    """Store ``keys``, wait for their L2 stores, and drop them from L1: the next lookup of
    them goes to L2."""
    store(storage, keys, size)
    assert storage.flush(10)
    storage.clear()


def parked_prefetch(storage: StorageManager, keys: Sequence[ObjectKey], size: int) -> int:
    """With a ``gated`` adapter first: ``keys`` stored in L2 only, and a prefetch of them
    whose load is parked at the gate (looked up, pinned, L1 reserved); its handle."""
    backend = gated_backend(storage)
    store_in_l2_only(storage, keys, size)
    backend.gate.clear()
    handle = storage.submit_prefetch(keys)
    assert backend.loads_started.acquire(timeout=10)
    return handle


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``condition`` came to hold within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True
