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

Only the server's loop thread changes these objects.  Other threads (``/metrics`` and
``/status`` scrapes) read the gauges through :meth:`SessionTable.gauges`, which changes
nothing.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any, NamedTuple

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


#: unindexed lock records a session keeps before indexing them per key: bounds both the
#: memory they take and the one indexing pass a request may have to make first
INDEX_BACKLOG_KEYS = 4096


@dataclass
class Session:
    """What one client currently holds.

    Read locks are counted per key (a key locked by a LOOKUP and then by a RETRIEVE holds
    two), with one deadline per key, the latest lock's: L1 also keeps one deadline per
    object and extends it with each new lock.

    Taking locks is on the path of every LOOKUP and RETRIEVE, reading them back only on
    RELEASE, the sweep and shutdown; so each call of :meth:`add_read_locks` leaves one
    record (the keys, the deadline, how many times in a row those very keys were locked),
    and the per-key counts and deadlines (``read_locks``, ``lock_deadlines``) are brought
    up to date from the records, in the order they were taken, whenever they are read.
    The result is exactly what updating them on every call would give; a client that
    locks the same prefix again and again (an engine asking about a waiting prompt every
    step) costs one list comparison per lookup instead of two dict updates per key.  A
    RELEASE of exactly the keys of the one record there is (lookup, retrieve, release)
    takes that record back whole, indexing nothing.
    """

    identity: bytes
    last_seen: float
    _counts: Counter[ObjectKey] = field(default_factory=Counter, repr=False)
    _deadlines: dict[ObjectKey, float] = field(default_factory=dict, repr=False)
    # [keys, deadline, times] per call not yet indexed, oldest first
    _records: list[list[Any]] = field(default_factory=list, repr=False)
    _backlog: int = field(default=0, repr=False)  # keys in ``_records``
    writes: dict[ObjectKey, tuple[float, int]] = field(default_factory=dict)  # key -> (deadline, size)
    prefetches: dict[int, PendingPrefetch] = field(default_factory=dict)

    @property
    def read_locks(self) -> Counter[ObjectKey]:
        """Locks held per key (do not change it: use the methods)."""
        if self._records:
            self._index()
        return self._counts

    @property
    def lock_deadlines(self) -> dict[ObjectKey, float]:
        """Each held key's deadline, its latest lock's (do not change it)."""
        if self._records:
            self._index()
        return self._deadlines

    def add_read_locks(self, keys: list[ObjectKey], deadline: float) -> None:
        """One more read lock on each of ``keys`` (a key listed twice: two), all expiring at
        ``deadline``.  ``keys`` is kept as it is: the caller must not change it afterwards."""
        if not keys:
            return
        records = self._records
        if records:
            last = records[-1]
            # The same keys as the call before (compared by identity first, in C): the
            # same update again, so one more time of that record, with the new deadline.
            if last[0] == keys:
                last[1] = deadline
                last[2] += 1
                return
        records.append([keys, deadline, 1])
        self._backlog += len(keys)
        if self._backlog > INDEX_BACKLOG_KEYS:
            self._index()

    def _index(self) -> None:
        """Apply the records to the per-key counts and deadlines, oldest first."""
        counts, deadlines = self._counts, self._deadlines
        for keys, deadline, times in self._records:
            # Both updates run in C (pairs from zip and repeat cost less than building a
            # dict to merge).
            if times == 1:
                counts.update(keys)
            else:
                counts.update({key: held * times for key, held in Counter(keys).items()})
            deadlines.update(zip(keys, repeat(deadline)))
        self._records.clear()
        self._backlog = 0

    def take_read_locks(self, keys: Iterable[ObjectKey], now: float) -> dict[int, list[ObjectKey]]:
        """Forget the locks held on ``keys``; returns the live ones grouped by lock count,
        ready for ``StorageManager.release(keys, count)``."""
        wanted = keys if isinstance(keys, list) else list(keys)
        records = self._records
        if len(records) == 1 and not self._counts:
            held, deadline, times = records[0]
            # The usual release: the very keys of the one lock record (a LOOKUP, maybe a
            # RETRIEVE of the same keys after it), each once -- what indexing the record
            # and taking it back key by key would give, without either.
            if held == wanted and len(set(wanted)) == len(wanted):
                records.clear()
                self._backlog = 0
                return {times: wanted} if deadline > now else {}
        locks, deadlines = self.read_locks, self.lock_deadlines
        # Both dicts hold exactly the same keys, so popping each key from both (in C, a
        # second mention of a key getting 0 and no deadline) forgets what the loop below
        # would, whatever it finds.
        counts = list(map(locks.pop, wanted, repeat(0)))
        ends = list(map(deadlines.pop, wanted, repeat(0.0)))
        if wanted and min(ends) > now and counts.count(counts[0]) == len(counts):
            # Every key held, none expired, each locked as often: one group.
            return {counts[0]: wanted}
        by_count: dict[int, list[ObjectKey]] = defaultdict(list)
        for key, count, end in zip(wanted, counts, ends, strict=True):
            if count and end > now:
                by_count[count].append(key)
        return by_count

    def take_one_read_lock(self, keys: Iterable[ObjectKey], now: float) -> list[ObjectKey]:
        """Forget one of the locks held on each of ``keys`` (each key once, as L1 locked
        it); returns the keys whose lock was live, ready for ``StorageManager.release``."""
        locks, deadlines = self.read_locks, self.lock_deadlines
        taken: list[ObjectKey] = []
        for key in dict.fromkeys(keys):
            held = locks.get(key, 0)
            if not held:
                continue
            if deadlines[key] <= now:
                # Reaped by L1 (every lock of a key shares its deadline): forgotten only.
                del locks[key], deadlines[key]
                continue
            if held == 1:
                del locks[key], deadlines[key]
            else:
                locks[key] = held - 1
            taken.append(key)
        return taken

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

    def live_locked_keys(self, now: float) -> set[ObjectKey]:
        """The keys holding an unexpired lock; changes nothing, so any thread may ask.

        Each copy is one C call, which the loop thread cannot interleave.  The records are
        copied before the per-key deadlines: a record the loop indexes in between then shows
        up in both copies rather than in neither."""
        records = list(self._records)
        deadlines = dict(self._deadlines)
        live = {key for key, deadline in deadlines.items() if deadline > now}
        for keys, deadline, _times in records:
            if deadline > now:
                live.update(keys)
        return live

    def live_writes(self, now: float) -> int:
        """How many reservations are unexpired; changes nothing, so any thread may ask."""
        return sum(1 for deadline, _size in list(self.writes.values()) if deadline > now)

    @property
    def empty(self) -> bool:
        return not (self._records or self._counts or self.writes or self.prefetches)

    def expire(self, now: float) -> None:
        locks, deadlines = self.read_locks, self.lock_deadlines
        for key in [key for key, deadline in deadlines.items() if deadline <= now]:
            del deadlines[key]
            del locks[key]
        self.writes = {key: held for key, held in self.writes.items() if held[0] > now}


