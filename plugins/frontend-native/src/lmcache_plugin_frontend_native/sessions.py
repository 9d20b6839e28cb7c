"""Per-client bookkeeping of the locks and reservations a client holds in L1.

The server remembers, per ZeroMQ peer identity, every read lock it took on a client's
behalf (from a LOOKUP's prefetch or a RETRIEVE), every write reservation not yet committed,
and every prefetch whose result the client has not collected -- with the locks that
prefetch took, which the client does not know about until it collects the result.  That is what lets RELEASE
drop exactly the locks the caller owns (a client can never release another client's
locks), lets COMMIT touch only the caller's reservations, and lets a shutdown give back
everything still held.

A client that vanishes is not detectable over ROUTER/DEALER, so L1's lock TTLs reclaim
its memory.  L1 keeps each lock's own deadline, and so does the session, never later than
L1's (computed with L1's ``lock_deadline`` from a time read before L1 takes the lock): an
expired lock is forgotten without being released, because L1 has already reaped (or will
reap) it and a late release could otherwise drop a lock someone else took since.  A
release tells L1 the earliest deadline of the locks it drops (``not_before``), so that L1
drops locks of this client's and not one a vanished client left behind, which then goes at
its own deadline.  Deadlines are on L1's grid (a 64th of the lock TTL), so locks are kept
as counts per deadline: a client that locks the same keys again and again without
releasing them costs at most one count per key and grid step still live, not an entry per
lock.

Only the server's loop thread changes these objects.  Other threads (``/metrics`` and
``/status`` scrapes) read the gauges through :meth:`SessionTable.gauges`, which changes
nothing and reads counts the loop thread keeps as locks and reservations come and go,
never the locks and reservations themselves.
"""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import filterfalse, repeat
from typing import Any, NamedTuple

from lmcache_tiers.plugin import ObjectKey

logger = logging.getLogger(__name__)


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


#: the locks a session holds on one key: ``{deadline: locks}``, or for exactly one lock
#: its deadline alone (a float the keys of a record share: no dict per key)
_Held = dict[float, int] | float

#: what a key holding no lock gives up (never changed)
_NOTHING: dict[float, int] = {}

#: unindexed lock records a session keeps before indexing them per key: bounds both the
#: memory they take and the one indexing pass a request may have to make first
INDEX_BACKLOG_KEYS = 4096


