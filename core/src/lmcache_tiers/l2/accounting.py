"""Byte accounting of an adapter: per key, in total and per ``cache_salt``."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import NamedTuple

from lmcache_tiers.keys import ObjectKey


class ObjectSize(NamedTuple):
    """Sizes of one stored object.

    ``stored`` is what the backend holds (the serde chain's output, what counts against
    capacity); ``l1`` is the decoded size a load needs in L1.  They differ only with a
    size-changing serde chain.
    """

    stored: int
    l1: int


class ByteAccounting:
    """Sizes of the objects an adapter knows of.

    Keys enter on a successful store, or lazily when a lookup finds a key this process
    never stored (after a restart), or when a persistent adapter reports what its recovery
    scan found; they leave on delete or when a lookup finds them gone.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sizes: dict[ObjectKey, ObjectSize] = {}
        self._total = 0
        self._by_salt: dict[str, int] = {}

    def _add(self, salt: str, delta: int) -> None:
        self._total += delta
        remaining = self._by_salt.get(salt, 0) + delta
        if remaining:
            self._by_salt[salt] = remaining
        else:
            self._by_salt.pop(salt, None)

    def record(self, key: ObjectKey, size: ObjectSize) -> None:
        """Account ``key`` at ``size`` (replacing what it had, e.g. on overwrite)."""
        with self._lock:
            previous = self._sizes.get(key)
            self._sizes[key] = size
            self._add(key.cache_salt, size.stored - (previous.stored if previous else 0))

    def record_many(self, items: Iterable[tuple[ObjectKey, ObjectSize]]) -> None:
        """``record`` for a whole batch under one acquisition of the lock."""
        with self._lock:
            for key, size in items:
                previous = self._sizes.get(key)
                self._sizes[key] = size
                self._add(key.cache_salt, size.stored - (previous.stored if previous else 0))

    def record_if_absent(self, key: ObjectKey, size: ObjectSize) -> bool:
        with self._lock:
            if key in self._sizes:
                return False
            self._sizes[key] = size
            self._add(key.cache_salt, size.stored)
            return True

    def forget(self, key: ObjectKey) -> ObjectSize | None:
        with self._lock:
            previous = self._sizes.pop(key, None)
            if previous is not None:
                self._add(key.cache_salt, -previous.stored)
            return previous

    def get(self, key: ObjectKey) -> ObjectSize | None:
        with self._lock:
            return self._sizes.get(key)

    def get_many(self, keys: Iterable[ObjectKey]) -> list[ObjectSize | None]:
        """``get`` for a whole batch under one acquisition of the lock."""
        with self._lock:
            return [self._sizes.get(key) for key in keys]

    def __len__(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._total

    def by_salt(self) -> dict[str, int]:
        with self._lock:
            return dict(self._by_salt)