#: sessions holding nothing kept for the ``clients`` gauge ("seen recently"); beyond it the
#: least recently seen are forgotten at once, which bounds what peers that keep coming
#: back under new identities can make the server remember
MAX_EMPTY_SESSIONS = 1024


class Gauges(NamedTuple):
    """What the clients hold right now, for ``/metrics`` and ``/status``."""

    clients: int  # sessions: clients holding something or seen recently
    locked_keys: int
    reserved_stores: int
    pending_prefetches: int


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

    def existing(self, identity: bytes, now: float | None = None) -> Session | None:
        """The client's session if it has one, marked as seen; none is made: identities
        are the peers' choice, so only taking something may cost the server a session."""
        session = self._sessions.get(identity)
        if session is not None:
            session.last_seen = time.monotonic() if now is None else now
        return session

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
        """Forget expired records, idle sessions holding nothing, and the least recently
        seen of those holding nothing beyond :data:`MAX_EMPTY_SESSIONS`."""
        empty: list[Session] = []
        for identity, session in list(self._sessions.items()):
            session.expire(now)
            if not session.empty:
                continue
            if now - session.last_seen > self.idle_s:
                del self._sessions[identity]
            else:
                empty.append(session)
        self._forget_beyond(empty, MAX_EMPTY_SESSIONS)

    def _forget_beyond(self, empty: list[Session], keep: int) -> None:
        # A peer picks its identity (one per connection): without a bound, one that keeps
        # reconnecting under new ones would grow the table, and every sweep, for idle_s.
        if len(empty) <= keep:
            return
        empty.sort(key=lambda session: session.last_seen)
        for session in empty[: len(empty) - keep]:
            del self._sessions[session.identity]

    def gauges(self, now: float) -> Gauges:
        """Count what the clients hold; changes nothing, so a scrape may ask from its own
        thread while the loop thread serves (``list()`` of the table is one C call)."""
        sessions = list(self._sessions.values())
        return Gauges(
            clients=len(sessions),
            locked_keys=sum(len(session.live_locked_keys(now)) for session in sessions),
            reserved_stores=sum(session.live_writes(now) for session in sessions),
            pending_prefetches=sum(len(session.prefetches) for session in sessions),
        )
