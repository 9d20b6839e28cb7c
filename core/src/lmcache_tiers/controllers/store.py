"""Store controller: copies committed L1 objects to the L2 adapters the store policy picks.

Each target adapter gets one store task per committed batch.  The objects are read-locked
for as long as a task may read their bytes, so eviction cannot hand the extent to another
object mid-copy; the lock is dropped when the task's result is popped (or, at shutdown,
when draining gives up).  Once every task of a batch is done, the policy may drop the
stored keys from L1 (``skip_l1``).

Write-back must not starve the data plane: the adapters' store threads run at the idle
CPU and I/O priority while write-back keeps up, at nice 10 while this controller finds it
behind -- a flush waits, the controller stops, L1 is short of room, or the store threads
wait for a core most of the time and get less of one than nice 10 would give them
(:mod:`lmcache_tiers.l2.background`) -- and while this
controller runs the interpreter hands the GIL over every ``GIL_SWITCH_S`` (CPython's default is 5 ms), so a
request arriving while a store thread runs Python waits for the GIL a fraction of a
millisecond rather than up to 5 ms, which is what the p99 of lookups and stores under
write-back used to be made of.

Write-back is also paced (:mod:`lmcache_tiers.controllers.store_pacing`): batches are cut
into slices of at most 32 MiB, two of them in flight per adapter, submitted while no client
work is in progress -- each within a deadline of its commit, and at once when objects stored in
no adapter yet hold much of L1, at shutdown and while a flush waits.

Committed objects are flagged *unstored* in L1 from their commit until their stores are
settled (stored in one adapter, or every task done), so L1 eviction takes them only as a
last resort, and counts them when it does.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_tiers.activity import DATA_PLANE, DataPlaneActivity
from lmcache_tiers.burst import BurstLog
from lmcache_tiers.controllers.base import AdapterSlot, ControllerThread, TaskTracker, adapter_infos
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.controllers.store_pacing import (
    STALLED_S,
    STARVE_WINDOW_S,
    Slice,
    WriteBackPacer,
    slices_of,
    starved,
)
from lmcache_tiers.errors import plugin_code
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object
from lmcache_tiers.l2.background import WRITE_BACK, BackgroundThreads
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.policies import StorePolicy

logger = logging.getLogger(__name__)

#: longest a thread keeps the GIL while another waits for it, while write-back runs
GIL_SWITCH_S = 0.0005


@dataclass(eq=False)
class _Batch:
    objects: dict[ObjectKey, L1Object]  # committed objects flagged unstored, prefix order
    tasks_left: int = 0
    stored: set[ObjectKey] = field(default_factory=set)  # in at least one adapter
    # (adapter index, key) stored again after meeting an L2 delete of the key: once only
    retried: set[tuple[int, ObjectKey]] = field(default_factory=set)


@dataclass(eq=False)
class _Task:
    slot: AdapterSlot
    task_id: int
    keys: list[ObjectKey]
    objects: list[L1Object]  # of ``keys``: locked for the store (``reserve_store``) until it reports
    batch: _Batch
    nbytes: int  # of the slice, as the pacer counted it in flight
    submitted: float  # monotonic time it was handed to the adapter
    deletes_seen: int  # its adapter's ``deletes.events`` then: deletes it may have met end later
    released: bool = False  # ``objects`` given back (``finish_store``)
    paced: bool = False  # ``nbytes`` reported to the pacer as no longer in flight
    ended: bool = False  # no longer counted in ``batch.tasks_left``


class StoreController(ControllerThread):
    """Thread that turns committed writes into L2 store tasks and reaps their results."""

    def __init__(
        self,
        l1: L1Manager,
        slots: Sequence[AdapterSlot],
        policy: StorePolicy,
        stats: EngineStats,
        activity: DataPlaneActivity = DATA_PLANE,
        threads: BackgroundThreads = WRITE_BACK,
    ) -> None:
        super().__init__("l2-store")
        self.l1 = l1
        self.slots = list(slots)
        self.policy = policy
        self.stats = stats
        self._burst = BurstLog(logger)  # failed stores: one line per adapter per minute
        self._queue_lock = threading.Lock()
        self._queue: deque[tuple[list[L1Object], float]] = deque()  # (objects, commit time)
        self._starting = 0  # batches taken off the queue whose slices are not queued yet
        self._ended = False  # ``finish`` emptied the queue: nothing queued now is ever stored
        # Whoever counts the writes left unstored at the end: ``finish``, or the close
        # that went on without a thread stuck in a step (``count_left_behind``).  Claimed
        # once, under the queue lock, so that no write is counted twice or not at all.
        self._end_counted = False
        self._urgent = 0  # flushes waiting: write-back defers to nobody meanwhile
        self._pacer = WriteBackPacer(
            activity,
            l1.capacity_bytes,
            lambda: stats.failures().get("evicted_before_l2_store", 0),
            lambda: l1.unstored_bytes,
        )
        self._waiting_slices = 0  # len(self._pacer), readable from any thread
        # per adapter: its slices' bytes added (``added_bytes_of``) at its last look through them
        self._pruned_at: dict[int, int] = {}
        self._step_in: float | None = None
        self._threads = threads  # the write-back threads' priority, raised while behind
        self._starved = False  # the threads were short of CPU; until no task is left
        self._window: tuple[float, tuple[float, float] | None] | None = None  # (start, cpu_s then)
        # The objects of store tasks submitted and not yet given back, by task: a close that
        # goes on without this thread (``count_left_behind``) reads them from its own thread,
        # so they are kept apart from ``_tasks`` under a lock of their own.
        self._running_lock = threading.Lock()
        self._running: dict[int, list[L1Object]] = {}
        # touched by the controller thread only
        self._tasks = TaskTracker[_Task, list[bool]](
            L2Op.STORE, lambda adapter: adapter.pop_completed_stores(), stats
        )
        self._fd_slot = {slot.adapter.event_fd(L2Op.STORE): slot for slot in self.slots}
        # Keys to store again once the L2 eviction deleting them ended (``_store_again``),
        # one slice per failed task; they go to the pacer then.
        self._after_delete: list[Slice] = []
        for slot in self.slots:
            slot.deletes.on_end = self.wake

    def start(self) -> None:
        if self.slots and sys.getswitchinterval() > GIL_SWITCH_S:
            # Process-wide, and left so: other controllers and adapters' threads gain too.
            sys.setswitchinterval(GIL_SWITCH_S)
        super().start()

    # -- called from other threads -----------------------------------------------------

    def queue(self, keys: Sequence[ObjectKey]) -> bool:
        """Queue freshly committed keys (prefix order) for L2; True if the thread is to be
        woken for them, and the caller then calls :meth:`wake` -- once it has let go of
        the L1 lock, which the woken thread takes at once to start the stores.

        The caller holds the L1 lock around their commit and this call, so eviction never
        sees a committed object before it is flagged unstored.

        False when a batch was queued already: whoever queued it wakes the thread (or
        did), and a step empties the whole queue, so a second wake-up (a system call,
        and a switch to the controller thread) would only add an idle step."""
        if not keys or not self.slots:
            return False  # nothing is meant for L2: the objects are as evictable as any
        objects = self.l1.mark_unstored(keys)
        if not objects:
            return False
        with self._queue_lock:
            ended = self._ended
            if not ended:
                wake_due = not self._queue
                self._queue.append((objects, time.monotonic()))
        if ended:
            # A commit that passed the open check as shutdown began, arriving after the
            # drain: queued, it would wait for a thread that is gone, uncounted.
            self.l1.settle_unstored(objects)
            self.stats.fail("l2_store_dropped_at_shutdown", len(objects))
            self._burst.warn(
                "l2_store_dropped_at_shutdown",
                "%d committed keys were never stored in L2: the controller stopped first",
                len(objects),
                count=len(objects),
            )
            return False
        return wake_due

    def pending_batches(self) -> int:
        """Work not yet handed to the adapters: queued batches (one being started counts)
        and slices waiting for their turn."""
        with self._queue_lock:
            return len(self._queue) + self._starting + self._waiting_slices

    def in_flight(self) -> int:
        return len(self._tasks)

    def deferrals(self) -> int:
        """Times a slice was held back because client work was in progress."""
        return self._pacer.deferrals

    def busy(self) -> bool:
        return bool(self._tasks) or self.pending_batches() > 0

    def wait_idle(self, timeout: float | None = None) -> bool:
        # Whoever waits for L2 wants it done: nothing is held back for client work meanwhile.
        with self._queue_lock:
            self._urgent += 1
        try:
            return super().wait_idle(timeout)
        finally:
            with self._queue_lock:
                self._urgent -= 1

    # -- the thread --------------------------------------------------------------------

    def watched_fds(self) -> Iterable[int]:
        return self._fd_slot

    def step(self, ready_fds: set[int]) -> None:
        # Results first: they release locks and may let L1 delete objects.
        slots = self.slots if self.stopping else [self._fd_slot[fd] for fd in ready_fds]
        for slot in slots:
            if self._left_behind():
                return
            self._reap(slot)
        while True:
            with self._queue_lock:
                if not self._queue or self._end_counted:
                    break
                objects, committed = self._queue.popleft()
                self._starting = 1
            try:
                self._start_batch(objects, committed)
            finally:
                with self._queue_lock:  # never seen as idle between the two counts
                    self._waiting_slices = self._waiting_count()
                    self._starting = 0
        if self._left_behind():
            return
        self._forget_deletes()
        self._release_after_delete()
        self._prune_backlogs()
        self._submit_slices()

    def _waiting_count(self) -> int:
        return len(self._pacer) + len(self._after_delete)

    def _forget_deletes(self) -> None:
        """Forget, in every adapter, the deletes that ended before each of its running store
        tasks was submitted: they met none of them.  Every step, not only as an adapter's
        stores complete: an adapter whose eviction deletes while nothing is stored there
        would keep them (``ENDED_MAX`` keys) for stores never made; a delete's end wakes
        this thread (``deletes.on_end``)."""
        seen: dict[int, int] = {}
        for task in self._tasks.owners():
            index = task.slot.index
            seen[index] = min(seen.get(index, task.deletes_seen), task.deletes_seen)
        for slot in self.slots:
            slot.deletes.forget_before(seen.get(slot.index))

    def _release_after_delete(self) -> None:
        """Hand the pacer the slices of keys stored again whose deletes have ended, and give
        up the keys of those whose delete is past its deadline (``_give_up_after_delete``)."""
        if not self._after_delete:
            return
        waiting: list[Slice] = []
        for piece in self._after_delete:
            deletes = piece.slot.deletes
            if deletes.running(piece.keys):
                hung = deletes.hung(piece.keys)
                if not hung:
                    waiting.append(piece)  # its end or its deadline wakes this thread (``deletes.on_end``)
                    continue
                piece = self._give_up_after_delete(piece, set(hung))
                if not piece.keys:
                    self._part_ended(piece.batch)
                    continue
                if deletes.running(piece.keys):
                    waiting.append(piece)
                    continue
                # The deletes of the rest have all ended: no end would wake this thread for it.
            self._pacer.add(piece)
        self._after_delete = waiting

    def _give_up_after_delete(self, piece: Slice, hung: set[ObjectKey]) -> Slice:
        """Give up storing the keys of ``piece`` in ``hung``, which wait for an L2 delete past
        its deadline (the backend may never answer): counted and logged as failed stores, their
        objects left in L1 (and in the adapters that stored them, if any).  Waiting on, they
        would hold a flush, and a stop's, until its deadline; and they cannot be stored while
        that delete runs -- the adapter refuses them, and one that landed before the delete
        would be removed by it.  Returns the rest of the slice."""
        slot, batch = piece.slot, piece.batch
        given_up = [key for key in piece.keys if key in hung]
        kept = [key for key in piece.keys if key not in hung]
        self.stats.add_adapter(slot.index, "keys_store_failed", len(given_up))
        self.stats.fail("l2_store_given_up_delete_hung", len(given_up))
        self._burst.warn(
            f"l2_store_given_up_delete_hung:{slot.index}",
            "%d keys were not stored in %s: they wait for an L2 eviction's delete there that is "
            "past its deadline; they are left in L1 and in the adapters that stored them",
            len(given_up),
            slot.name,
            count=len(given_up),
        )
        nbytes = sum(batch.objects[key].size for key in kept)
        return Slice(slot, kept, nbytes, batch, piece.committed)

    def _prune_backlogs(self) -> None:
        """Drop the waiting slices of an adapter slower than the writes whose objects all
        left L1.  Stored by the other adapters, such objects are evicted like any stored
        one, while their slices for the slow adapter wait their turn behind its bound in
        flight: as long as it stays behind, they would pile up without end.  The objects a
        waiting slice still finds in L1 take at most L1's bytes, so an adapter's slices are
        looked through once they hold more than twice that, and again only once L1's bytes
        more were added since the last look: a look costs no more per slice than the slices
        added since the last.
        Counted from what was added, not from what the last look kept (which may be more
        than L1's bytes: a slice stays for one object still in L1), so that the bound is
        twice L1's bytes again once the adapter caught up, whatever an earlier look kept."""
        capacity = self.l1.capacity_bytes
        dropped: list[Slice] = []
        for slot in self.slots:
            index = slot.index
            added = self._pacer.added_bytes_of(index)
            if self._pacer.waiting_bytes_of(index) <= 2 * capacity:
                continue
            if added - self._pruned_at.get(index, 0) <= capacity:
                continue
            self._pruned_at[index] = added
            # Not under the L1 lock: twice L1's bytes of slices can name a hundred thousand
            # keys, tens of ms every store and lookup would wait.  Each key is judged alone
            # (``_still_has_an_object``), which is enough: an object that left L1 never
            # comes back, so a slice found with none left has none for good.
            dropped += self._pacer.prune(index, self._still_has_an_object)
        for piece in dropped:
            # As when ``_submit`` finds them gone; why they left was counted then.
            self.stats.add("l2_store_skipped_gone", len(piece.keys))
            self._part_ended(piece.batch)
        if dropped:
            logger.debug("dropped %d waiting store slices whose objects all left L1", len(dropped))

    def _still_has_an_object(self, piece: Slice) -> bool:
        """Whether L1 still holds one of ``piece``'s objects (each looked up on its own)."""
        get, objects = self.l1.get, piece.batch.objects
        return any(get(key) is objects[key] for key in piece.keys)

    def _left_behind(self) -> bool:
        """The close went on without this step (stuck in a call that returned since) and
        counted everything it left unstored: L1 and the adapters are closed or closing, so
        the step stops wherever it is -- another call would fail on the closed L1, or store
        (and count) writes already counted as abandoned."""
        return self._end_counted  # set by ``finish`` only once the loop is over

    def next_step_in(self) -> float | None:
        return self._step_in

    def _submit_slices(self) -> None:
        urgent = self.stopping or self._urgent > 0
        while True:
            pieces, self._step_in = self._pacer.take(urgent=urgent)
            tasks = 0
            for piece in pieces:
                if self._left_behind():
                    return  # the pieces taken are dropped: the close counted their objects
                tasks += self._submit(piece)
            # A slice that became no task (its objects left L1, its submit failed) gave its
            # room in flight back at once, and no adapter will report it: the slices behind
            # it are taken now, not at the next wake-up -- which, with nothing in flight,
            # is the next commit or the controller's interval, slice after slice.
            if tasks == len(pieces):
                break
        self._waiting_slices = self._waiting_count()
        self._pace_threads(urgent or self._pacer.pressed)

    def _pace_threads(self, behind: bool) -> None:
        """Idle write-back threads while write-back keeps up; nice 10 while it is behind,
        or once the threads turn out starved of CPU, until their tasks are done."""
        if not self._tasks:
            self._starved, self._window = False, None
        elif not self._starved:
            self._starved = self._starving(time.monotonic())
        self._threads.hurry(behind or self._starved, self)

    def _starving(self, now: float) -> bool:
        window = self._window
        if window is None:
            self._window = (now, self._threads.cpu_s())
            self._look_again(STARVE_WINDOW_S)
            return False
        began, before = window
        if now - began < STARVE_WINDOW_S:
            self._look_again(began + STARVE_WINDOW_S - now)
            return False
        after = self._threads.cpu_s()
        self._window = (now, after)
        self._look_again(STARVE_WINDOW_S)
        if before is None or after is None:  # no run-queue figures: a task's age decides
            return min(task.submitted for task in self._tasks.owners()) + STALLED_S <= now
        return starved(after[0] - before[0], after[1] - before[1], now - began)

    def _look_again(self, seconds: float) -> None:
        self._step_in = seconds if self._step_in is None else min(self._step_in, seconds)

    def _start_batch(self, objects: list[L1Object], committed: float) -> None:
        batch = _Batch({obj.key: obj for obj in objects})
        keys = list(batch.objects)
        try:
            # A third-party policy's malformed answer (not a mapping, an index that is not an
            # int, keys that cannot be hashed) is its failure too: caught here, not as a
            # failed controller step that would leave the objects waiting for ever.
            with plugin_code():
                plan = _store_plan(self.policy.select_store_targets(keys, adapter_infos(self.slots)))
        except Exception:
            logger.exception("store policy failed on %d keys; they stay in L1 only", len(keys))
            self.stats.fail("store_policy_error")
            self.l1.settle_unstored(objects)
            return
        wanted = batch.objects
        targeted: set[ObjectKey] = set()
        for index, target_keys in plan:
            if not 0 <= index < len(self.slots):
                self.stats.fail("store_policy_bad_adapter", len(target_keys))
                self._burst.warn(
                    "store_policy_bad_adapter",
                    "store policy sent %d keys to adapter %r, and there are %d adapters: not stored there",
                    len(target_keys),
                    index,
                    len(self.slots),
                )
                continue
            chosen = [key for key in target_keys if key in wanted]
            if len(chosen) < len(target_keys):
                self._stray_keys(len(target_keys) - len(chosen), index)
            if chosen:
                targeted.update(chosen)
                slot = self.slots[index]
                for run in slices_of([wanted[key] for key in chosen]):
                    nbytes = sum(obj.size for obj in run)
                    self._pacer.add(Slice(slot, [obj.key for obj in run], nbytes, batch, committed))
                    batch.tasks_left += 1  # a slice counts as a task from now on
        # Keys the policy sends nowhere are not meant for L2: nothing to wait for.  They
        # were committed for L2, so the policy's choice is counted and explained: once L1
        # evicts them they are gone.
        untargeted = [obj for key, obj in wanted.items() if key not in targeted]
        if untargeted:
            self.stats.fail("store_policy_untargeted", len(untargeted))
            self._burst.warn(
                "store_policy_untargeted",
                "store policy sent %d of %d committed keys to no adapter: they stay in L1 only",
                len(untargeted),
                len(wanted),
                count=len(untargeted),
            )
        self.l1.settle_unstored(untargeted)
        if batch.tasks_left == 0:
            self._finish_batch(batch)

    def _stray_keys(self, count: int, index: int) -> None:
        """A policy answer naming keys it was not given: nothing to store for them --
        counted and explained, as the policy's fault."""
        self.stats.fail("store_policy_bad_key", count)
        self._burst.warn(
            "store_policy_bad_key",
            "store policy sent adapter %d %d keys that are not in its batch: ignored",
            index,
            count,
            count=count,
        )

    def _submit(self, piece: Slice) -> bool:
        """Hand ``piece`` to its adapter as a store task; False if it became none."""
        slot, batch = piece.slot, piece.batch
        # Keys deleted or evicted since their commit are simply not stored.
        locked = self.l1.reserve_store(piece.keys)
        # Locked by key: a key whose object left L1 and was written again since is another
        # object (an L1-only one, or one with its own batch), not this batch's to store.
        others = [obj for key, obj in locked.items() if obj is not batch.objects.get(key)]
        if others:
            self.l1.finish_store(others)
            for obj in others:
                del locked[obj.key]
        keys = [key for key in piece.keys if key in locked]
        if len(keys) < len(piece.keys):
            # Why they left (evicted before their store, cleared) was counted there.
            self.stats.add("l2_store_skipped_gone", len(piece.keys) - len(keys))
        if not keys:
            self._slice_ended(piece)
            return False
        objects, buffers = self._lend(slot, [locked[key] for key in keys])
        keys = [obj.key for obj in objects]
        if not objects:
            self._slice_ended(piece)
            return False
        deletes_seen = slot.deletes.events  # read before the store can meet a delete
        try:
            layouts = [obj.layout for obj in objects]
            task_id = slot.adapter.submit_store(keys, buffers, layouts if any(layouts) else None)
        except Exception as exc:
            self.l1.finish_store(objects)
            self.stats.add_adapter(slot.index, "store_tasks_failed")
            self.stats.add_adapter(slot.index, "keys_store_failed", len(keys))
            self.stats.fail("l2_store_submit_error", len(keys))  # keys, as l2_store_failed
            # An adapter refusing submits refuses every slice: one line per burst, each counted.
            self._burst.warn(
                f"l2_store_submit_error:{slot.index}",
                "store of %d keys to %s could not be submitted: %s",
                len(keys),
                slot.name,
                exc,
            )
            self._slice_ended(piece)
            return False
        task = _Task(slot, task_id, keys, objects, batch, piece.nbytes, time.monotonic(), deletes_seen)
        self._tasks.track(slot, task_id, task)
        with self._running_lock:
            self._running[id(task)] = objects
        self.stats.add_adapter(slot.index, "store_tasks_submitted")
        logger.debug("Submitted store task %d to %s: %d keys", task_id, slot.name, len(keys))
        return True

    def _lend(self, slot: AdapterSlot, objects: list[L1Object]) -> tuple[list[L1Object], list[memoryview]]:
        """The objects whose bytes L1 lends, with their buffers.  The loans live as long as
        the task: the store's locks keep their bytes in place.  L1 refuses an object whose
        bytes it cannot vouch for (an NVMe L1 write-back error, KeyError): it has left L1,
        counted and logged there (so is one whose NVMe L1 file answered EIO).  One whose
        bytes cannot be read for another reason fails its own store, counted and logged
        here.  Either way its store lock is given back and the others are stored all the same."""
        lent: list[L1Object] = []
        buffers: list[memoryview] = []
        refused: list[L1Object] = []
        unreadable: list[L1Object] = []
        for obj in objects:
            try:
                buffers.append(self.l1.lend(obj).buffer)
            except KeyError:
                refused.append(obj)
            except Exception as exc:
                unreadable.append(obj)
                self._burst.warn(
                    f"l2_store_lend_error:{slot.index}",
                    "%s not stored in %s: its bytes could not be read from L1: %s: %s",
                    obj.key.file_stem(),
                    slot.name,
                    type(exc).__name__,
                    exc,
                )
            else:
                lent.append(obj)
        if refused or unreadable:
            self.l1.finish_store(refused + unreadable)
        if refused:
            self.stats.add("l2_store_skipped_gone", len(refused))
        if unreadable:
            # As a slice that could not be submitted, for these keys only.
            self.stats.add_adapter(slot.index, "keys_store_failed", len(unreadable))
            self.stats.fail("l2_store_submit_error", len(unreadable))
        return lent, buffers

    def _slice_ended(self, piece: Slice) -> None:
        """A slice that never became a task: its batch stops waiting for it."""
        self._pacer.reported(piece.slot.index, piece.nbytes)
        self._part_ended(piece.batch)

    def _reap(self, slot: AdapterSlot) -> None:
        for task, results in self._tasks.reap(slot):
            if self._left_behind():
                return  # the close counted their objects; L1 is closed or closing
            try:
                self._complete(task, results)
            except Exception:
                # One task's failure must not strand the others' results, nor this task's
                # store locks, which no TTL reaps.
                logger.exception("%s: finishing store task %d failed", slot.name, task.task_id)
                self.stats.fail("l2_store_complete_error")
                if not task.released:
                    self._release(task)
                if not task.paced:
                    task.paced = True
                    self._pacer.reported(task.slot.index, task.nbytes)
                if not task.ended:
                    # Nor its batch: until the batch ends, its objects stay flagged as L1's
                    # only copy (evicted last, counted as lost writes when they go).
                    try:
                        self._task_ended(task)
                    except Exception:
                        logger.exception(
                            "%s: finishing the batch of store task %d failed", slot.name, task.task_id
                        )

    def _complete(self, task: _Task, results: Sequence[bool]) -> None:
        stored = [key for key, ok in zip(task.keys, results, strict=False) if ok]
        batch = task.batch
        # In L2 now: evictable like any object, whatever other adapters still do.  Settled
        # before the read locks go: in between, a write needing room could evict them and
        # count acknowledged writes that L2 holds as lost.
        self.l1.settle_unstored([batch.objects[key] for key in stored if key in batch.objects])
        self._release(task)
        task.paced = True
        self._pacer.reported(task.slot.index, task.nbytes)
        done = set(stored)
        again = self._store_again([key for key in task.keys if key not in done], task)
        failed = len(task.keys) - len(stored) - len(again)
        index = task.slot.index
        self.stats.add_adapter(index, "store_tasks_completed")
        self.stats.add_adapter(index, "keys_stored", len(stored))
        if failed:
            self.stats.add_adapter(index, "store_tasks_failed")
            self.stats.add_adapter(index, "keys_store_failed", failed)
            self.stats.fail("l2_store_failed", failed)
            self._burst.warn(
                f"l2_store_failed:{index}",
                "%d of %d keys were not stored in %s (the adapter's own counters and log say why)",
                failed,
                len(task.keys),
                task.slot.name,
                count=failed,
            )
        logger.debug(
            "L2 store task %d completed on %s: %d/%d keys stored",
            task.task_id,
            task.slot.name,
            len(stored),
            len(task.keys),
        )
        batch.stored.update(stored)
        self._task_ended(task)

    def _store_again(self, failed: list[ObjectKey], task: _Task) -> list[ObjectKey]:
        """Queue again, once, the keys of ``failed`` that met an L2 eviction deleting them
        in the task's adapter (which refuses such a store, ``store_skipped_deleting``) and
        whose objects L1 still holds; returns them.  Their batch waits for the new slice:
        an object stored nowhere stays flagged unstored (evicted last, counted if lost)
        meanwhile -- ended without it, it would be an acknowledged write an L1 eviction
        drops silently.  The slice goes to the pacer once the delete ended
        (``_release_after_delete``): stored before, it would be refused again."""
        slot, batch = task.slot, task.batch
        index = slot.index
        candidates = [key for key in failed if (index, key) not in batch.retried and key in batch.objects]
        if not candidates:
            return []
        get = self.l1.get
        again = [
            key for key in slot.deletes.raced(candidates, task.deletes_seen) if get(key) is batch.objects[key]
        ]
        if not again:
            return []
        batch.retried.update((index, key) for key in again)
        nbytes = sum(batch.objects[key].size for key in again)
        self._after_delete.append(Slice(slot, again, nbytes, batch, time.monotonic()))
        batch.tasks_left += 1  # a slice counts as a task from now on
        self.stats.fail("l2_store_retried_after_delete", len(again))
        self._burst.warn(
            f"l2_store_retried_after_delete:{index}",
            "%d keys were not stored in %s: an L2 eviction was deleting them there; "
            "they are stored again once that delete ended",
            len(again),
            slot.name,
            count=len(again),
        )
        return again

    def _release(self, task: _Task) -> None:
        """Give the task's store locks back: its objects are no longer a running store's."""
        task.released = True
        with self._running_lock:
            self._running.pop(id(task), None)
        self.l1.finish_store(task.objects)

    def _task_ended(self, task: _Task) -> None:
        task.ended = True
        self._part_ended(task.batch)

    def _part_ended(self, batch: _Batch) -> None:
        """One of ``batch``'s slices is over (stored, failed, or never submitted)."""
        batch.tasks_left -= 1
        if batch.tasks_left == 0:
            self._finish_batch(batch)

    def _finish_batch(self, batch: _Batch) -> None:
        # Failed stores were counted as they completed; nothing more will try these.
        self.l1.settle_unstored(batch.objects.values())
        # A key stored in at least one adapter can be served from L2 again, so it is
        # safe for the policy to drop it from L1.
        stored = [key for key in batch.objects if key in batch.stored]
        if not stored:
            return
        try:
            with plugin_code():
                doomed = list(dict.fromkeys(self.policy.select_l1_deletions(stored)))
        except Exception:  # raised, or an answer that is not an iterable of keys
            logger.exception("store policy failed to select L1 deletions")
            self.stats.fail("store_policy_error")
            return
        with self.l1.lock:
            # This batch's objects only: a key written again since (evicted, then re-written
            # with new bytes) is another object, whose own store may not have run -- deleting
            # it would lose an acknowledged write and leave L2's older bytes to be served.
            doomed = [key for key in doomed if key in batch.stored and self.l1.get(key) is batch.objects[key]]
            if not doomed:
                return
            deleted = self.l1.delete(doomed)
            # Objects someone is reading right now cannot go yet; marking them temporary
            # frees them when their last reader releases them.
            busy = [key for key, gone in zip(doomed, deleted, strict=True) if not gone]
            if busy:
                self.l1.set_temporary(busy, True)
        self.stats.add("l1_deleted_after_store", sum(deleted))

    def count_left_behind(self) -> None:
        """The close goes on without this thread, stuck in a step (``join`` gave up): count
        and log every committed object L1 still holds unstored, and every object of a store
        task still running whether L1 holds it or not, as ``finish`` would have,
        before L1 closes -- the step may never return.  From any thread; does nothing if
        ``finish`` is counting already.  Those objects are settled, and ``finish``, if the
        step returns after all, counts nothing again."""
        with self._queue_lock:
            if self._end_counted:
                return
            self._end_counted = True
            self._ended = True  # a commit arriving from now on counts itself (``submit``)
        with self._running_lock:
            running = [obj for objects in self._running.values() for obj in objects]
        with self.l1.lock:
            # With those of running stores, which will never report now: a forced clear that
            # took one of them from L1 left counting its loss to the store (``obj.storing``).
            # Each object once (a store per adapter), and none settled already (stored in
            # an adapter, or counted by its batch's end).
            left = list({id(obj): obj for obj in [*self.l1.unstored(), *running] if obj.unstored}.values())
            self.l1.settle_unstored(left)
        if left:
            self.stats.fail("l2_store_abandoned", len(left))
            logger.warning(
                "%d committed objects were never stored in L2: the store controller is stuck in a "
                "step (a backend or policy call that does not return) and L1 closes without it",
                len(left),
            )

    def finish(self) -> None:
        self._threads.hurry(False, self)  # a stopped controller hurries nobody
        with self._queue_lock:
            # Claimed before anything is settled: a close counting meanwhile would miss
            # what is settled here and not counted yet.
            counting = not self._end_counted
            self._end_counted = True
        if not counting and self.l1.closed:
            # Left behind by a close that counted what it held and closed L1: nothing
            # is left to release.
            self._tasks.clear()
            with self._running_lock:
                self._running.clear()
            self._pacer.drop_all()
            self._after_delete.clear()
            return
        # Draining gave up (stalled adapter) or finished: release every lock still held.
        # Both counters count objects stored in no adapter, each once: the default store
        # policy sends every key to every adapter, and a key another adapter stored (or
        # whose other task was abandoned too) is not one more object missing from L2.
        abandoned: dict[int, L1Object] = {}
        # Their objects settled only once counted below: an object settled first could be
        # evicted in between as if stored (uncounted), and would then be skipped as gone.
        ended: dict[int, _Batch] = {}
        # Their store locks are given back only once their objects are settled: an object
        # unlocked but still flagged unstored could be evicted in between, counted lost by
        # the eviction (``evicted_before_l2_store``) and again as abandoned below.
        holding: list[_Task] = []
        for task in self._tasks.owners():
            if not task.released:
                holding.append(task)
            ended[id(task.batch)] = task.batch
            self.stats.add_adapter(task.slot.index, "store_tasks_failed")
            for key in task.keys:
                if key not in task.batch.stored and key in task.batch.objects:
                    obj = task.batch.objects[key]
                    abandoned[id(obj)] = obj
        self._tasks.clear()
        # Slices never submitted: counted once per object not stored in any adapter (and
        # not counted as abandoned above).  Their batches end here too: a key of one whose
        # store already failed (counted then) is in no slice left, and would otherwise stay
        # flagged as L1's only copy, counted lost again by an eviction before L1 closes.
        unsent: dict[int, L1Object] = {}
        after_delete, self._after_delete = self._after_delete, []
        dropped = [*self._pacer.drop_all(), *after_delete]
        for piece in dropped:
            ended[id(piece.batch)] = piece.batch
            for key in piece.keys:
                if key not in piece.batch.stored:
                    obj = piece.batch.objects[key]
                    if id(obj) not in abandoned:
                        unsent[id(obj)] = obj
        self._waiting_slices = 0
        with self._queue_lock:
            queued = [obj for objects, _ in self._queue for obj in objects]
            self._queue.clear()
            self._ended = True
        queued += unsent.values()
        with self.l1.lock:
            # Which ones are still in L1 and their settling in one step: until settled an
            # eviction of one counts it lost (``evicted_before_l2_store``), after it none.
            # Abandoned ones all count: an object a running store locks leaves L1 only by
            # force -- a forced clear, which leaves the store to count a loss, or an NVMe L1
            # write-back error, which counts the dropped copy, not the missing L2 one.
            try:
                queued = list(self._still_in_l1({id(obj): obj for obj in queued}, dropped).values())
                self.l1.settle_unstored([obj for batch in ended.values() for obj in batch.objects.values()])
                self.l1.settle_unstored(queued)
            finally:
                for task in holding:
                    self._release(task)
        if not counting:
            return  # counted by the close that went on without this thread
        if abandoned:
            self.stats.fail("l2_store_abandoned", len(abandoned))
            logger.warning(
                "%d objects' L2 stores were still running when the drain gave up on them", len(abandoned)
            )
        if queued:
            self.stats.fail("l2_store_dropped_at_shutdown", len(queued))
            logger.warning(
                "%d committed keys were never stored in L2: the controller stopped first", len(queued)
            )

    def _still_in_l1(self, objects: dict[int, L1Object], slices: Sequence[Slice]) -> dict[int, L1Object]:
        """Those of ``objects`` still in L1: one that left it (cleared, evicted, deleted,
        written again) was counted then if its write was lost, and is skipped as gone, as
        while running -- once per key of each of the ``slices`` given up (once per adapter
        it was meant for, as ``_submit`` counts it), once for an object of a batch never
        started.  Once L1 is closed nothing tells them apart: all count."""
        with self.l1.lock:
            if self.l1.closed:
                return objects
            get = self.l1.get
            kept = {ident: obj for ident, obj in objects.items() if get(obj.key) is obj}
            in_slices = {id(piece.batch.objects[key]) for piece in slices for key in piece.keys}
            gone = sum(1 for ident in objects.keys() - kept.keys() if ident not in in_slices)
            gone += sum(
                1 for piece in slices for key in piece.keys if get(key) is not piece.batch.objects[key]
            )
        if gone:
            self.stats.add("l2_store_skipped_gone", gone)
        return kept


def _store_plan(targets: Any) -> list[tuple[int, list[ObjectKey]]]:
    """A store policy's answer as (adapter index, distinct keys) pairs; raises TypeError for
    an answer of the wrong shape."""
    if not isinstance(targets, Mapping):
        raise TypeError(f"select_store_targets returned {type(targets).__name__}, not a mapping")
    plan = []
    for index, keys in targets.items():
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"select_store_targets named adapter {index!r}, not an int index")
        plan.append((index, list(dict.fromkeys(keys))))
    return plan
