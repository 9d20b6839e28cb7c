"""The state one adapter's operations share: what the backend context exposes and the
batch operations update (pins, accounting, serde chain, counters, listeners).

It holds no threads; the runner and the adapter own those.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lmcache_tiers.burst import BurstLog
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

#: layouts of loaded keys kept for the prefetches that loaded them; past that (loads with
#: no prefetch behind them, such as a benchmark's) the oldest no reader pins are forgotten
_LOADED_LAYOUTS_MAX = 1 << 16


def impossible_size(size: ObjectSize, limit: Capacity | None) -> bool:
    """Whether no object of a backend with capacity ``limit`` can have ``size``: stored
    bytes past its whole byte capacity, or past :data:`MAX_OBJECT_BYTES`.  Accounted, such
    a size would make the usage absurd: every store refused for capacity, and eviction
    deleting valid objects for room that can never be made.  (An L1 size past L1 is
    another matter, refused when it would be reserved: ops._possible_l1_size.)"""
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
        #: [loads of the key in a backend call right now, layout read from its record ("" until
        #: read)]: loads of one key may overlap, and one ending must not drop what the other
        #: reads; then layouts of keys loaded, until the prefetch that loaded them takes them
        self._loading: dict[ObjectKey, list[Any]] = {}
        #: layouts of keys loaded, one entry per load ("" for a record without one), the
        #: oldest first: two loads of one key may end before either prefetch collects, and
        #: each must find its own (one entry shared would leave the second taker none)
        self._loaded_layouts: dict[ObjectKey, deque[str]] = {}
        self._loaded_layouts_kept = 0  # entries over all keys, what the bound counts

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

    def loading_begin(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            for key in keys:
                entry = self._loading.setdefault(key, [0, ""])
                entry[0] += 1

    def note_layout(self, key: ObjectKey, layout: str) -> None:
        """A record of ``key`` was read, with ``layout``: kept if a load of it is running."""
        if layout:
            with self._lock:
                entry = self._loading.get(key)
                if entry is not None:
                    entry[1] = layout

    def loading_layout(self, key: ObjectKey) -> str:
        """The layout read from ``key``'s record by a load running now ("" if none)."""
        with self._lock:
            entry = self._loading.get(key)
            return entry[1] if entry is not None else ""

    def loading_end(
        self,
        keys: Sequence[ObjectKey],
        loaded: Sequence[ObjectKey],
        checked: Mapping[ObjectKey, str] | None = None,
    ) -> None:
        """A load of ``keys`` ended, ``loaded`` loaded: their layouts are kept for the
        prefetch that loaded them -- ``checked``'s, when given (the layouts the serde chain
        decoded the objects against), not whatever a later read of their records noted."""
        with self._lock:
            layouts: dict[ObjectKey, str] = {}
            for key in keys:
                entry = self._loading.get(key)
                if entry is None:
                    continue
                layouts[key] = entry[1]
                entry[0] -= 1
                if entry[0] <= 0:
                    del self._loading[key]
            kept = self._loaded_layouts
            if checked is not None:
                layouts = dict(checked)
            for key in loaded:
                kept.setdefault(key, deque()).append(layouts.get(key, ""))
            self._loaded_layouts_kept += len(loaded)
            dropped = self._drop_oldest_layouts()
        if dropped:
            self.count("loaded_layouts_dropped", dropped)
            self.burst.warn(
                "loaded_layouts_dropped",
                "%s: %d layouts of loaded keys nobody collected were dropped, the oldest first "
                "(loads with no prefetch behind them?); a prefetch collecting one later gets its "
                "object without a layout",
                self.name,
                dropped,
                count=dropped,
            )

    def _drop_oldest_layouts(self) -> int:
        """Forget the oldest kept layouts past ``_LOADED_LAYOUTS_MAX`` (under ``_lock``);
        how many.  Those of pinned keys stay: a prefetch holds its keys pinned until their
        load completed, and collects their layouts then -- dropped, its objects would reach
        L1 with no layout and a front end's layout check would go by size alone."""
        kept = self._loaded_layouts
        dropped = 0
        if self._loaded_layouts_kept <= _LOADED_LAYOUTS_MAX:
            return 0
        # Listed before any is dropped (a dict cannot shrink while iterated); a key keeps
        # the place of its oldest load, so the oldest go first.
        victims: list[ObjectKey] = []
        excess = self._loaded_layouts_kept - _LOADED_LAYOUTS_MAX
        for key in kept:
            if dropped >= excess:
                break
            if not self.pins.pinned([key])[0]:
                victims.append(key)
                dropped += len(kept[key])
        for key in victims:
            self._loaded_layouts_kept -= len(kept.pop(key))
        return dropped

    def take_layouts(self, keys: Sequence[ObjectKey]) -> list[str]:
        """The layout each of ``keys`` was loaded with, one load's each, the oldest load's
        first ("" when none is kept): each load's entry is handed over once."""
        with self._lock:
            return [self._take_layout(key) for key in keys]

    def _take_layout(self, key: ObjectKey) -> str:
        """The oldest kept load's layout of ``key``, handed over (under ``_lock``)."""
        entries = self._loaded_layouts.get(key)
        if not entries:
            return ""
        layout = entries.popleft()
        self._loaded_layouts_kept -= 1
        if not entries:
            del self._loaded_layouts[key]
        return layout

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

    def _mark(self, key: ObjectKey) -> bool:
        """Mark ``key`` a miss until replaced, unless a store of it was in flight while a
        lookup or load of it read its record: the record judged may be the one that store
        replaced, and the new one is readable (it is judged when next read).  Whether it
        was marked."""
        with self._lock:
            reading = self._reading.get(key)
            if key in self._storing or (reading is not None and reading[1]):
                return False
            self._unreadable.add(key)
            return True

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
                log.exception("%s: listener %r failed in %s", self.name, listener, method)

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
