"""Pin counts between lookup and load, and the keys a delete is working on."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from lmcache_tiers.keys import ObjectKey


class PinTable:
    """Which keys are pinned (counted) and which are being deleted right now.

    A key being deleted cannot be pinned (a lookup racing with the delete reports a miss)
    and a pinned key cannot start being deleted; the two checks share one lock, so the
    backend never removes bytes a lookup has promised to a load.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pins: Counter[ObjectKey] = Counter()
        self._deleting: set[ObjectKey] = set()

    def pin(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Pin each key once unless it is being deleted; True where pinned."""
        pinned: list[bool] = []
        with self._lock:
            for key in keys:
                if key in self._deleting:
                    pinned.append(False)
                else:
                    self._pins[key] += 1
                    pinned.append(True)
        return pinned

    def unpin(self, keys: Sequence[ObjectKey]) -> int:
        """Drop one pin per occurrence; returns how many pins were actually held."""
        dropped = 0
        with self._lock:
            for key in keys:
                count = self._pins.get(key, 0)
                if count <= 0:
                    continue
                dropped += 1
                if count == 1:
                    del self._pins[key]
                else:
                    self._pins[key] = count - 1
        return dropped

    def begin_delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Claim keys for deletion; False for pinned keys and repeats within the batch."""
        claimed: list[bool] = []
        with self._lock:
            for key in keys:
                if self._pins.get(key, 0) > 0 or key in self._deleting:
                    claimed.append(False)
                else:
                    self._deleting.add(key)
                    claimed.append(True)
        return claimed

    def end_delete(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self._deleting.difference_update(keys)

    def count(self, key: ObjectKey) -> int:
        with self._lock:
            return self._pins.get(key, 0)

    def pinned(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self._lock:
            return [self._pins.get(key, 0) > 0 for key in keys]

    def snapshot(self) -> dict[ObjectKey, int]:
        with self._lock:
            return dict(self._pins)

    def clear(self) -> None:
        with self._lock:
            self._pins.clear()
