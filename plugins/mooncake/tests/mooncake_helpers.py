"""Adapters and raw Mooncake clients on a test cluster."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from lmcache_plugin_mooncake import MooncakeStoreConfig
from lmcache_plugin_mooncake.backend import MooncakeStoreBackend
from lmcache_plugin_mooncake.cluster import LocalCluster

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, create_adapter
from lmcache_tiers.protocols import Serde
from lmcache_tiers.serde import SerdeContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern


def config_for(cluster: LocalCluster, **fields: Any) -> MooncakeStoreConfig:
    """An adapter config on ``cluster`` under a prefix of its own (fields override)."""
    settings = cluster.adapter(key_prefix=f"test-{uuid.uuid4().hex[:12]}/", operation_timeout_s=2.0)
    settings.pop("type")
    settings.update(fields)
    return MooncakeStoreConfig(**settings)


def open_adapter(
    config: MooncakeStoreConfig,
    serde: tuple[Serde, ...] = (),
    name: str = "0:mooncake_store",
    l1_buffer: memoryview | None = None,
) -> BackendAdapter:
    """An adapter on ``config``; ``l1_buffer``: its L1 arena (registered with its client)."""
    context = AdapterContext(index=0, name=name, config=config, serde=serde, l1_buffer=l1_buffer)
    adapter = create_adapter(MooncakeStoreBackend, config, context)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def backend_of(adapter: BackendAdapter) -> MooncakeStoreBackend:
    """The adapter's backend, behind core's circuit breaker when it is on."""
    backend = getattr(adapter.backend, "inner", adapter.backend)
    assert isinstance(backend, MooncakeStoreBackend)
    return backend


def raw_client(cluster: LocalCluster) -> Any:
    """A plain Mooncake client on the cluster: another party writing into the pool."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        "127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "", cluster.master_server_address
    )
    assert code == 0, f"raw client set-up returned {code}"
    return store


def eventually(check: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout}s"
        time.sleep(0.05)


class Xor:
    """A size-preserving serde: with any chain configured, a lookup of a key the adapter
    does not know (after reopening) reads the record header for the L1 size."""

    name = "test-xor"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return (np.frombuffer(data, dtype=np.uint8) ^ 0x5A).tobytes()

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return (np.frombuffer(data, dtype=np.uint8) ^ 0x5A).tobytes()


def arena_buffers(arena: memoryview, part: int, count: int, size: int) -> list[memoryview]:
    """Part ``part`` of an L1 arena as ``count`` buffers of ``size`` bytes, one per key
    (part 0: the payloads ``stored_from_arena`` stores)."""
    base = part * count * size
    return [arena[base + i * size : base + (i + 1) * size] for i in range(count)]


def stored_from_arena(
    adapter: BackendAdapter, arena: memoryview, count: int, size: int
) -> tuple[list[ObjectKey], list[bytes]]:
    """``count`` records of ``size`` bytes stored from part 0 of the adapter's L1 arena
    (registered, so its loads into the arena are ranged reads): their keys and payloads."""
    keys = make_keys(count)
    data = [pattern(i, size) for i in range(count)]
    for source, payload in zip(arena_buffers(arena, 0, count, size), data, strict=True):
        source[:] = payload
    assert BlockingAdapterClient(adapter).store(keys, arena_buffers(arena, 0, count, size)) == [True] * count
    assert backend_of(adapter).connection.l1_registered, "loads into L1 are ranged reads"
    return keys, data
