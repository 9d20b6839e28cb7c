"""Per-client bookkeeping of the locks and reservations a client holds in L1.

The server remembers, per ZeroMQ peer identity, every read lock it took on a client's
behalf (from a LOOKUP's prefetch or a RETRIEVE), every write reservation not yet committed,
and every prefetch whose result the client has not collected -- with the locks that
prefetch took, which the client does not know about until it collects the result.  That is what lets RELEASE
drop exactly the locks the caller owns (a client can never release another client's
locks), lets COMMIT touch only the caller's reservations, and lets a shutdown give back
everything still held.

A client that vanishes is not detectable over ROUTER/DEALER, so L1's lock TTLs reclaim
its memory; records here carry the same deadlines, and an expired record is forgotten
without being released, because L1 has already reaped (or will reap) that lock and a late
release could otherwise drop a lock someone else took since.

Only the server's loop thread touches these objects.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat

from lmcache_tiers.plugin import ObjectKey


@dataclass
class PendingPrefetch:
    """A LOOKUP whose result the client has not collected.

    ``hits`` is None while the prefetch runs.  Once it is known, ``locked`` holds the
    leading keys the prefetch read-locked for the client: they are this record's, not yet
    the session's, until the client collects the result (QUERY/WAIT), releases those keys,
    or ``deadline`` (the result TTL) passes and they are given back.
    """

    keys: list[ObjectKey]
    started: float  # when the LOOKUP arrived
    deadline: float
    hits: int | None = None
    locked: list[ObjectKey] = field(default_factory=list)

    def settle(self, hits: int) -> None:
        self.hits = max(0, min(hits, len(self.keys)))
        self.locked = self.keys[: self.hits]


@dataclass
class Session:
    """What one client currently holds.

    Read locks are counted per key (a key locked by a LOOKUP and then by a RETRIEVE holds
    two), with one deadline per key, the latest lock's: L1 also keeps one deadline per
    object and extends it with each new lock.
    """

    identity: bytes
    last_seen: float
    read_locks: Counter[ObjectKey] = field(default_factory=Counter)
    lock_deadlines: dict[ObjectKey, float] = field(default_factory=dict)
    writes: dict[ObjectKey, tuple[float, int]] = field(default_factory=dict)  # key -> (deadline, size)
    prefetches: dict[int, PendingPrefetch] = field(default_factory=dict)

    def add_read_locks(self, keys: Sequence[ObjectKey], deadline: float) -> None:
        # Both updates run in C: this is on the path of every LOOKUP and RETRIEVE (pairs
        # from zip and repeat cost less than building a dict to merge).
        self.read_locks.update(keys)
        self.lock_deadlines.update(zip(keys, repeat(deadline)))

    def take_read_locks(self, keys: Iterable[ObjectKey], now: float) -> dict[int, list[ObjectKey]]:
        """Forget the locks held on ``keys``; returns the live ones grouped by lock count,
        ready for ``StorageManager.release(keys, count)``."""
        by_count: dict[int, list[ObjectKey]] = defaultdict(list)
        locks, deadlines = self.read_locks, self.lock_deadlines
        for key in keys:
            count = locks.pop(key, 0)
            if count and deadlines.pop(key) > now:
                by_count[count].append(key)
        return by_count

    def take_prefetch_locks(self, keys: Iterable[ObjectKey]) -> dict[int, list[ObjectKey]]:
        """Take the locks finished, uncollected prefetches hold on ``keys``, grouped by how
        many such prefetches held each key (for ``StorageManager.release(keys, count)``).
        Their hit counts stay for the client to collect."""
        wanted = set(keys)
        held: Counter[ObjectKey] = Counter()
        for pending in self.prefetches.values():
            if pending.locked and not wanted.isdisjoint(pending.locked):
                held.update(key for key in pending.locked if key in wanted)
                pending.locked = [key for key in pending.locked if key not in wanted]
        by_count: dict[int, list[ObjectKey]] = defaultdict(list)
        for key, count in held.items():
            by_count[count].append(key)
        return by_count

    def add_writes(self, sizes: dict[ObjectKey, int], deadline: float) -> None:
        for key, size in sizes.items():
            self.writes[key] = (deadline, size)

    def take_writes(self, keys: Sequence[ObjectKey], now: float) -> tuple[dict[ObjectKey, int], list[bool]]:
        """The caller's live reservations among ``keys`` with their sizes (forgotten here),
        and a per-key flag."""
        mine: dict[ObjectKey, int] = {}
        flags: list[bool] = []
        for key in keys:
            deadline, size = self.writes.pop(key, (0.0, 0))
            live = deadline > now
            flags.append(live)
            if live:
                mine[key] = size
        return mine, flags

    @property
    def empty(self) -> bool:
        return not (self.read_locks or self.writes or self.prefetches)

    def expire(self, now: float) -> None:
        for key in [key for key, deadline in self.lock_deadlines.items() if deadline <= now]:
            del self.lock_deadlines[key]
            del self.read_locks[key]
        self.writes = {key: held for key, held in self.writes.items() if held[0] > now}


class SessionTable:
    """Sessions by peer identity, with TTL-based forgetting."""

    def __init__(self, lock_ttl_s: float, write_ttl_s: float, idle_s: float = 60.0) -> None:
        self.lock_ttl_s = lock_ttl_s
        self.write_ttl_s = write_ttl_s
        self.idle_s = idle_s
        self._sessions: dict[bytes, Session] = {}

    def get(self, identity: bytes, now: float | None = None) -> Session:
        now = time.monotonic() if now is None else now
        session = self._sessions.get(identity)
        if session is None:
            session = self._sessions[identity] = Session(identity, now)
        else:
            session.last_seen = now
        return session

    def peek(self, identity: bytes) -> Session | None:
        return self._sessions.get(identity)

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def result_ttl_s(self) -> float:
        """How long a finished prefetch waits for its client: half the lock TTL, so the
        locks it gives back at expiry are still its own (L1 has not reaped them)."""
        return self.lock_ttl_s / 2

    def read_lock_deadline(self, now: float) -> float:
        return now + self.lock_ttl_s

    def write_deadline(self, now: float) -> float:
        return now + self.write_ttl_s

    def sweep(self, now: float) -> None:
        """Forget expired records and idle sessions holding nothing."""
        for identity, session in list(self._sessions.items()):
            session.expire(now)
            if session.empty and now - session.last_seen > self.idle_s:
                del self._sessions[identity]

    def totals(self) -> tuple[int, int, int]:
        """(read-locked keys, reserved keys, pending prefetches) over all clients."""
        locks = sum(len(s.read_locks) for s in self._sessions.values())
        writes = sum(len(s.writes) for s in self._sessions.values())
        prefetches = sum(len(s.prefetches) for s in self._sessions.values())
        return locks, writes, prefetches
