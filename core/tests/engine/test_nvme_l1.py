"""The engine on an NVMe L1: stores and loads copy through host buffers; adapters that
need L1 memory are refused at start-up."""

from __future__ import annotations

import gc
import logging
import time
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_support import GatedBackend, GatedConfig, keys_of, mock, payload, registry

from lmcache_tiers.config import AdapterSpec, ServerConfig
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.hookspecs import hookimpl
from lmcache_tiers.l2 import BackendContext
from lmcache_tiers.plugins import discover
from lmcache_tiers.registry import ComponentRegistry, KindRegistry
from lmcache_tiers.storage import StorageManager

# Not page multiples, so every copy has a ragged last block.
SIZES = [1, 4095, 64 * 1024 + 3]

closed_adapters: list[str] = []
#: what the next close of a NeedsL1MemoryBackend raises (a failed last flush), if anything
close_failures: list[Exception] = []


class NeedsL1MemoryBackend(GatedBackend):
    """Stands for a backend that registers the L1 arena once and addresses it by offset."""

    needs_l1_buffers = True

    def __init__(self, config: GatedConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.name = context.name

    def close(self) -> None:
        closed_adapters.append(self.name)
        if close_failures:
            raise close_failures.pop()


def build_needs_l1_memory(config: GatedConfig, context: BackendContext) -> NeedsL1MemoryBackend:
    return NeedsL1MemoryBackend(config, context)


@hookimpl
def tiers_register_l2_adapters(registry: KindRegistry) -> None:
    registry.add("needs_l1_memory", NeedsL1MemoryBackend, GatedConfig)
    # A factory function: the class is known only once the adapter exists.
    registry.add("needs_l1_memory_factory", build_needs_l1_memory, GatedConfig)


@pytest.fixture(scope="module")
def test_registry() -> ComponentRegistry:
    module = types.ModuleType("nvme_test_adapters")
    module.tiers_register_l2_adapters = tiers_register_l2_adapters  # type: ignore[attr-defined]
    return discover(extra_plugins={"nvme-test-adapters": module}).registry


@pytest.fixture
def nvme_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    if list(tmp_path.iterdir()):  # a full collection costs seconds in a worker with a big heap
        gc.collect()
    assert list(tmp_path.iterdir()) == [], "the NVMe L1 file outlived its storage manager"


def nvme_storage(
    nvme_dir: Path, adapters: list[AdapterSpec], reg: ComponentRegistry | None = None
) -> StorageManager:
    config = ServerConfig(l1_size_gb=16 / 1024, l2_adapters=tuple(adapters), gds_l1_path=str(nvme_dir))
    return StorageManager(config, reg if reg is not None else registry())


def needs_memory(type_name: str) -> AdapterSpec:
    return AdapterSpec(type=type_name, config=GatedConfig())  # type: ignore[arg-type]


def test_store_and_load_round_trip_through_the_nvme_l1(nvme_dir: Path) -> None:
    with nvme_storage(nvme_dir, [mock()]) as storage:
        assert not storage.l1.is_memory
        assert storage.l1.nvme_file_path is not None
        assert Path(storage.l1.nvme_file_path).parent == nvme_dir
        keys = keys_of(1, len(SIZES))
        reserved = storage.reserve_write(keys, SIZES)
        for key, obj in reserved.items():
            storage.write_object(obj, memoryview(payload(key, obj.size)))
        storage.commit_write(keys)
        assert storage.flush(10)
        assert storage.status()["adapters"][0]["keys_stored"] == len(keys)

        # From L1 (NVMe) directly.
        for obj in storage.read(keys):
            out = bytearray(obj.size)
            storage.read_object(obj, memoryview(out))
            assert out == payload(obj.key, obj.size)
        storage.release(keys)

        # Gone from L1: the prefetch loads from L2 into host buffers, then into the file.
        assert storage.clear() == len(keys)
        # Overwrite the freed blocks, so stale bytes in the file cannot pass for a load.
        scratch = keys_of(2, len(SIZES))
        for obj in storage.reserve_write(scratch, SIZES).values():
            storage.write_object(obj, memoryview(b"\xee" * obj.size))
        storage.abort_write(scratch)
        handle = storage.submit_prefetch(keys)
        assert storage.wait_prefetch(handle, 10) == len(keys)
        assert storage.status()["adapters"][0]["keys_loaded"] == len(keys)
        for key, size in zip(keys, SIZES, strict=True):
            obj = storage.l1.get(key)
            assert obj is not None and obj.size == size
            out = bytearray(size)
            storage.read_object(obj, memoryview(out))
            assert out == payload(key, size)
        storage.release(keys)
        assert len(storage.l1) == 0  # prefetched objects were temporary
        stats = storage.l1.stats()
        assert (stats.write_locked, stats.read_locks) == (0, 0)


@pytest.mark.parametrize("type_name", ["needs_l1_memory", "needs_l1_memory_factory"])
def test_an_adapter_needing_l1_memory_is_refused(
    nvme_dir: Path, test_registry: ComponentRegistry, type_name: str
) -> None:
    closed_adapters.clear()
    with pytest.raises(ConfigError) as raised:
        nvme_storage(nvme_dir, [mock(), needs_memory(type_name)], test_registry)
    assert str(raised.value) == (
        f"l2 adapter 1:{type_name} needs byte access to L1 memory and cannot be used with --gds-l1-path"
    )
    # An adapter built before the refusal is closed again.
    assert closed_adapters == ([] if type_name == "needs_l1_memory" else [f"1:{type_name}"])


def test_a_refused_adapter_whose_close_fails_still_refuses_with_the_configuration_error(
    nvme_dir: Path, test_registry: ComponentRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    """The start's own error is the one raised: a close of the refused adapter that fails
    on top is logged, not raised in its place (the user must read what to change)."""
    closed_adapters.clear()
    close_failures[:] = [OSError(5, "Input/output error")]
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(ConfigError) as raised:
            nvme_storage(nvme_dir, [mock(), needs_memory("needs_l1_memory_factory")], test_registry)
    finally:
        close_failures.clear()
    assert "cannot be used with --gds-l1-path" in str(raised.value)
    assert closed_adapters == ["1:needs_l1_memory_factory"]
    assert "Input/output error" in caplog.text


def test_the_same_adapter_is_fine_with_a_memory_l1(test_registry: ComponentRegistry) -> None:
    config = ServerConfig(l1_size_gb=16 / 1024, l2_adapters=(needs_memory("needs_l1_memory"),))
    with StorageManager(config, test_registry) as storage:
        assert storage.l1.is_memory
        assert storage.adapters[0].needs_l1_buffers


def test_a_load_whose_object_left_the_nvme_l1_meanwhile_is_lost_not_failed(nvme_dir: Path) -> None:
    with nvme_storage(nvme_dir, [AdapterSpec(type="gated", config=GatedConfig())]) as storage:
        keys = keys_of(1, 2)
        reserved = storage.reserve_write(keys, [4096] * len(keys))
        for key, obj in reserved.items():
            storage.write_object(obj, memoryview(payload(key, obj.size)))
        storage.commit_write(keys)
        assert storage.flush(10)
        storage.clear()
        backend = storage.adapters[0].backend
        backend.gate.clear()
        handle = storage.submit_prefetch(keys)
        assert backend.loads_started.acquire(timeout=10)
        # The load reservations expire while the load runs: the adapter's load succeeds,
        # the objects it was loaded for are gone from L1 by the time it reports.
        assert storage.l1.expire_locks(now=time.monotonic() + storage.l1.write_ttl_s + 1) == 2
        backend.gate.set()
        assert storage.wait_prefetch(handle, 10) == 0
        failures = storage.status()["failures"]
        assert failures.get("prefetch_loaded_object_lost") == 2
        assert "l2_load_failed" not in failures, "the adapter's loads succeeded"
        assert storage.status()["adapters"][0]["keys_load_failed"] == 0
        assert storage.l1.stats().write_locked == 0