@dataclass
class Session:
    """What one client currently holds.

    Read locks are kept per key, each with its own deadline (a key locked by a LOOKUP and
    then by a RETRIEVE holds two), as L1 keeps them: L1 reaps each at its deadline, so a
    count that outlived one of them would make a later RELEASE drop someone else's lock.
    They are counted per deadline (``{deadline: locks}``): deadlines are on L1's grid, so a
    key keeps a few counts however many times it is locked.  A key holding exactly one lock
    (what a LOOKUP leaves, the usual case) keeps its deadline alone, a float shared by the
    keys of its record, not a dict of its own: ``lock_deadlines`` shows it as
    ``{deadline: 1}``.

    Taking locks is on the path of every LOOKUP and RETRIEVE, reading them back only on
    RELEASE, the sweep and shutdown; so each call of :meth:`add_read_locks` leaves one
    record (the keys, and how many times those very keys were locked in a row per
    deadline), and the per-key deadlines (``lock_deadlines``) are brought up to date from the
    records whenever they are read.  The result is exactly what updating them on every
    call would give; a client that locks the same prefix again and again (an engine
    asking about a waiting prompt every step) costs one list comparison per lookup
    instead of an update per key.  A RELEASE of exactly the keys of the one record there
    is (lookup, retrieve, release) takes that record back whole, indexing nothing.
    """

    identity: bytes
    last_seen: float
    # key -> {deadline: locks expiring then}, or the deadline alone for one lock (see _Held)
    _locks: dict[ObjectKey, _Held] = field(default_factory=dict, repr=False)
    # [keys, {deadline: calls}] per run of calls with the same keys not yet indexed, oldest first
    _records: list[list[Any]] = field(default_factory=list, repr=False)
    _backlog: int = field(default=0, repr=False)  # keys in ``_records``
    # the keys of ``_records`` that ``_locks`` does not hold: what indexing them will add
    _unindexed: set[ObjectKey] = field(default_factory=set, repr=False)
    # ``_records`` is one record of keys known distinct, held alone, whose set
    # ``_unindexed`` is not made of until another record or a partial release needs it
    _lone_distinct: bool = field(default=False, repr=False)
    #: keys holding a lock not yet forgotten (expired ones until the sweep forgets them),
    #: kept as locks come and go so that a scrape reads one int instead of walking them
    locked_keys: int = 0
    # key -> (deadline, the L1 object reserved for it), in order of deadline (see add_writes)
    writes: dict[ObjectKey, tuple[float, Any]] = field(default_factory=dict)
    #: reservations that expired uncommitted, whose L1 extents stay fenced until this
    #: client's commit or abort of the key says it stopped copying (``Handlers``); at most
    #: one per key: a key with one is not reserved for this client again meanwhile
    fenced: dict[ObjectKey, Any] = field(default_factory=dict)
    #: the extent bytes of ``fenced``, kept as extents are fenced and given back
    fenced_bytes: int = 0
    #: the socket inode of the connection whose STORE_RESERVEs ``writes`` and ``fenced``
    #: hold (0: not known): a routing identity is the peer's choice, and another connection
    #: naming it once that one dropped must not commit what it never copied
    writer_connection: int = 0
    #: the watches (``PeerWatch``, None: not known) of the processes that reserved under
    #: this identity since it last held no reservation: its fences are lifted once all of
    #: them have exited (``writers.py``)
    writers: list[Any] = field(default_factory=list)
    prefetches: dict[int, PendingPrefetch] = field(default_factory=dict)
    # No lock held here expires before this: the sweep passes over a client's locks only
    # once one of them may have expired, not every time it runs.
    _next_lock_expiry: float = field(default=math.inf, repr=False)
    # deadline -> the indexed keys holding a lock expiring then (a release takes a key out;
    # one whose lock a release found expired stays until the sweep), with a heap of those
    # deadlines: the sweep looks at the keys whose locks expired, not at every key held.
    _expiring: dict[float, set[ObjectKey]] = field(default_factory=dict, repr=False)
    _expiry_heap: list[float] = field(default_factory=list, repr=False)
    # Whether ``writes`` was given a deadline earlier than one it held (never by the
    # handlers, whose deadlines follow the clock): the sweep then sorts it once.
    _writes_unordered: bool = field(default=False, repr=False)
    # every client's fenced bytes together, which this session's fences add to (None: a
    # session outside a table)
    _all_fenced: FencedBytes | None = field(default=None, repr=False)

    @property
    def read_locks(self) -> Counter[ObjectKey]:
        """Locks held per key, expired ones the sweep has not forgotten yet included (a
        copy: use the methods to change them)."""
        return Counter({key: _count(held) for key, held in self._indexed().items()})

    @property
    def lock_deadlines(self) -> dict[ObjectKey, dict[float, int]]:
        """Each held key's locks per deadline (a copy, but do not change the dicts in it)."""
        return {key: _per_deadline(held) for key, held in self._indexed().items()}

    def _indexed(self) -> dict[ObjectKey, _Held]:
        """The per-key locks, the records applied to them first."""
        if self._records:
            self._index()
        return self._locks

    def add_read_locks(self, keys: list[ObjectKey], deadline: float, *, distinct: bool = False) -> None:
        """One more read lock on each of ``keys`` (a key listed twice: two), all expiring at
        ``deadline``.  ``keys`` is kept as it is: the caller must not change it afterwards.
        ``distinct``: the caller knows no key is listed twice (a lookup's L1 prefix ends
        before its first repeat), which spares a session holding nothing a pass over them."""
        if not keys:
            return
        if deadline < self._next_lock_expiry:
            self._next_lock_expiry = deadline
        records = self._records
        if records:
            last = records[-1]
            # The same keys as the call before (compared by identity first, in C): one more
            # lock on each, with its own deadline -- an expired one stays expired.
            if last[0] == keys:
                counts = last[1]
                counts[deadline] = counts.get(deadline, 0) + 1
                return
            self._unlone()
        elif distinct and not self._locks:
            # Held alone, its keys are what the client holds, and a RELEASE of exactly them
            # takes the record back whole: no set of them is needed unless more come.
            records.append([keys, {deadline: 1}])
            self._backlog = len(keys)
            self._lone_distinct = True
            self.locked_keys = len(keys)
            if self._backlog > INDEX_BACKLOG_KEYS:
                self._index()
            return
        records.append([keys, {deadline: 1}])
        self._backlog += len(keys)
        self._note_unindexed(keys)
        if self._backlog > INDEX_BACKLOG_KEYS:
            self._index()

    def _unlone(self) -> None:
        """Make ``_unindexed`` of the lone distinct record's keys, which another record is
        about to join."""
        if self._lone_distinct:
            self._lone_distinct = False
            self._unindexed = set(self._records[0][0])

    def _index(self) -> None:
        """Apply the records to the per-key deadlines.

        Records of the same counts (one lock at one grid deadline, mostly) are applied
        together: their keys are counted in C first, so a key that several of them name (a
        client looking up prefixes that overlap) is visited once per pass in Python, not
        once per record.  Locks add up, so the order does not matter."""
        groups: dict[tuple[tuple[float, int], ...], list[list[ObjectKey]]] = defaultdict(list)
        for keys, counts in self._records:
            groups[tuple(counts.items())].append(keys)
        for items, lists in groups.items():
            self._apply(lists, items)
        self._records.clear()
        self._backlog = 0
        self._unindexed.clear()
        self._lone_distinct = False

    def _apply(self, lists: list[list[ObjectKey]], items: tuple[tuple[float, int], ...]) -> None:
        """Add the locks of records of the same ``items`` (deadline, locks) to the per-key
        locks, and file their keys under those deadlines."""
        locks = self._locks
        times = Counter[ObjectKey]()
        for keys in lists:
            times.update(keys)  # counted in C
        self._note_expiring(times, items)
        one_lock = items[0][0] if len(items) == 1 and items[0][1] == 1 else None
        if len(times) == sum(map(len, lists)) and locks.keys().isdisjoint(times):
            # New keys, each named once (the usual case), in C: one lock each shares its
            # deadline; more get a copy of the counts each.
            shared: Iterable[_Held] = repeat(one_lock) if one_lock is not None else map(dict, repeat(items))
            locks.update(zip(times, shared, strict=False))
            return
        if len(items) == 1:
            # One deadline (the usual case): a key's locks become a count more there.
            _add_at_one_deadline(locks, times, *items[0])
            return
        for key, named in times.items():
            held = locks.get(key)
            if held is None:
                held = locks[key] = {}
            elif not isinstance(held, dict):
                held = locks[key] = {held: 1}
            for deadline, count in items:
                held[deadline] = held.get(deadline, 0) + count * named

    def _note_expiring(self, keys: Iterable[ObjectKey], items: tuple[tuple[float, int], ...]) -> None:
        """File ``keys`` under each deadline of ``items`` (one, usually), for the sweep."""
        expiring = self._expiring
        for deadline, _count in items:
            bucket = expiring.get(deadline)
            if bucket is None:
                bucket = expiring[deadline] = set()
                heapq.heappush(self._expiry_heap, deadline)
            bucket.update(keys)

    def _unfile(self, keys: list[ObjectKey], deadline: float) -> None:
        """``keys`` hold no lock expiring at ``deadline`` any more (released)."""
        bucket = self._expiring.get(deadline)
        if bucket:
            bucket.difference_update(keys)

    def _note_unindexed(self, keys: list[ObjectKey]) -> None:
        """Count the keys of a new record held nowhere yet, in C: a session holding nothing
        (a lookup after the last release) takes the record's set as it is, which a release
        of exactly those keys then reads to tell whether each is named once."""
        # Each key of the record is looked up in what is held, never the other way round
        # (``set.difference_update`` walks its argument): a client holding many locks
        # does not make each of its lookups walk them all.
        locks = self._locks
        fresh = set(filterfalse(locks.__contains__, keys)) if locks else set(keys)
        if self._unindexed:
            fresh = fresh.difference(self._unindexed)  # walks the smaller of the two
            self._unindexed |= fresh
        else:
            self._unindexed = fresh
        self._count_locked_keys()

    def _count_locked_keys(self) -> None:
        """Bring ``locked_keys`` up to date after locks were added or forgotten: one store
        of an int, which a scrape on another thread reads whole."""
        self.locked_keys = len(self._locks) + len(self._unindexed)

    def take_read_locks(
        self, keys: Iterable[ObjectKey], now: float
    ) -> dict[tuple[int, float], list[ObjectKey]]:
        """Forget the locks held on ``keys``; returns the live ones grouped by how many each
        key holds and the earliest of their deadlines, ready for
        ``L1Manager.finish_read(keys, count, not_before=deadline)``."""
        wanted = keys if isinstance(keys, list) else list(keys)
        records = self._records
        if len(records) == 1 and not self._locks:
            held, counts = records[0]
            # The usual release: the very keys of the one lock record (a LOOKUP, maybe a
            # RETRIEVE of the same keys after it), each once -- what indexing the record
            # and taking it back key by key would give, without either.  The record's keys
            # are all of ``_unindexed``: they are distinct if there are as many.
            if held == wanted and (self._lone_distinct or len(self._unindexed) == len(wanted)):
                records.clear()
                self._backlog = 0
                self._unindexed = set()
                self._lone_distinct = False
                self._count_locked_keys()
                live = _live(counts, now)
                return {live: wanted} if live[0] else {}
        locks = self._indexed()
        # A second mention of a key finds nothing left: it is released once.
        helds = list(map(locks.pop, wanted, repeat(_NOTHING)))
        self._count_locked_keys()
        if helds and len(_deadlines(helds[0])) == 1 and helds.count(helds[0]) == len(helds):
            # Every key held alike, each named once (the usual case: what one LOOKUP took):
            # one group, the per-key deadlines compared in C.
            self._unfile(wanted, next(iter(_deadlines(helds[0]))))
            live = _live(helds[0], now)
            return {live: wanted} if live[0] else {}
        groups: dict[tuple[int, float], list[ObjectKey]] = defaultdict(list)
        for key, held in zip(wanted, helds, strict=True):
            for deadline in _deadlines(held):
                self._unfile([key], deadline)
            live = _live(held, now)
            if live[0]:
                groups[live].append(key)
        return groups

    def take_one_read_lock(self, keys: Iterable[ObjectKey], now: float) -> dict[float, list[ObjectKey]]:
        """Forget one of the locks held on each of ``keys`` (each key once, as L1 locked
        it), the live one expiring first; returns the keys whose lock was live grouped by
        that deadline, ready for ``L1Manager.finish_read(keys, not_before=deadline)``."""
        locks = self._indexed()
        taken: dict[float, list[ObjectKey]] = defaultdict(list)
        for key in dict.fromkeys(keys):
            held = locks.get(key)
            if held is None:
                continue
            if not isinstance(held, dict):  # one lock
                del locks[key]
                if held > now:
                    taken[held].append(key)
                    self._unfile([key], held)
                continue
            _forget_expired(held, now)
            if not held:
                del locks[key]  # every lock of it reaped by L1: forgotten only
                continue
            first = min(held)
            taken[first].append(key)
            if held[first] > 1:
                held[first] -= 1
            else:
                del held[first]
                self._unfile([key], first)
                if not held:
                    del locks[key]
        self._count_locked_keys()
        return taken

    def take_read_lock_at(self, keys: Iterable[ObjectKey], deadline: float) -> list[ObjectKey]:
        """Forget one lock expiring at exactly ``deadline`` on each of ``keys`` (each key
        once); returns the keys that held one.  For the locks a reply handed over that
        could not be sent: those very locks, not the client's others on the same keys."""
        locks = self._indexed()
        taken: list[ObjectKey] = []
        for key in dict.fromkeys(keys):
            held = locks.get(key)
            if held is None:
                continue
            if not isinstance(held, dict):  # one lock
                if held != deadline:
                    continue
                del locks[key]
            elif deadline in held:
                if held[deadline] > 1:
                    held[deadline] -= 1
                    taken.append(key)
                    continue
                del held[deadline]
                if not held:
                    del locks[key]
            else:
                continue
            taken.append(key)
            self._unfile([key], deadline)
        self._count_locked_keys()
        return taken

    def take_reserved(self, reserved: Mapping[ObjectKey, Any]) -> dict[ObjectKey, Any]:
        """Forget the reservations among ``reserved`` this session still holds, each only
        while it holds that very L1 object for its key; returns them."""
        writes = self.writes
        taken: dict[ObjectKey, Any] = {}
        for key, obj in reserved.items():
            write = writes.get(key)
            if write is not None and write[1] is obj:
                del writes[key]
                taken[key] = obj
        return taken

    def take_prefetch_locks(
        self, keys: Iterable[ObjectKey], deadline_of: Callable[[float], float]
    ) -> dict[tuple[int, float], list[ObjectKey]]:
        """Take the locks finished, uncollected prefetches hold on ``keys``, grouped by how
        many such prefetches held each key and the earliest of their deadlines (a
        prefetch locks after its LOOKUP arrived: its locks expire no earlier than
        ``deadline_of(started)``, ``SessionTable.prefetch_lock_deadline``), for
        ``L1Manager.finish_read(keys, count, not_before=deadline)``.  Their hit counts stay
        for the client to collect."""
        wanted = set(keys)
        held: Counter[ObjectKey] = Counter()
        earliest: dict[ObjectKey, float] = {}
        for pending in self.prefetches.values():
            if pending.locked and not wanted.isdisjoint(pending.locked):
                deadline = deadline_of(pending.started)
                for key in pending.locked:
                    if key in wanted:
                        held[key] += 1
                        earliest[key] = min(earliest.get(key, deadline), deadline)
                pending.locked = [key for key in pending.locked if key not in wanted]
        groups: dict[tuple[int, float], list[ObjectKey]] = defaultdict(list)
        for key, count in held.items():
            groups[count, earliest[key]].append(key)
        return groups

    def add_writes(self, reserved: Mapping[ObjectKey, Any], deadline: float) -> None:
        """Reservations the client is filling: the L1 object reserved for each key.

        Kept in order of deadline, so that the sweep forgets the expired ones from the
        front and stops at the first live one: a client holding many reservations does
        not make every sweep walk them all on the loop thread, which serves every client."""
        writes = self.writes
        if writes and deadline < writes[next(reversed(writes))][0]:
            self._writes_unordered = True
        for key, obj in reserved.items():
            writes.pop(key, None)  # a key reserved again goes to the back, with its new deadline
            writes[key] = (deadline, obj)

    def take_writes(self, keys: Sequence[ObjectKey], now: float) -> tuple[dict[ObjectKey, Any], list[bool]]:
        """The caller's live reservations among ``keys`` with their L1 objects (forgotten
        here), and a per-key flag."""
        mine: dict[ObjectKey, Any] = {}
        flags: list[bool] = []
        for key in keys:
            deadline, obj = self.writes.pop(key, (0.0, None))
            live = deadline > now
            flags.append(live)
            if live:
                mine[key] = obj
            elif obj is not None:
                self._fence(key, obj)
        return mine, flags

    def _fence(self, key: ObjectKey, obj: Any) -> None:
        earlier = self.fenced.get(key)  # never (a fenced key is not reserved again): no drift
        self.fenced[key] = obj
        self._count_fenced(obj.extent_bytes - (earlier.extent_bytes if earlier is not None else 0))

    def _count_fenced(self, nbytes: int) -> None:
        before = self.fenced_bytes
        self.fenced_bytes = before + nbytes
        if self._all_fenced is not None:
            self._all_fenced.changed(self, before, self.fenced_bytes)

    def take_fenced(self, keys: Iterable[ObjectKey]) -> list[Any]:
        """The expired reservations among ``keys`` (forgotten here): the client committed
        or aborted them, so it no longer copies into their extents."""
        fenced = self.fenced
        if not fenced:
            return []
        taken = [obj for key in keys if (obj := fenced.pop(key, None)) is not None]
        if taken:
            self._count_fenced(-sum(obj.extent_bytes for obj in taken))
        return taken

    def expired_reservation_of(self, keys: Iterable[ObjectKey], now: float) -> ObjectKey | None:
        """A key among ``keys`` whose reservation by this client expired uncommitted (its
        copy may still be under way), or None."""
        writes, fenced = self.writes, self.fenced
        # ``writes`` is in deadline order: when its first is live, none has expired, and a
        # client with nothing fenced (the usual case) pays no look-up per key.
        any_expired = bool(writes) and next(iter(writes.values()))[0] <= now
        if not (fenced or any_expired):
            return None
        for key in keys:
            if key in fenced:
                return key
            write = writes.get(key) if any_expired else None
            if write is not None and write[0] <= now:
                return key
        return None

    def fence_replaced(self, reserved: Mapping[ObjectKey, Any]) -> list[ObjectKey]:
        """Fence this client's reservations of the keys L1 just reserved anew (``reserved``),
        and return those keys.  L1 reserves a key anew only once no reservation holds it, so
        one still held here was reaped by L1 before its deadline here passed (read a moment
        before L1 took it): its extent is fenced, and only a commit or abort naming it, or
        its writer's exit, gives that back -- put in the new one's place, it was forgotten."""
        writes = self.writes
        if not writes or writes.keys().isdisjoint(reserved):  # the usual case, in C
            return []
        replaced = [key for key in reserved if key in writes and writes[key][1] is not reserved[key]]
        for key in replaced:
            self._fence(key, writes.pop(key)[1])
        return replaced

    @property
    def reserved_stores(self) -> int:
        """Reservations held, expired ones until the sweep forgets them; one C call, so any
        thread may ask."""
        return len(self.writes)

    @property
    def empty(self) -> bool:
        return not (self._records or self._locks or self.writes or self.prefetches or self.fenced)

    def expire(self, now: float) -> int:
        """Forget the locks and reservations expired at ``now``, looking at those only
        (the keys filed under the lock deadlines that passed, the reservations at the front
        of ``writes``), never at every lock and reservation still live; returns how many
        reservations (keys) were forgotten, never committed nor aborted."""
        if self._next_lock_expiry <= now:
            self._expire_locks(now)
        return self._expire_writes(now)

    def _expire_locks(self, now: float) -> None:
        """Forget the locks of the keys filed under the deadlines that passed."""
        locks = self._indexed()  # indexed: every lock is filed under its deadline
        heap, expiring = self._expiry_heap, self._expiring
        while heap and heap[0] <= now:
            for key in expiring.pop(heapq.heappop(heap)):
                held = locks.get(key)
                if held is None:
                    continue
                if not isinstance(held, dict):  # one lock
                    if held <= now:  # else filed here by a lock since forgotten unfiled
                        del locks[key]
                    continue
                _forget_expired(held, now)
                if not held:
                    del locks[key]
        self._next_lock_expiry = heap[0] if heap else math.inf
        self._count_locked_keys()

    def _expire_writes(self, now: float) -> int:
        writes = self.writes
        if self._writes_unordered:
            self.writes = writes = dict(sorted(writes.items(), key=lambda item: item[1][0]))
            self._writes_unordered = False
        expired = []
        for key, (deadline, _obj) in writes.items():
            if deadline > now:
                break
            expired.append(key)
        for key in expired:
            self._fence(key, writes.pop(key)[1])
        return len(expired)


