"""The keys an L2 eviction is deleting from one adapter, for the store controller.

An adapter refuses to store a key a delete of it is running on (``store_skipped_deleting``,
``l2/ops.py``): the store fails.  When L1 still holds that object -- an acknowledged write,
written again since L2 picked its older copy to evict -- nothing stores it anywhere once
its batch ends, and an L1 eviction then loses it without counting it.  So the eviction
controller notes its deletes here (``begin`` .. ``end``), and the store controller asks, for
a key a store task failed, whether a delete of it ran while the task did
(``raced``); such a key is stored again once the delete ended.

A delete past its eviction's deadline (``overdue``: the backend may never answer) is no
delete to wait for: the store controller gives up the keys waiting for it (``hung``), counted,
rather than hold them -- and a flush with them -- until the drain deadline.  It cannot store
them meanwhile: the adapter refuses a store of a key being deleted, and a store let through
could land before the delete and be removed by it, an acknowledged write lost.

Ended deletes are remembered by the number of delete events (begins and ends) so far,
since a store task records that number when submitted: the store controller forgets those
that ended before its oldest task of the adapter was submitted (``forget_before``), and
at most ``ENDED_MAX`` are kept whatever it does -- a race past them is a failed store,
counted as before.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence

from lmcache_tiers.keys import ObjectKey

#: ended deletes remembered per adapter at most (oldest forgotten first)
ENDED_MAX = 1 << 16


class L2Deletes:
    """Deletes of one adapter running and recently ended; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: Counter[ObjectKey] = Counter()
        #: of the running keys, those whose delete is past its eviction's deadline
        self._overdue: Counter[ObjectKey] = Counter()
        #: key -> ``events`` when its last delete ended, oldest first.  Ordered, not a dict:
        #: the oldest are dropped one by one, and ``next(iter(d))`` on a dict scans every
        #: slot deleted before it (until a resize), so past ``ENDED_MAX`` each end cost
        #: O(keys) under the lock, ~30 us a key
        self._ended: OrderedDict[ObjectKey, int] = OrderedDict()
        #: begins and ends so far: a store task reads it when submitted
        self.events = 0
        #: called after a delete ended or went overdue (wakes the store controller); set once,
        #: before use
        self.on_end: Callable[[], None] | None = None

    def begin(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self.events += 1
            self._running.update(keys)

    def end(self, keys: Sequence[ObjectKey]) -> None:
        with self._lock:
            self.events += 1
            events, ended, running, overdue = self.events, self._ended, self._running, self._overdue
            for key in keys:
                running[key] -= 1
                if running[key] <= 0:
                    del running[key]
                    overdue.pop(key, None)
                ended[key] = events
                ended.move_to_end(key)  # oldest first stays true
            while len(ended) > ENDED_MAX:
                ended.popitem(last=False)
        on_end = self.on_end
        if on_end is not None:
            on_end()

    def overdue(self, keys: Sequence[ObjectKey]) -> None:
        """The delete of ``keys`` (begun, not ended) is past its deadline: the stores waiting
        for it are given up (``hung``)."""
        with self._lock:
            self._overdue.update(key for key in keys if key in self._running)
        on_end = self.on_end
        if on_end is not None:
            on_end()

    def hung(self, keys: Iterable[ObjectKey]) -> list[ObjectKey]:
        """Those of ``keys`` a delete past its deadline is running on."""
        with self._lock:
            return [key for key in keys if key in self._overdue]

    def raced(self, keys: Iterable[ObjectKey], since: int) -> list[ObjectKey]:
        """Those of ``keys`` a delete is running on, or whose delete ended after ``events``
        was ``since``."""
        with self._lock:
            running, ended = self._running, self._ended
            return [key for key in keys if key in running or ended.get(key, -1) > since]

    def running(self, keys: Iterable[ObjectKey]) -> bool:
        """Whether a delete of one of ``keys`` is running."""
        with self._lock:
            return any(key in self._running for key in keys)

    def forget_before(self, events: int | None) -> None:
        """Forget the deletes that had ended when the count of events was ``events``
        (None: all of them): no store task submitted since can have met them."""
        with self._lock:
            ended = self._ended
            if events is None:
                ended.clear()
                return
            while ended:
                ended_at = next(iter(ended.values()))
                if ended_at > events:
                    break
                ended.popitem(last=False)
