"""The ``template_memory`` adapter: plain batch I/O on a dict.

``BatchL2Adapter`` runs these methods on worker threads and does the rest (task ids,
eventfds, pinning between lookup and load, lock-aware delete, byte accounting, serde,
listeners).  Methods of different operations may run concurrently, hence the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from lmcache_plugin_template import TemplateMemoryConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BatchL2Adapter


class TemplateMemoryAdapter(BatchL2Adapter):
    needs_l1_buffers = False  # copies bytes; works with any buffer

    def __init__(self, config: TemplateMemoryConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self._capacity = int(config.max_size_gb * (1 << 30))
        self._objects: dict[ObjectKey, bytes] = {}
        self._used = 0
        self._lock = threading.Lock()

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        results = []
        with self._lock:
            for key, payload in zip(keys, payloads, strict=True):
                previous = len(self._objects.get(key, b""))
                fits = self._used - previous + payload.nbytes <= self._capacity
                if fits:
                    self._objects[key] = bytes(payload)
                    self._used += payload.nbytes - previous
                results.append(fits)
        return results

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        with self._lock:
            return [len(self._objects[k]) if k in self._objects else None for k in keys]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        results = []
        with self._lock:
            for key, buffer in zip(keys, buffers, strict=True):
                data = self._objects.get(key)
                ok = data is not None and len(data) == buffer.nbytes
                if ok:
                    buffer[:] = data
                results.append(ok)
        return results

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self._lock:
            removed = [self._objects.pop(key, None) for key in keys]
            self._used -= sum(len(data) for data in removed if data is not None)
        return [data is not None for data in removed]

    def iter_keys(self) -> Iterator[ObjectKey]:
        with self._lock:
            return iter(list(self._objects))

    def capacity_bytes(self) -> int | None:
        return self._capacity