def _add_at_one_deadline(
    locks: dict[ObjectKey, _Held], times: Mapping[ObjectKey, int], deadline: float, count: int
) -> None:
    """``count`` more locks at ``deadline`` per time each key of ``times`` is named."""
    for key, named in times.items():
        held = locks.get(key)
        added = count * named
        if held is None:
            locks[key] = deadline if added == 1 else {deadline: added}
        elif type(held) is dict:
            held[deadline] = held.get(deadline, 0) + added
        elif held == deadline:
            locks[key] = {deadline: 1 + added}
        else:
            locks[key] = {held: 1, deadline: added}


def _deadlines(held: _Held) -> Collection[float]:
    """The deadlines of the locks ``held`` on a key."""
    return held if isinstance(held, dict) else (held,)


def _count(held: _Held) -> int:
    """How many locks ``held`` on a key are."""
    return sum(held.values()) if isinstance(held, dict) else 1


def _per_deadline(held: _Held) -> dict[float, int]:
    """The locks ``held`` on a key per deadline."""
    return held if isinstance(held, dict) else {held: 1}


def _live(held: _Held, now: float) -> tuple[int, float]:
    """(how many of the locks ``held`` per deadline are live at ``now``, the earliest live
    deadline); (0, 0.0) if none is."""
    if not isinstance(held, dict):  # the usual case: one lock
        return (1, held) if held > now else (0, 0.0)
    if len(held) == 1:  # one deadline
        ((deadline, count),) = held.items()
        return (count, deadline) if deadline > now else (0, 0.0)
    live = [deadline for deadline in held if deadline > now]
    return (sum(held[deadline] for deadline in live), min(live)) if live else (0, 0.0)


