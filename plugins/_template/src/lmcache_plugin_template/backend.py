"""The ``template`` backend: plain batch I/O on a dict of this process.

Core wraps it in the adapter the controllers use and does the rest: worker threads,
task ids, pins between lookup and load, lock-aware delete, byte accounting and capacity
refusals, the serde chain, listeners.  Methods of different operations run at the same
time (a thread per operation kind), hence the lock.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from lmcache_plugin_template import TemplateConfig
from lmcache_tiers.plugin import BackendContext, ObjectKey, copy_into


class TemplateBackend:
    def __init__(self, config: TemplateConfig, context: BackendContext) -> None:
        self.capacity_bytes = int(config.max_size_gb * (1 << 30))
        self.objects: dict[ObjectKey, bytes] = {}
        self.lock = threading.Lock()

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            for key, payload in zip(keys, payloads, strict=True):
                self.objects[key] = bytes(payload)
        return [True] * len(keys)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        with self.lock:
            return [len(self.objects[key]) if key in self.objects else None for key in keys]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        with self.lock:
            found = [self.objects.get(key) for key in keys]
        loaded = []
        for data, buffer in zip(found, buffers, strict=True):
            if data is None or len(data) != buffer.nbytes:
                loaded.append(False)
                continue
            copy_into(buffer, data)  # copies large objects without holding the GIL
            loaded.append(True)
        return loaded

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self.lock:
            return [self.objects.pop(key, None) is not None for key in keys]

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self.lock:
            return [(key, len(data)) for key, data in self.objects.items()]

    def capacity(self) -> int:
        return self.capacity_bytes
