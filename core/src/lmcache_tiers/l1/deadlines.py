"""Locked objects by when their locks expire, so that a TTL reap costs what expired.

The reap (``l1/removal.py``) runs under the L1 lock every fraction of a second.  Walking
every locked object to find the few past their deadline held every store and lookup up for
~70-120 ms with 100k read-locked objects; with this index a pass visits only:

* the **read cells** that ended: every read-lock deadline is on the lock grid
  (``l1/reads.py``), so an object is filed under each deadline it takes locks at, one set
  per grid cell (a few dozen live cells), the cells' ends in a heap.  Nothing is taken out
  on a release, which stays a plain count on the lookup path: a cell's set may hold
  objects unlocked since, or locked again at a later deadline, and the reap skips those
  (each costs one look, paid for by the lock that filed it);
* the **write reservations** past their deadline, from the front of ``writing``: all of
  them share one TTL, so the order they were reserved in is the order they expire in.
  Unlike the read cells, it is kept exact (a commit or a departure takes its object out):
  it would otherwise keep every object written in the last write TTL alive;
* the objects of ended cells whose locks an L2 store was still reading (``stalled``):
  those locks go when the store reports, so they are looked at again each pass until then
  (as many as stores in flight).

A pass takes a bounded number of these (``limit``): a client that died holding 100k locks,
or a burst of reservations past the write TTL, made one pass hold the L1 lock 110-200 ms.
What a pass leaves stays filed where it was -- the rest of a cell, the front of
``writing`` -- and ``due`` says the next pass has work at once.

Not thread-safe: every caller holds the L1 manager's lock.
"""

from __future__ import annotations

import heapq
import itertools
import math

from lmcache_tiers.l1.objects import L1Object


class LockDeadlines:
    """Where the reap looks: read cells by deadline, write reservations in deadline order."""

    def __init__(self) -> None:
        self._cells: dict[float, set[L1Object]] = {}
        self._ends: list[float] = []  # heap of ``_cells``' keys
        #: WRITING objects, in the order they were reserved (= the order they expire in)
        self.writing: dict[L1Object, None] = {}
        self._stalled: set[L1Object] = set()
        #: the latest time a reap looked for ended cells at: a cell whose end is later was
        #: never emptied, so every object filed under it is still there
        self.reaped_through = -math.inf

    def reading(self, deadline: float) -> set[L1Object]:
        """The set to add the objects that just took read locks expiring at ``deadline``."""
        cell = self._cells.get(deadline)
        if cell is None:
            cell = self._cells[deadline] = set()
            heapq.heappush(self._ends, deadline)
        return cell

    def file_again(self, obj: L1Object) -> None:
        """File the read-locked ``obj`` again under those of its deadlines whose cells a reap
        may have emptied already (``reaped_through`` or earlier).  Only an object that a reap
        with an earlier time looks at has such locks: one stalled behind an L2 store while a
        later reap emptied its cells, then reaped from ``stalled`` by a reaper that read the
        clock before it (or after a reap given a time past the clock).  Those locks are
        filed nowhere else: left so, they were never reaped."""
        groups = obj.lock_groups
        if groups is None:
            if obj.lock_deadline <= self.reaped_through:
                self.reading(obj.lock_deadline).add(obj)
            return
        for deadline in groups[::2]:
            if deadline > self.reaped_through:
                break  # earliest first: the rest are later still
            self.reading(deadline).add(obj)

    def stall(self, obj: L1Object) -> None:
        """``obj`` has readers' locks past their deadline that wait for its L2 store to report."""
        self._stalled.add(obj)

    def reads_due(self, now: float, limit: int) -> list[L1Object]:
        """At most ``limit`` of the objects filed under read cells that ended by ``now``
        (taken out of them), then of those stalled so far: some of their locks may be due.
        Each is looked at once more only if it is stalled again.  What the limit leaves
        stays filed (a cell is dropped only once emptied) for the next pass: a client that
        died holding 100k locks made one pass hold the L1 lock for 110-200 ms.  The cells
        come first: objects whose stores stay slow, stalled again pass after pass, must not
        keep the budget from the locks the reap can end."""
        if now > self.reaped_through:
            self.reaped_through = now
        due: list[L1Object] = []
        ends, cells = self._ends, self._cells
        while ends and ends[0] <= now and len(due) < limit:
            cell = cells[ends[0]]
            room = limit - len(due)
            if len(cell) > room:
                due.extend(cell.pop() for _ in range(room))
                break
            due.extend(cell)
            del cells[heapq.heappop(ends)]
        stalled, room = self._stalled, limit - len(due)
        if len(stalled) <= room:
            due.extend(stalled)
            self._stalled = set()
        else:
            due.extend(stalled.pop() for _ in range(room))
        return due

    def reads_waiting(self, now: float) -> bool:
        """Whether a read cell ended by ``now`` is still filed (objects the reap has yet to
        look at)."""
        return bool(self._ends) and self._ends[0] <= now

    @property
    def any_stalled(self) -> bool:
        """Whether objects wait for a look once their L2 stores have reported."""
        return bool(self._stalled)

    def due(self, now: float) -> bool:
        """Whether a reap at ``now`` has locks to look at, besides those stalled (which wait
        for their stores, not for the reap)."""
        if self.reads_waiting(now):
            return True
        return any(obj.lock_deadline <= now for obj in itertools.islice(self.writing, 1))

    def writes_due(self, now: float, limit: int) -> list[L1Object]:
        """At most ``limit`` of the write reservations whose deadline is ``now`` or earlier,
        earliest first (left in ``writing``: freeing them takes them out, and those past the
        limit are the front of it for the next pass)."""
        if not self.writing:
            # A dict keeps the slots of the entries taken out (until it grows again) and
            # walks past them: a fresh one, once every reservation is over, walks none.
            self.writing = {}
            return []
        due: list[L1Object] = []
        for obj in itertools.islice(self.writing, limit):
            if obj.lock_deadline > now:
                break
            due.append(obj)
        return due

    def clear(self) -> None:
        self.reaped_through = math.inf  # nothing is filed any more
        self._cells.clear()
        self._ends.clear()
        self.writing.clear()
        self._stalled.clear()