def _forget_expired(held: dict[float, int], now: float) -> None:
    """Drop the locks ``held`` per deadline whose deadline is ``now`` or earlier."""
    for deadline in [deadline for deadline in held if deadline <= now]:
        del held[deadline]


#: the fenced extents of clients whose exit cannot be seen past 1/this of L1 refuse those
#: clients' new shared-memory stores.  Each client is bounded at 1/8
#: (``handlers.FENCED_SHARE_OF_L1``), and eviction cannot free a fenced extent; a client
#: whose process is watched gives its fences back when it exits, but one the server cannot
#: watch (another pid namespace, another host, a relay) holds them until it commits or
#: aborts, and a stream of such clients under new identities, each stalled under its own
#: bound, would pin all of L1.  A quarter is two clients' bounds, each client counting here
#: only up to its own: one such client stalled never refuses the others, and about three
#: quarters of L1 stay for objects eviction can free.
FENCED_SHARE_OF_L1_ALL_CLIENTS = 4


class FencedBytes:
    """The bytes of every client's fenced extents together (each ``Session.fenced``), and
    the bound of those held by clients whose exit cannot be seen ("unwatched":
    ``WriterProcesses.unwatched``), past which those clients' new shared-memory stores are
    refused.  Watched clients are never refused here: their fences lift when their
    processes exit, and refusing them would protect no byte (a fence is about wrong bytes;
    this bound is about L1 space only).

    Which clients are unwatched is asked only while all clients' fenced bytes together
    reach the bound (rare: stalls past the write TTL), of the sessions holding fences, and
    walked again only once fences changed or a sweep passed (:meth:`watches_changed`):
    watches arm after fences are counted, so it is not kept as they are, and a walk of many
    holders at every store would hold the loop thread up for every client (82 ms a store
    with 16,000 holders here).  A refusal is safe
    (the client's store is a miss; it recomputes), and it lasts until commits, aborts or
    exits give enough back.  Each such episode is logged twice, when it starts and when it
    ends, not once per refused store."""

    def __init__(self, bound: int | None, per_client: int | None = None) -> None:
        #: None: no bound (a table outside a front end)
        self.bound = bound
        #: what one client's fences count here at most (None: all of them): its own bound,
        #: which a client passes by all it held reserved while under it (bounds are checked
        #: against what is fenced, before reserving), so that a client alone, stalled with
        #: large reservations, refuses only its own stores
        self.per_client = per_client
        #: every client's fenced bytes, watched or not, each counted up to ``per_client``:
        #: under ``bound``, no client's can reach it
        self.held = 0
        #: the unwatched clients' part of ``held`` as last walked
        self.unwatched = 0
        # whether ``unwatched`` must be walked again: fences or watches changed since
        self._walk_due = True
        #: stores refused since the bound was reached (0: it was not)
        self.refused = 0
        # the sessions holding fences, by identity: what a count of the unwatched walks
        self._holders: dict[bytes, Session] = {}

    def changed(self, session: Session, before: int, after: int) -> None:
        """``session``'s fenced bytes went from ``before`` to ``after``."""
        if after > 0:
            self._holders[session.identity] = session
        else:
            self._holders.pop(session.identity, None)
        self.held += self._counted(after) - self._counted(before)
        self._walk_due = True

    def watches_changed(self) -> None:
        """Lookups may have ended and writers come and gone since the last walk: the next
        store past ``held``'s bound walks the unwatched again (once per sweep)."""
        self._walk_due = True

    def _counted(self, fenced_bytes: int) -> int:
        cap = self.per_client
        return fenced_bytes if cap is None else min(fenced_bytes, cap)

    def unwatched_held(self, is_unwatched: Callable[[Session], bool]) -> int:
        """The fenced bytes of the clients ``is_unwatched`` names, each counted up to
        ``per_client``."""
        holders = list(self._holders.values())
        return sum(self._counted(session.fenced_bytes) for session in holders if is_unwatched(session))

    def refuses(
        self,
        requester: Session,
        requester_unwatched: Callable[[Session], bool],
        is_unwatched: Callable[[Session], bool],
    ) -> bool:
        """Whether a new store of ``requester`` must be refused now (counted here while it
        is): only while the unwatched clients' fenced bytes reach the bound, and only when
        ``requester_unwatched`` says it is one of them too (asked of its connection now)."""
        bound = self.bound
        if bound is None or self.held < bound:  # the usual case: one comparison
            self._episode_ended()
            return False
        if self._walk_due:
            self.unwatched = self.unwatched_held(is_unwatched)
            self._walk_due = False
        if self.unwatched < bound:
            self._episode_ended()
            return False
        if not requester_unwatched(requester):
            return False  # its fences lift at its exit: it stores in the rest of L1
        if not self.refused:
            logger.warning(
                "clients whose exit cannot be seen hold %d bytes of L1 in expired write reservations "
                "(limit %d), which eviction cannot free until they commit or abort: new STORE_RESERVEs "
                "of such clients are refused until then, those of watched clients are not "
                '(failures_total{reason="store_refused_fenced"})',
                self.unwatched,
                bound,
            )
        self.refused += 1
        return True

    def _episode_ended(self) -> None:
        if self.refused:
            logger.warning(
                "expired write reservations of clients whose exit cannot be seen are back under "
                "%d bytes: new stores are accepted again, %d were refused meanwhile",
                self.bound,
                self.refused,
            )
            self.refused = 0


