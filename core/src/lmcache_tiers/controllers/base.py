"""What every controller thread shares: a wake-up fd, a poll loop, idle tracking, shutdown.

A controller sleeps in ``poll`` on its adapters' eventfds plus one fd of its own, so work
handed to it from another thread (or a request to stop) wakes it without busy-waiting and
without a lock around the adapters.  ``wait_idle`` lets callers (tests, ``flush``) wait until
everything handed over so far has been processed, with no sleeps.  A :class:`TaskTracker`
pairs the results an adapter reports with whatever submitted the tasks.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from lmcache_tiers.burst import PolicyFailureLog as PolicyFailureLog  # re-exported for the controllers
from lmcache_tiers.controllers.l2_deletes import L2Deletes
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.errors import plugin_code
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.interface import L2Adapter, L2Op
from lmcache_tiers.policies import AdapterInfo, EvictionPolicy

logger = logging.getLogger(__name__)

_ONE = (1).to_bytes(8, "little")  # an eventfd takes an 8-byte counter increment

#: how long ``ControllerThread.join`` waits past the drain deadline for a step that does not
#: return (a backend call stuck for good, e.g. an L2 eviction's delete): shutdown then goes
#: on without the thread, and closing the adapters interrupts such calls
JOIN_GRACE_S = 10.0


class Waker:
    """A level-triggered wake-up fd: an eventfd on Linux, a non-blocking pipe elsewhere."""

    def __init__(self) -> None:
        if hasattr(os, "eventfd"):
            fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._read_fd, self._write_fd = fd, fd
        else:  # pragma: no cover - non-Linux hosts
            self._read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._read_fd, False)
            os.set_blocking(self._write_fd, False)
        self._closed = False
        # set() may race with close() at shutdown; writing to a closed (possibly reused)
        # fd number would poke an unrelated file.
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._read_fd

    def set(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                os.write(self._write_fd, _ONE)
            except BlockingIOError:
                pass  # already readable: the pipe is full or the counter saturated

    def drain(self) -> None:
        try:
            os.read(self._read_fd, 4096)
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._read_fd)
            if self._write_fd != self._read_fd:
                os.close(self._write_fd)


@dataclass(frozen=True)
class AdapterSlot:
    """One adapter of the cascade as the controllers see it."""

    index: int  # position in the cascade; policies' plans are keyed by it
    type: str  # registered type name, e.g. "mock"
    adapter: L2Adapter
    #: its L2 eviction's deletes, which a store of the same key may meet
    deletes: L2Deletes = field(default_factory=L2Deletes, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.adapter.name

    def info(self) -> AdapterInfo:
        try:
            usage = float(self.adapter.usage())
        except Exception:  # a failing backend must not stop policies from planning
            usage = -1.0
        return AdapterInfo(self.index, self.type, self.adapter.name, usage)


def adapter_infos(slots: Sequence[AdapterSlot]) -> list[AdapterInfo]:
    return [slot.info() for slot in slots]


OwnerT = TypeVar("OwnerT")
ResultT = TypeVar("ResultT")
#: what settles an orphaned task's result: (adapter slot, owner, result)
OrphanSettler = Callable[[AdapterSlot, OwnerT, ResultT], None]


class TaskTracker(Generic[OwnerT, ResultT]):
    """The tasks of one operation kind a controller has submitted, by (adapter, task id).

    ``reap(slot)`` pops the adapter's completed results and pairs each with the owner it
    was tracked with.  A task whose owner gave up before it finished is *orphaned*: when
    its result comes, the callback given then gets the adapter's slot, the owner and the
    result (to drop the pins the task took, or free the buffers it wrote into).  Results
    of tasks never tracked are ignored: each op kind has a single consumer, so they cannot
    belong to anyone else.  Controller thread only.
    """

    def __init__(
        self,
        op: L2Op,
        pop_completed: Callable[[L2Adapter], Mapping[int, ResultT]],
        stats: EngineStats,
    ) -> None:
        self.op = op
        self._pop_completed = pop_completed
        self._stats = stats
        self._owners: dict[tuple[int, int], OwnerT] = {}
        self._orphans: dict[tuple[int, int], tuple[OwnerT, OrphanSettler[OwnerT, ResultT]]] = {}

    def __len__(self) -> int:
        return len(self._owners)

    def track(self, slot: AdapterSlot, task_id: int, owner: OwnerT) -> None:
        self._owners[(slot.index, task_id)] = owner

    def owners(self) -> list[OwnerT]:
        return list(self._owners.values())

    def orphaned(self) -> int:
        """Tasks whose owner gave up, not reported yet: they still hold what they took
        (L2 pins, the L1 extents a load fills).  One C call: any thread may ask."""
        return len(self._orphans)

    def orphan(self, index: int, task_id: int, settle: OrphanSettler[OwnerT, ResultT]) -> OwnerT | None:
        """Detach a running task from its owner (returned, None if not tracked):
        ``settle(slot, owner, result)`` runs instead when the adapter reports it."""
        owner = self._owners.pop((index, task_id), None)
        if owner is not None:
            self._orphans[(index, task_id)] = (owner, settle)
        return owner

    def clear(self) -> None:
        self._owners.clear()
        self._orphans.clear()

    def reap(self, slot: AdapterSlot) -> list[tuple[OwnerT, ResultT]]:
        """The adapter's completed tasks that have an owner, with their results."""
        kind = self.op.name.lower()
        try:
            completed = self._pop_completed(slot.adapter)
        except Exception:
            logger.exception("%s: popping %s results failed", slot.name, kind)
            self._stats.fail(f"l2_{kind}_pop_error")
            return []
        owned: list[tuple[OwnerT, ResultT]] = []
        for task_id, result in completed.items():
            key = (slot.index, task_id)
            owner = self._owners.pop(key, None)
            if owner is not None:
                owned.append((owner, result))
                continue
            orphan = self._orphans.pop(key, None)
            if orphan is None:
                continue
            try:
                orphan[1](slot, orphan[0], result)
            except Exception:
                logger.exception("%s: settling an abandoned %s task failed", slot.name, kind)
                self._stats.fail(f"l2_{kind}_orphan_error")
        return owned


