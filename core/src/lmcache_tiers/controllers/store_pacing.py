"""How the store controller paces write-back: slices, a bound on work in flight, and
priority for client requests.

A committed batch becomes *slices* of at most ``SLICE_BYTES`` per target adapter (one
object at least), each one store task.  Slices wait in the controller, not in the
adapter's worker queue, so what is handed to an adapter stays small:

* at most ``INFLIGHT_BYTES`` of write-back per adapter are submitted and not yet reported
  (at least one slice), so a request arriving in the middle of write-back finds a few
  milliseconds of it ahead, not a whole burst;
* a slice is submitted only while the data plane is quiet
  (:class:`~lmcache_tiers.activity.DataPlaneActivity`: no request or client copy in
  progress, none just finished), so write-back runs in the gaps between requests -- with
  bounds that keep acknowledged writes moving whatever the load: a slice never waits
  longer than ``MAX_DEFER_S`` after its commit; nothing waits while the objects stored in
  no adapter yet hold more than ``PRESSURE_FRACTION`` of L1 (``L1Manager.unstored_bytes``:
  they are evicted last, and lost if evicted, so L1 must not fill up with them -- an object
  one adapter stored is evictable like any other, however far behind another adapter is
  with it); and nothing waits for ``LOSS_COOLDOWN_S`` after L1 had to evict an object before
  its L2 store (L1 is short of room: every moment an object spends only in L1 is a risk
  then);
* nothing waits once the controller is stopping (shutdown drains at full speed) or while
  a flush waits for L2 (``flush`` wants it done, not polite);
* what waits for one adapter is bounded: once its slices hold more than twice L1's bytes,
  those whose objects all left L1 (stored by the other adapters and evicted since, or
  cleared) are dropped by the store controller and counted (``l2_store_skipped_gone``),
  looked for again once L1's bytes more were added -- an adapter slower than the writes
  would otherwise gather them for as long as it stays behind.

Under sustained load the deadline makes write-back run alongside requests, as it did
before pacing; bursts shorter than the deadline run with write-back out of the way.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from lmcache_tiers.activity import DataPlaneActivity
from lmcache_tiers.controllers.base import AdapterSlot
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Object

#: most bytes of one store task (a slice holds one object at least, whatever its size)
SLICE_BYTES = 32 << 20
#: most write-back bytes handed to one adapter and not yet reported (one slice at least)
INFLIGHT_BYTES = 64 << 20
#: longest a committed object waits for a quiet data plane before it is written back anyway
MAX_DEFER_S = 0.5
#: no deferral for this long after L1 evicted an object before its L2 store
LOSS_COOLDOWN_S = 1.0
#: objects stored in no adapter yet holding more than this share of L1: nothing is deferred
PRESSURE_FRACTION = 0.5
#: how often a deferring controller looks again while client work is in progress
RECHECK_S = 0.002
#: write-back threads that waited for a core more than ``STARVED_SHARE`` of a
#: ``STARVE_WINDOW_S`` and ran less than ``STARVED_RUN_SHARE`` of it are starved: they leave
#: their idle priority until no store task is left (l2/background.py).  Less than a tenth of
#: a core is less than nice 10 gets while every core is busy; an idle-class thread that gets
#: more is better off idle (waiting for a core is what idle threads do beside requests).
STARVED_SHARE = 0.5
STARVED_RUN_SHARE = 0.1
STARVE_WINDOW_S = 0.25
#: where the kernel does not report run-queue waits: a store task running this long counts
#: as starved
STALLED_S = 2.0


def starved(ran_s: float, waited_s: float, window_s: float) -> bool:
    """Whether write-back threads that ran ``ran_s`` and waited for a core ``waited_s`` (summed
    over the threads) in a window of ``window_s`` seconds were short of CPU."""
    return waited_s > STARVED_SHARE * window_s and ran_s < STARVED_RUN_SHARE * window_s


@dataclass(eq=False)
class Slice:
    """Keys of one batch for one adapter, to be one store task."""

    slot: AdapterSlot
    keys: list[ObjectKey]
    nbytes: int
    batch: Any  # the store controller's batch record
    committed: float  # monotonic time the batch was queued


def slices_of(objects: Sequence[L1Object], limit: int | None = None) -> Iterator[list[L1Object]]:
    """``objects`` in order, cut into runs of at most ``limit`` bytes (default
    ``SLICE_BYTES``; one object at least)."""
    limit = SLICE_BYTES if limit is None else limit
    run: list[L1Object] = []
    size = 0
    for obj in objects:
        if run and size + obj.size > limit:
            yield run
            run, size = [], 0
        run.append(obj)
        size += obj.size
    if run:
        yield run


class WriteBackPacer:
    """Slices waiting per adapter and the decision when the next may go.  Controller
    thread only."""

    def __init__(
        self,
        activity: DataPlaneActivity,
        l1_capacity: int,
        losses: Callable[[], int],
        unstored_bytes: Callable[[], int],
    ) -> None:
        """``losses``: how many objects L1 has evicted before their L2 store so far;
        ``unstored_bytes``: bytes L1 holds of objects stored in no adapter yet."""
        self.activity = activity
        self.pressure_bytes = int(l1_capacity * PRESSURE_FRACTION)
        self._losses = losses
        self._unstored_bytes = unstored_bytes
        self._losses_seen = losses()
        self._lost_at = float("-inf")
        self._waiting: dict[int, deque[Slice]] = {}
        self._inflight: dict[int, int] = {}  # adapter index -> bytes submitted, not reported
        self._waiting_bytes: dict[int, int] = {}  # adapter index -> bytes of its waiting slices
        self._added_bytes: dict[int, int] = {}  # adapter index -> bytes of every slice it was given
        self.deferrals = 0  # times a slice was held back for client work (a gauge's source)
        self.pressed = False  # at the last take: L1 short of room (pressure or a recent loss)

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    def add(self, piece: Slice) -> None:
        index = piece.slot.index
        self._waiting.setdefault(index, deque()).append(piece)
        self._waiting_bytes[index] = self._waiting_bytes.get(index, 0) + piece.nbytes
        self._added_bytes[index] = self._added_bytes.get(index, 0) + piece.nbytes

    def waiting_bytes_of(self, index: int) -> int:
        """Bytes of adapter ``index``'s waiting slices."""
        return self._waiting_bytes.get(index, 0)

    def added_bytes_of(self, index: int) -> int:
        """Bytes of all the slices ever added for adapter ``index`` (only grows)."""
        return self._added_bytes.get(index, 0)

    def prune(self, index: int, keep: Callable[[Slice], bool]) -> list[Slice]:
        """Remove adapter ``index``'s waiting slices that ``keep`` rejects (order kept);
        returns them.  They were never in flight."""
        queue = self._waiting.get(index)
        if not queue:
            return []
        kept: deque[Slice] = deque()
        dropped: list[Slice] = []
        for piece in queue:
            (kept if keep(piece) else dropped).append(piece)
        self._waiting[index] = kept
        for piece in dropped:
            self._count_taken(piece)
        return dropped

    def _count_taken(self, piece: Slice) -> None:
        """``piece`` waits no more."""
        self._waiting_bytes[piece.slot.index] -= piece.nbytes

    def reported(self, index: int, nbytes: int) -> None:
        """A slice ``take`` handed out is done (reported, or never became a task)."""
        self._inflight[index] = max(0, self._inflight.get(index, 0) - nbytes)

    def take(self, *, urgent: bool, now: float | None = None) -> tuple[list[Slice], float | None]:
        """The slices to submit now, and in how many seconds to look again (None: when an
        adapter reports, or new work comes)."""
        now = time.monotonic() if now is None else now
        if self._waiting:
            losses = self._losses()
            if losses != self._losses_seen:
                self._losses_seen, self._lost_at = losses, now
        # Not the waiting slices' bytes: those of an adapter behind the others name objects
        # the others stored, which L1 may evict at no loss; counted, they kept write-back
        # pressed for as long as that adapter stayed behind.
        full = self._unstored_bytes() >= self.pressure_bytes
        self.pressed = now - self._lost_at < LOSS_COOLDOWN_S or full
        urgent = urgent or (bool(self._waiting) and (full or now - self._lost_at < LOSS_COOLDOWN_S))
        chosen: list[Slice] = []
        wake: float | None = None
        quiet: float | None = None
        for index, queue in self._waiting.items():
            inflight = self._inflight.get(index, 0)
            while queue:
                piece = queue[0]
                if inflight and inflight + piece.nbytes > INFLIGHT_BYTES:
                    break  # the adapter's next report wakes the controller
                if not urgent:
                    overdue = piece.committed + MAX_DEFER_S - now
                    if overdue > 0:
                        if quiet is None:
                            quiet = self.activity.quiet_in(now)
                        if quiet > 0:
                            self.deferrals += 1
                            again = min(quiet, overdue, RECHECK_S)
                            wake = again if wake is None else min(wake, again)
                            break
                queue.popleft()
                self._count_taken(piece)
                inflight += piece.nbytes
                chosen.append(piece)
            self._inflight[index] = inflight
        return chosen, wake

    def drop_all(self) -> list[Slice]:
        """Every waiting slice, removed (shutdown gave up)."""
        dropped = [piece for queue in self._waiting.values() for piece in queue]
        self._waiting.clear()
        self._waiting_bytes.clear()
        return dropped