#: sessions holding nothing kept for the ``clients`` gauge ("seen recently"); beyond it the
#: least recently seen are forgotten at once, which bounds what peers that keep coming
#: back under new identities can make the server remember
MAX_EMPTY_SESSIONS = 1024


class Gauges(NamedTuple):
    """What the clients hold, for ``/metrics`` and ``/status``: as the loop thread last
    left it, so a lock or reservation that expired counts until the next sweep (every
    0.2 s, or a quarter of the result TTL when shorter: ``RpcServer``) forgets it."""

    clients: int  # sessions: clients holding something or seen recently
    locked_keys: int
    reserved_stores: int
    pending_prefetches: int


class SessionTable:
    """Sessions by peer identity, with TTL-based forgetting."""

    def __init__(
        self,
        lock_ttl_s: float,
        write_ttl_s: float,
        idle_s: float = 60.0,
        *,
        lock_deadline: Callable[[float], float] | None = None,
        fenced_bytes_bound: int | None = None,
        fenced_bytes_per_client: int | None = None,
    ) -> None:
        """``lock_deadline`` is L1's (``L1Manager.lock_deadline``); without it a lock taken
        at ``now`` expires at ``now`` plus ``lock_ttl_s``.  ``fenced_bytes_bound``: all
        clients' fenced bytes past which stores are refused, each client's counted up to
        ``fenced_bytes_per_client`` (:class:`FencedBytes`)."""
        self.lock_ttl_s = lock_ttl_s
        self.write_ttl_s = write_ttl_s
        self.idle_s = idle_s
        self._lock_deadline = lock_deadline
        self._sessions: dict[bytes, Session] = {}
        self.fenced = FencedBytes(fenced_bytes_bound, fenced_bytes_per_client)

    def get(self, identity: bytes, now: float | None = None) -> Session:
        now = time.monotonic() if now is None else now
        session = self._sessions.get(identity)
        if session is None:
            session = self._sessions[identity] = Session(identity, now, _all_fenced=self.fenced)
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
        """The deadline of the read locks L1 takes after ``now`` (read before it takes them):
        L1's own rounding, which never gives a later one for an earlier time."""
        if self._lock_deadline is None:
            return now + self.lock_ttl_s
        return self._lock_deadline(now)

    def prefetch_lock_deadline(self, started: float) -> float:
        """A deadline no later than any of the locks a prefetch whose LOOKUP arrived at
        ``started`` takes: it takes them after that, on L1's grid (those it loads from L2
        too, when they become READY)."""
        return self.read_lock_deadline(started)

    def write_deadline(self, now: float) -> float:
        return now + self.write_ttl_s

    def sweep(self, now: float) -> int:
        """Forget expired records, idle sessions holding nothing, and the least recently
        seen of those holding nothing beyond :data:`MAX_EMPTY_SESSIONS`; returns how many
        reservations (keys) expired uncommitted were forgotten, for the caller to count."""
        empty: list[Session] = []
        expired_writes = 0
        for identity, session in list(self._sessions.items()):
            expired_writes += session.expire(now)
            if not session.empty:
                continue
            if now - session.last_seen > self.idle_s:
                del self._sessions[identity]
            else:
                empty.append(session)
        self._forget_beyond(empty, MAX_EMPTY_SESSIONS)
        return expired_writes

    def _forget_beyond(self, empty: list[Session], keep: int) -> None:
        # A peer picks its identity (one per connection): without a bound, one that keeps
        # reconnecting under new ones would grow the table, and every sweep, for idle_s.
        if len(empty) <= keep:
            return
        empty.sort(key=lambda session: session.last_seen)
        for session in empty[: len(empty) - keep]:
            del self._sessions[session.identity]

    def gauges(self, now: float) -> Gauges:
        """Sum what the clients hold from the counts each session keeps, never walking the
        locks and reservations themselves: a scrape runs on its own thread, and a walk of
        a client's many keys would hold the GIL, stalling the loop that serves everyone.
        Changes nothing (``list()`` of the table is one C call); ``now`` is unused, the
        sweep having forgotten what expired."""
        sessions = list(self._sessions.values())
        return Gauges(
            clients=len(sessions),
            locked_keys=sum(session.locked_keys for session in sessions),
            reserved_stores=sum(session.reserved_stores for session in sessions),
            pending_prefetches=sum(len(session.prefetches) for session in sessions),
        )