#: keys a walk of ``victims()`` may offer beyond those the caller knows the policy may hold
#: (held, and removed with a report the policy failed on), before it is cut short
WALK_SLACK = 64


def bounded_walk(
    victims: Iterator[ObjectKey], limit: int, overrun: Callable[[], None]
) -> Iterator[ObjectKey]:
    """``victims`` ended at the first key offered again, or after ``limit`` distinct keys
    if the caller asks for more; ``overrun()`` is called when either ends it.

    A policy offers each key it holds at most once per walk, so a key offered twice is a
    policy offering keys again and again (say, a head it waits for the caller to remove,
    which is locked): unbounded, it would hold the lock the walk runs under for ever.  The
    caller passes a limit no correct walk reaches: the keys the policy may hold, counting
    those whose removal report it failed on -- kept by it, though gone, they come first
    in its order as often as not, and a walk must get past them to a live key."""
    seen: set[ObjectKey] = set()
    for key in victims:
        if key in seen or len(seen) >= limit:
            overrun()
            return
        seen.add(key)
        yield key


def close_walk(walk: Iterator[ObjectKey]) -> None:
    """End a policy's walk of ``victims()`` now (a generator's ``finally`` runs): one that
    is a plain iterator has nothing to end.  The caller closes it under the lock that
    guards the policy, as plugin code: left to the garbage collector, the walk's cleanup
    would run with no lock held, and what it raised would be swallowed, uncounted."""
    close = getattr(walk, "close", None)
    if close is not None:
        close()


def end_fruitless_walk(policy: EvictionPolicy, failed: Callable[[], None] | None) -> None:
    """Tell ``policy`` that its last walk of ``victims()`` removed nothing: the first removal
    report after a walk ends it (``EvictionPolicy.victims``), and no other would come.  The
    caller holds the lock that guards the policy.  ``failed()`` counts and logs a policy that
    raises here; None when the walk itself already failed and was counted."""
    try:
        with plugin_code():
            policy.on_keys_removed([])
    except Exception:
        if failed is not None:
            failed()


