"""The state one adapter's operations share: what the backend context exposes and the
batch operations update (pins, accounting, serde chain, counters, listeners).

It holds no threads; the runner and the adapter own those.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from lmcache_tiers.burst import BurstLog, PolicyFailureLog
from lmcache_tiers.errors import plugin_code
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.accounting import UNKNOWN_L1, ByteAccounting
from lmcache_tiers.l2.codec import SerdeChain
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.interface import L2Listener
from lmcache_tiers.l2.pins import PinTable
from lmcache_tiers.l2.tasks import TaskBoard
from lmcache_tiers.protocols import Capacity, ObjectSize

if TYPE_CHECKING:
    from lmcache_tiers.l2.interface import L2Adapter
    from lmcache_tiers.registry import ComponentRegistry

log = logging.getLogger("lmcache_tiers.l2")

#: listener callbacks a listener may lack (it is then not told)
OPTIONAL_CALLBACKS = frozenset({"on_l2_keys_absent", "on_l2_keys_scanned"})

#: the largest stored size one object is taken to have at most (256 TiB): past it (or past
#: the backend's whole byte capacity) a listed or reported size is the backend's bug
MAX_OBJECT_BYTES = 1 << 48


def impossible_size(size: ObjectSize, limit: Capacity | None) -> bool:
    """Whether ``size`` has stored bytes past ``limit``'s whole byte capacity, or past
    :data:`MAX_OBJECT_BYTES`.  Past the latter (``limit`` None) no object can have it:
    accounted, such a size would make the usage absurd -- every store refused for
    capacity, and eviction deleting valid objects for room that can never be made.  Past
    the capacity only, it is an object an earlier run with a larger capacity stored: the
    scan and lookups account it (and count it).  (An L1 size past L1 is another matter,
    refused when it would be reserved: ops._possible_l1_size.)"""
    bound = MAX_OBJECT_BYTES
    if limit is not None and limit.bytes is not None:
        bound = min(bound, limit.bytes)
    return size.stored > bound


class Counters:
    """Monotonic counters of one adapter, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()

    def add(self, name: str, amount: int = 1) -> None:
        if amount:
            with self._lock:
                self._counts[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


class AdapterState:
    """Everything the operations of one adapter share; built before its backend."""

    def __init__(self, facts: AdapterContext, registry: ComponentRegistry | None = None) -> None:
        self.facts = facts
        self.name = facts.name
        self.registry = registry
        self.chain = SerdeChain(facts.serde)
        self.accounting = ByteAccounting()
        self.pins = PinTable()
        self.board = TaskBoard()
        self.counters = Counters()
        self.closing = threading.Event()
        self.burst = BurstLog()
        self.adapter: L2Adapter | None = None  # the adapter listeners are told about
        self._listeners: list[L2Listener] = []
        # A listener with a bug fails on every notification: one traceback, then a line a burst.
        self._listener_failures = PolicyFailureLog(log, "listener_failures")
        self._lock = threading.Lock()
        #: (L1 size, layout, stored size) of keys whose store is in the backend call right
        #: now, one entry per store: stores of one key may overlap, and each record header
        #: must describe its own payload (the claim keeping deletes off them is the store's
        #: ``pins.begin_write``, taken before ``storing_begin`` and dropped after
        #: ``storing_end``, on every path)
        self._storing: dict[ObjectKey, list[tuple[int, str, int]]] = {}
        #: keys whose record was written with another serde chain (or, in an index in
        #: memory, in a newer format), or that the configured chain failed to decode
        #: (misses until replaced)
        self._unreadable: set[ObjectKey] = set()
        #: [lookups and loads of the key in a backend call right now, whether a store of it
        #: was in flight meanwhile]: a record they judge unreadable may be one such a store
        #: replaced, and the key is then not marked
        self._reading: dict[ObjectKey, list[Any]] = {}
        #: the layouts noted by each load of the key in a backend call right now, one mapping
        #: per load (its own, key -> layouts read from the key's records): loads of one key
        #: may overlap, and each must end with what was read while it ran, never another's
        self._loading: dict[ObjectKey, list[dict[ObjectKey, set[str]]]] = {}

    def count(self, name: str, amount: int = 1) -> None:
        self.counters.add(name, amount)

    # -- keys being stored -------------------------------------------------------------------

    def storing_begin(self, items: Sequence[tuple[ObjectKey, int, str, int]]) -> None:
        """Note (key, L1 size, layout, stored size) of each object a store hands the backend."""
        with self._lock:
            for key, l1_size, layout, stored in items:
                self._storing.setdefault(key, []).append((l1_size, layout, stored))
                self._unreadable.discard(key)
                reading = self._reading.get(key)
                if reading is not None:
                    reading[1] = True  # what they read may be replaced by this store

    def storing_end(self, items: Sequence[tuple[ObjectKey, int, str, int]]) -> None:
        """Drop what ``storing_begin`` noted for the same items (one entry each): another
        store of a key still in its call keeps its own."""
        with self._lock:
            for key, l1_size, layout, stored in items:
                entries = self._storing.get(key)
                if not entries:
                    continue
                try:
                    entries.remove((l1_size, layout, stored))
                except ValueError:
                    pass
                if not entries:
                    del self._storing[key]

    def storing(self, key: ObjectKey, stored: int | None = None) -> tuple[int, str] | None:
        """(L1 size, layout) of a store of ``key`` in its backend call: the latest one whose
        payload is ``stored`` bytes when given (overlapping stores of a key), else the latest."""
        with self._lock:
            entries = self._storing.get(key)
            if not entries:
                return None
            if stored is not None:
                for l1_size, layout, size in reversed(entries):
                    if size == stored:
                        return l1_size, layout
            l1_size, layout, _ = entries[-1]
            return l1_size, layout

    def l1_size_of(self, key: ObjectKey) -> int | None:
        """L1 size of a key being stored now, else of an accounted key; None if unknown."""
        storing = self.storing(key)
        if storing is not None:
            return storing[0]
        size = self.accounting.get(key)
        return None if size is None or size.l1 == UNKNOWN_L1 else size.l1

    # -- layouts of keys loaded ----------------------------------------------------------------

    def loading_begin(self, keys: Sequence[ObjectKey], noted: dict[ObjectKey, set[str]]) -> None:
        """A load of ``keys`` is about to read their records: each layout read from a
        record of one of them until ``loading_end`` is added to ``noted`` (the load's own)."""
        with self._lock:
            for key in dict.fromkeys(keys):
                self._loading.setdefault(key, []).append(noted)

    def note_layout(self, key: ObjectKey, layout: str) -> None:
        """A record of ``key`` was read, stating ``layout`` ("" for none): noted for every
        load of the key in its backend call now.  The backend does not say which load read
        it, so overlapping loads each note it; one that noted two layouts cannot tell which
        its bytes are of (``LoadOp``: a miss)."""
        with self._lock:
            for noted in self._loading.get(key, ()):
                noted.setdefault(key, set()).add(layout)

    def loading_end(self, keys: Sequence[ObjectKey], noted: dict[ObjectKey, set[str]]) -> None:
        """The load that began with ``noted`` is out of its backend call: later reads of
        the keys' records are none of its business."""
        with self._lock:
            for key in dict.fromkeys(keys):
                loads = self._loading.get(key)
                if loads is None:
                    continue
                for position, entry in enumerate(loads):
                    if entry is noted:
                        del loads[position]
                        break
                if not loads:
                    del self._loading[key]

    # -- records of another serde chain -----------------------------------------------------------

    def reading_begin(self, keys: Sequence[ObjectKey]) -> None:
        """Lookups or loads of ``keys`` are about to read their records (``reading_end``
        once each, after any mark)."""
        with self._lock:
            for key in keys:
                entry = self._reading.setdefault(key, [0, False])
                entry[0] += 1
                if key in self._storing:
                    entry[1] = True

    def reading_end(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                entry = self._reading.get(key)
                if entry is None:
                    continue
                entry[0] -= 1
                if entry[0] <= 0:
                    del self._reading[key]

    def _stored_meanwhile(self, key: ObjectKey) -> bool:
        """Whether a store of ``key`` is in flight, or ran while a lookup or load of it read
        its record: the record judged may be the one that store replaced (the new one is
        judged when next read).  The caller holds the lock."""
        reading = self._reading.get(key)
        return key in self._storing or (reading is not None and reading[1])

    def _mark(self, key: ObjectKey) -> bool:
        """Mark ``key`` a miss until replaced, unless it was stored meanwhile.  Whether it
        was marked."""
        with self._lock:
            if self._stored_meanwhile(key):
                return False
            self._unreadable.add(key)
            return True

    def release_replaced(self, key: ObjectKey) -> None:
        """``key``'s record was found replaced in the store by one this adapter keeps but
        does not read (another key's, a newer format's): what it accounted under the name
        is not there any more.  Released now (counted ``objects_vanished``, logged) and
        announced deleted -- else a backend answering lookups of accounted keys from the
        record's size would find it at every lookup, and every load of it would miss.  Not
        when a store of the key ran meanwhile: the record judged may be one it replaced."""
        # The entry is read before the check: a store landing after the read replaces it
        # (``forget_if`` then keeps the new one), and one landing before the check is seen
        # by it.  Read after the check, a store landing in between would be forgotten --
        # its record in the store, its bytes uncounted, the eviction policy told it is gone.
        known = self.accounting.get(key)
        with self._lock:
            if self._stored_meanwhile(key):
                return
        if known is None or not self.accounting.forget_if(key, known):
            return
        self.forget_unreadable([key])
        self.count("objects_vanished")
        self.burst.warn(
            "objects_replaced",
            "%s: accounted object %s replaced in the store by a record this adapter keeps but "
            "does not read (another key's or a newer format's): its bytes are released",
            self.name,
            key.file_stem(),
        )
        self.notify("on_l2_keys_deleted", [key])

    def mark_unreadable(self, key: ObjectKey, written: Sequence[str]) -> None:
        marked = self._mark(key)
        self.count("serde_chain_mismatch")
        self.burst.warn(
            "serde_chain_mismatch",
            "%s: %s was written with serde chain %s, configured is %s: a miss (the record is kept)%s",
            self.name,
            key.file_stem(),
            list(written),
            list(self.chain.names),
            "" if marked else "; a store of it replaced that record meanwhile",
        )

    def mark_undecodable(self, key: ObjectKey) -> bool:
        """The configured chain failed to decode ``key``'s verified record (a key rotated
        away, a frame it cannot read): it would fail the same way at every load, so it is
        a miss until replaced, like a record of another chain -- unless a store of it ran
        meanwhile (False: not marked).  Counted and logged by the caller."""
        return self._mark(key)

    def unreadable(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self._lock:
            if not self._unreadable:
                return [False] * len(keys)
            return [key in self._unreadable for key in keys]

    def forget_unreadable(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self._unreadable.difference_update(keys)

    # -- listeners -----------------------------------------------------------------------------

    def add_listener(self, listener: L2Listener) -> None:
        self._listeners.append(listener)

    def notify(self, method: str, keys: Sequence[ObjectKey]) -> None:
        if not keys:
            return
        for listener in list(self._listeners):
            try:
                if method in OPTIONAL_CALLBACKS:
                    callback = getattr(listener, method, None)
                    if callback is None:
                        continue  # a listener that does not take this news
                else:
                    callback = getattr(listener, method)
                # Listeners run plugin code (an eviction policy): a SystemExit it raises on
                # the scan's thread, a worker or the event loop would end that thread.
                with plugin_code():
                    callback(self.adapter, keys)
            except Exception:  # a listener bug must not fail the adapter's operations
                # Counted: the listener (an eviction policy) may have missed those keys.
                self.count("listener_failures")
                self._listener_failures.failed("%s: listener %r failed in %s", self.name, listener, method)

    def backend_failed(self, method: str, exc: BaseException) -> None:
        self.count("backend_errors")
        self.burst.warn(
            f"backend_errors:{method}",
            "%s: %s failed: %s: %s",
            self.name,
            method,
            type(exc).__name__,
            exc,
        )
