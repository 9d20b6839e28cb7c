"""Shared helpers of the NIXL plugin tests: scratch directories, configs, adapters."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from lmcache_plugin_nixl.config import NixlStoreConfig, NixlStoreDynamicConfig
from lmcache_plugin_nixl.dynamic import NixlDynamicBackend
from lmcache_plugin_nixl.store import NixlStoreBackend

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, L2Adapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.serde import Serde
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.files import AlignedArena


@contextmanager
def scratch_dir() -> Iterator[str]:
    """A directory removed with everything in it when the block ends."""
    path = tempfile.mkdtemp(prefix="lmcache-nixl-test-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def pool_config(
    directory: str, pool_size: int = 8, *, direct_io: bool = False, **extra: Any
) -> NixlStoreConfig:
    raw = {
        "backend": "POSIX",
        "backend_params": {"file_path": directory, "use_direct_io": "true" if direct_io else "false"},
        "pool_size": pool_size,
        **extra,
    }
    return msgspec.convert(raw, NixlStoreConfig)


def dynamic_config(
    directory: str,
    *,
    capacity_gb: float = 1.0,
    shard_dirs: bool = False,
    direct_io: bool = False,
    persist_enabled: bool = True,
) -> NixlStoreDynamicConfig:
    raw = {
        "backend": "POSIX",
        "backend_params": {
            "file_path": directory,
            "use_direct_io": "true" if direct_io else "false",
            "max_capacity_gb": repr(capacity_gb),
            "shard_dirs": "true" if shard_dirs else "false",
        },
        "persist_enabled": persist_enabled,
    }
    return msgspec.convert(raw, NixlStoreDynamicConfig)


def context(config: Any, arena: memoryview | None, serde: tuple[Serde, ...] = ()) -> AdapterContext:
    return AdapterContext(index=0, name="0:nixl-test", config=config, serde=serde, l1_buffer=arena)


def _open(factory: Any, config: Any, facts: AdapterContext) -> BackendAdapter:
    adapter = create_adapter(factory, config, facts)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def open_pool(config: NixlStoreConfig, arena: memoryview | None = None) -> BackendAdapter:
    return _open(NixlStoreBackend, config, context(config, arena))


def open_dynamic(
    config: NixlStoreDynamicConfig, arena: memoryview | None = None, serde: tuple[Serde, ...] = ()
) -> BackendAdapter:
    return _open(NixlDynamicBackend, config, context(config, arena, serde))


def client(adapter: Any) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


Arena = AlignedArena


def lru_eviction_controller(adapter: L2Adapter, watermark: float, ratio: float) -> L2EvictionController:
    """The real per-adapter L2 eviction controller with the installed LRU policy.

    Tests call its ``evict`` directly (one cycle) instead of starting its thread.
    """
    config = L2EvictionConfig(eviction_policy="LRU", trigger_watermark=watermark, eviction_ratio=ratio)
    component = load_registry().get(Kind.EVICTION_POLICY, "LRU")
    policy = component.create(component.config())
    return L2EvictionController(AdapterSlot(0, "nixl", adapter), policy, config, EngineStats(1))