def aligned_total(sizes: Iterable[int], align: int) -> int:
    """L1 bytes a batch of objects takes (each extent rounded up to the alignment)."""
    return sum(-(-size // align) * align for size in sizes)


class ControllerThread(ABC):
    """A daemon thread running ``step`` whenever woken, one of its fds is readable, or
    ``interval_s`` has passed.

    Subclasses implement ``step(ready_fds)``, and optionally ``watched_fds``, ``busy``
    (work still outstanding, e.g. submitted L2 tasks) and ``finish`` (release whatever is
    left when the thread ends).  On ``stop`` the loop keeps stepping until ``busy`` is
    false or the drain deadline passes, then calls ``finish`` in the thread and exits.
    """

    def __init__(self, name: str, *, interval_s: float = 1.0) -> None:
        self.name = name
        self.interval_s = interval_s
        self._waker = Waker()
        self._cond = threading.Condition()
        self._requested = 0  # wake-ups asked for
        self._served = 0  # wake-ups whose step has completed
        # A step is running: ``busy`` is not trusted meanwhile.  A step may drop its record
        # of outstanding work before releasing what that work held (a reaped store task's
        # L1 locks), so ``busy`` read mid-step can say idle while locks are still held.
        self._stepping = False
        self._stopping = False
        self._drain_deadline = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.step_errors = 0
        self._finished = False
        self._exited = False  # the loop and ``finish`` are over (under ``_cond``)
        self._left = False  # ``join`` gave up on the thread: it closes the waker itself
        # A step failing on every round fails on every wake-up (each request, for some).
        self._step_failures = PolicyFailureLog(logger, "controller_step_error")

    # -- for subclasses ----------------------------------------------------------------

    def watched_fds(self) -> Iterable[int]:
        return ()

    @abstractmethod
    def step(self, ready_fds: set[int]) -> None:
        """One round of work; ``ready_fds`` are the watched fds that became readable."""

    def busy(self) -> bool:
        return False

    def finish(self) -> None:
        """Release what is still held; runs once, in the thread, as it ends."""
        return None  # optional hook: nothing held by default

    def next_step_in(self) -> float | None:
        """Seconds after which the loop should step again even if nothing wakes it
        (work held back for later); None: the regular interval."""
        return None

    @property
    def stopping(self) -> bool:
        return self._stopping

    # -- control -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        with self._cond:
            self._requested += 1
        self._waker.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every wake-up so far has been served and nothing is outstanding."""
        self.wake()
        with self._cond:
            target = self._requested
            return self._cond.wait_for(
                lambda: (
                    not self._thread.is_alive()
                    or (self._served >= target and not self._stepping and not self.busy())
                ),
                timeout,
            )

    def request_stop(self, drain_timeout_s: float = 10.0) -> None:
        """Ask the thread to finish outstanding work (up to ``drain_timeout_s``) and end."""
        with self._cond:
            if not self._stopping:
                self._stopping = True
                self._drain_deadline = time.monotonic() + drain_timeout_s
        self._waker.set()

    def join(self) -> bool:
        """Wait for the thread (after ``request_stop``); releases what it still held.

        After ``request_stop`` the wait ends ``JOIN_GRACE_S`` past the drain deadline: a
        step stuck in a backend call that never returns must not hang the shutdown that
        would interrupt that call (closing the adapters comes after).  The daemon thread
        is then left behind, logged, and ends (running ``finish``) if the call ever
        returns.  True once the thread has ended.
        """
        if self._thread.is_alive():
            timeout = None
            if self._stopping:
                timeout = max(0.0, self._drain_deadline - time.monotonic()) + JOIN_GRACE_S
            self._thread.join(timeout)
            with self._cond:
                if not self._exited:
                    # Its waker stays open: the thread still polls and drains it (a closed
                    # fd number could be reused by an unrelated file); it closes it itself.
                    self._left = True
                    logger.warning(
                        "%s: still in a step %.0f s past its drain deadline (a backend call that "
                        "does not return?); shutdown goes on without it",
                        self.name,
                        JOIN_GRACE_S,
                    )
                    return False
        elif self._thread.ident is None and not self._finished:
            self._finished = True
            self.finish()  # never started: nothing is in flight, but locks may be held
        self._waker.close()
        return True

    def stop(self, drain_timeout_s: float = 10.0) -> bool:
        self.request_stop(drain_timeout_s)
        return self.join()

    # -- the loop ----------------------------------------------------------------------

    def _step_failed(self, what: str) -> None:
        """Count and log the exception being handled, raised by a part of a round: the
        step, ``next_step_in`` or ``busy`` (the first with its traceback, later ones once
        per burst)."""
        self.step_errors += 1
        self._step_failures.failed("%s: %s failed", self.name, what)

    def _guarded_next_step_in(self) -> float | None:
        """``next_step_in``, whose exception (a bug) is a step error: the regular interval."""
        try:
            with plugin_code():
                return self.next_step_in()
        except Exception:
            self._step_failed("next_step_in")
            return None

    def _guarded_busy(self) -> bool:
        """``busy`` while stopping, whose exception (a bug) is a step error: outstanding
        work cannot be ruled out, so the drain goes on until its deadline."""
        try:
            with plugin_code():
                return self.busy()
        except Exception:
            self._step_failed("busy")
            return True

    def _run(self) -> None:
        poller = select.poll()
        waker_fd = self._waker.fileno()
        poller.register(waker_fd, select.POLLIN)
        for fd in self.watched_fds():
            poller.register(fd, select.POLLIN)
        timeout_ms = 0.0  # one step at once: a controller may have start-up work
        try:
            while True:
                events = poller.poll(timeout_ms)
                timeout_ms = self.interval_s * 1000.0
                self._waker.drain()
                with self._cond:
                    generation = self._requested
                    self._stepping = True
                try:
                    with plugin_code():  # a plugin's SystemExit would end the thread too
                        self.step({fd for fd, _ in events if fd != waker_fd})
                except Exception:
                    # A bug or an adapter raising must not kill the thread that releases
                    # everyone's locks; it is logged and counted, and the loop goes on.
                    self._step_failed("step")
                again = self._guarded_next_step_in()
                if again is not None:
                    timeout_ms = min(timeout_ms, again * 1000.0)
                if self._stopping:  # the drain deadline is kept even if nothing reports
                    timeout_ms = min(timeout_ms, max(0.0, self._drain_deadline - time.monotonic()) * 1000.0)
                with self._cond:
                    self._served = max(self._served, generation)
                    self._stepping = False
                    self._cond.notify_all()
                if self._stopping and (not self._guarded_busy() or time.monotonic() >= self._drain_deadline):
                    break
        finally:
            try:
                self.finish()
            finally:
                with self._cond:
                    self._exited = True
                    if self._left:
                        self._waker.close()
                    self._cond.notify_all()
