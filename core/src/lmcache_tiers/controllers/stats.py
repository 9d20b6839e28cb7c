"""Counters the controllers bump and the server's metrics and ``/status`` read.

Plain monotonically increasing integers under one lock: cheap enough for every request,
and a snapshot is consistent across counters.  Gauges (in-flight work, usage) are not kept
here; they are read from their owners when a snapshot is taken.
"""

from __future__ import annotations

import threading
from collections import defaultdict

#: per-adapter counter names, in the order ``status()`` lists them
ADAPTER_COUNTERS = (
    "store_tasks_submitted",
    "store_tasks_completed",
    "store_tasks_failed",  # tasks with at least one key not stored, or refused at submit
    "keys_stored",
    "keys_store_failed",
    "lookups",
    "keys_found",
    "load_tasks_submitted",
    "keys_loaded",
    "keys_load_failed",
    "keys_evicted",
)


class EngineStats:
    """Counters of the storage engine: global ones, per adapter, and failures by reason."""

    def __init__(self, adapter_count: int) -> None:
        self._lock = threading.Lock()
        self._global: dict[str, int] = defaultdict(int)
        self._adapters: list[dict[str, int]] = [
            dict.fromkeys(ADAPTER_COUNTERS, 0) for _ in range(adapter_count)
        ]
        self._failures: dict[str, int] = defaultdict(int)

    def add(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self._global[name] += amount

    def add_lookup(self, keys: int, l1_hits: int) -> None:
        """Count one lookup of ``keys`` distinct keys, ``l1_hits`` of them L1 hits: what
        every lookup adds, under one lock acquisition and without a call's keyword dict."""
        with self._lock:
            counts = self._global
            counts["lookups"] += 1
            counts["lookup_keys"] += keys
            counts["l1_hit_chunks"] += l1_hits

    def add_adapter(self, index: int, name: str, amount: int = 1) -> None:
        with self._lock:
            self._adapters[index][name] += amount

    def fail(self, reason: str, amount: int = 1) -> None:
        """Count a failure; ``reason`` is a short stable label such as ``l2_load_failed``."""
        with self._lock:
            self._failures[reason] += amount

    def get(self, name: str) -> int:
        with self._lock:
            return self._global.get(name, 0)

    def adapter(self, index: int) -> dict[str, int]:
        with self._lock:
            return dict(self._adapters[index])

    def failures(self) -> dict[str, int]:
        with self._lock:
            return dict(self._failures)

    def snapshot(self) -> tuple[dict[str, int], list[dict[str, int]], dict[str, int]]:
        with self._lock:
            return dict(self._global), [dict(a) for a in self._adapters], dict(self._failures)
