"""The in-memory adapter behind the ``mock`` type."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

from lmcache_plugin_mock import MockConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BatchL2Adapter


class _Objects:
    """One namespace's objects and the bytes they take."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[ObjectKey, bytes] = {}
        self.used = 0


_NAMESPACES: dict[str, _Objects] = {}
_NAMESPACES_LOCK = threading.Lock()


def _objects_for(namespace: str | None) -> _Objects:
    if namespace is None:
        return _Objects()
    with _NAMESPACES_LOCK:
        return _NAMESPACES.setdefault(namespace, _Objects())


class MockAdapter(BatchL2Adapter):
    """Keeps payloads as ``bytes`` in a dict; capacity, bandwidth and latency as configured."""

    needs_l1_buffers = False

    def __init__(self, config: MockConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self.mock_config = config
        self._objects = _objects_for(config.namespace)
        self._capacity = int(config.max_size_gb * (1 << 30))

    def _simulate(self, nbytes: int) -> bool:
        """Spend the simulated time of a call moving ``nbytes``; False if closed meanwhile."""
        seconds = self.mock_config.latency_s
        if self.mock_config.bandwidth_bytes_per_s:
            seconds += nbytes / self.mock_config.bandwidth_bytes_per_s
        return self.sleep_unless_closed(seconds)

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        if not self._simulate(sum(p.nbytes for p in payloads)):
            return [False] * len(keys)
        objects = self._objects
        ok: list[bool] = []
        with objects.lock:
            for key, payload in zip(keys, payloads, strict=True):
                previous = len(objects.data.get(key, b""))
                if objects.used - previous + payload.nbytes > self._capacity:
                    ok.append(False)
                    continue
                objects.data[key] = bytes(payload)
                objects.used += payload.nbytes - previous
                ok.append(True)
        return ok

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | None]:
        self._simulate(0)
        with self._objects.lock:
            found = [self._objects.data.get(key) for key in keys]
        return [None if data is None else len(data) for data in found]

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        with self._objects.lock:
            found = [self._objects.data.get(key) for key in keys]
        if not self._simulate(sum(len(data) for data in found if data is not None)):
            return [False] * len(keys)
        ok: list[bool] = []
        for data, buffer in zip(found, buffers, strict=True):
            if data is None or len(data) != buffer.nbytes:
                ok.append(False)
                continue
            buffer[:] = data
            ok.append(True)
        return ok

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        self._simulate(0)
        objects = self._objects
        ok: list[bool] = []
        with objects.lock:
            for key in keys:
                data = objects.data.pop(key, None)
                if data is not None:
                    objects.used -= len(data)
                ok.append(data is not None)
        return ok

    def iter_keys(self) -> Iterator[ObjectKey]:
        with self._objects.lock:
            keys = list(self._objects.data)
        return iter(keys)

    def capacity_bytes(self) -> int:
        return self._capacity

    def close_backend(self) -> None:
        if self.mock_config.namespace is None:
            with self._objects.lock:
                self._objects.data.clear()
                self._objects.used = 0
