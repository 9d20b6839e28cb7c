"""A persistent adapter's capacity, held across restarts: a check file adapters share.

Each run opens the adapter over the same storage, waits for its start-up scan, stores
more than the whole capacity (in batches, running one cycle of core's L2 eviction
controller after each when eviction is configured), and closes it.  A persistent adapter
that forgot at start what an earlier run left would let the directory grow by a capacity
per run; :func:`fill_across_restarts` reports what each run left so a test can assert it
never exceeds the capacity.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_tiers.config import L2EvictionConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2_support import make_keys, pattern

__all__ = ["RunReport", "fill_across_restarts"]


@dataclass
class RunReport:
    """What one run saw and left."""

    scanned_bytes: int  # accounted by the start-up scan (what earlier runs left)
    stored: int  # stores that succeeded in this run
    refused: int  # stores that failed (capacity, scan, space)
    used_bytes: int  # accounted when the run closed the adapter
    on_disk: int  # payload bytes the storage holds after the run (measured by the caller)
    last_keys_found: int  # of this run's last batch, found by a lookup before closing


def _eviction_controller(adapter: L2Adapter, config: L2EvictionConfig) -> object:
    from lmcache_tiers.controllers.base import AdapterSlot
    from lmcache_tiers.controllers.l2_eviction import L2EvictionController
    from lmcache_tiers.controllers.stats import EngineStats
    from lmcache_tiers.plugins import load_registry
    from lmcache_tiers.registry import Kind

    component = load_registry().get(Kind.EVICTION_POLICY, config.eviction_policy)
    policy = component.create(component.config())
    return L2EvictionController(AdapterSlot(0, "restarts", adapter), policy, config, EngineStats(1))


def fill_across_restarts(
    open_adapter: Callable[[], L2Adapter],
    measure_disk: Callable[[], int],
    *,
    capacity: int,
    object_size: int,
    runs: int = 3,
    eviction: L2EvictionConfig | None = None,
    batch: int = 4,
    timeout_s: float = 60.0,
) -> list[RunReport]:
    """Store 1.5 capacities per run, ``runs`` times, reopening the adapter each time."""
    per_run = -(-capacity * 3 // 2 // object_size)
    block = mmap.mmap(-1, -(-object_size * batch // 4096) * 4096)
    arena = memoryview(block)
    reports: list[RunReport] = []
    for run in range(runs):
        adapter = open_adapter()
        try:
            deadline = time.monotonic() + timeout_s
            while adapter.stats().get("scan_running", 0):
                if time.monotonic() > deadline:
                    raise AssertionError("the start-up scan never finished")
                time.sleep(0.01)
            scanned = adapter.stats().get("scan_bytes", 0)
            controller = _eviction_controller(adapter, eviction) if eviction is not None else None
            client = BlockingAdapterClient(adapter, timeout=timeout_s)
            stored = refused = 0
            keys: list[ObjectKey] = []
            for start in range(0, per_run, batch):
                keys = make_keys(min(batch, per_run - start), start=run * 100_000 + start, model="restarts")
                views = []
                for slot, key in enumerate(keys):
                    view = arena[slot * object_size : (slot + 1) * object_size]
                    view[:] = pattern(hash(key) & 0xFFFF, object_size)
                    views.append(view)
                results = client.store(keys, views)
                stored += sum(results)
                refused += len(results) - sum(results)
                if controller is not None:
                    controller.step(set())  # type: ignore[attr-defined]
            found = client.lookup_and_lock(keys).found
            adapter.unlock([key for key, hit in zip(keys, found, strict=True) if hit])
            used = adapter.used_bytes()
        finally:
            adapter.close()
        reports.append(RunReport(scanned, stored, refused, used, measure_disk(), sum(found)))
    return reports
