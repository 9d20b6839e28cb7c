"""Store controller: copies committed L1 objects to the L2 adapters the store policy picks.

Each target adapter gets one store task per committed batch.  The objects are read-locked
for as long as a task may read their bytes, so eviction cannot hand the extent to another
object mid-copy; the lock is dropped when the task's result is popped (or, at shutdown,
when draining gives up).  Once every task of a batch is done, the policy may drop the
stored keys from L1 (``skip_l1``).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lmcache_tiers.controllers.base import AdapterSlot, ControllerThread, adapter_infos
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, L1Object, aligned_buffer
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.policies import StorePolicy

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Batch:
    keys: list[ObjectKey]
    tasks_left: int = 0
    stored: set[ObjectKey] = field(default_factory=set)  # in at least one adapter


@dataclass(eq=False)
class _Task:
    slot: AdapterSlot
    task_id: int
    keys: list[ObjectKey]  # read-locked once each until the result is popped
    batch: _Batch


class StoreController(ControllerThread):
    """Thread that turns committed writes into L2 store tasks and reaps their results."""

    def __init__(
        self,
        l1: L1Manager,
        slots: Sequence[AdapterSlot],
        policy: StorePolicy,
        stats: EngineStats,
    ) -> None:
        super().__init__("l2-store")
        self.l1 = l1
        self.slots = list(slots)
        self.policy = policy
        self.stats = stats
        self._queue_lock = threading.Lock()
        self._queue: deque[list[ObjectKey]] = deque()
        # (adapter index, task id) -> task; touched by the controller thread only
        self._tasks: dict[tuple[int, int], _Task] = {}
        self._fd_slot = {slot.adapter.event_fd(L2Op.STORE): slot for slot in self.slots}

    # -- called from other threads -----------------------------------------------------

    def submit(self, keys: Sequence[ObjectKey]) -> None:
        """Queue freshly committed keys (prefix order) for L2."""
        if not keys or not self.slots:
            return
        with self._queue_lock:
            self._queue.append(list(keys))
        self.wake()

    def pending_batches(self) -> int:
        with self._queue_lock:
            return len(self._queue)

    def in_flight(self) -> int:
        return len(self._tasks)

    def busy(self) -> bool:
        return bool(self._tasks) or self.pending_batches() > 0

    # -- the thread --------------------------------------------------------------------

    def watched_fds(self) -> Iterable[int]:
        return self._fd_slot

    def step(self, ready_fds: set[int]) -> None:
        # Results first: they release locks and may let L1 delete objects.
        slots = self.slots if self.stopping else [self._fd_slot[fd] for fd in ready_fds]
        for slot in slots:
            self._reap(slot)
        while True:
            with self._queue_lock:
                if not self._queue:
                    break
                keys = self._queue.popleft()
            self._start_batch(keys)

    def _start_batch(self, keys: list[ObjectKey]) -> None:
        try:
            targets = self.policy.select_store_targets(keys, adapter_infos(self.slots))
        except Exception:
            logger.exception("store policy failed on %d keys; they stay in L1 only", len(keys))
            self.stats.fail("store_policy_error")
            return
        batch = _Batch(keys)
        wanted = set(keys)
        for index, target_keys in targets.items():
            if not 0 <= index < len(self.slots):
                self.stats.fail("store_policy_bad_adapter")
                continue
            chosen = [key for key in dict.fromkeys(target_keys) if key in wanted]
            if chosen:
                self._submit(self.slots[index], chosen, batch)
        if batch.tasks_left == 0:
            self._finish_batch(batch)

    def _submit(self, slot: AdapterSlot, keys: list[ObjectKey], batch: _Batch) -> None:
        # Keys deleted or evicted since their commit are simply not stored.
        locked = self.l1.reserve_read(keys)
        keys = [key for key in keys if key in locked]
        if not keys:
            return
        try:
            if self.l1.is_memory:
                buffers = [self.l1.view(locked[key]) for key in keys]
            else:
                buffers = [_copy_out(self.l1, locked[key]) for key in keys]
            layouts = [locked[key].layout for key in keys]
            task_id = slot.adapter.submit_store(keys, buffers, layouts if any(layouts) else None)
        except Exception as exc:
            self.l1.finish_read(keys)
            self.stats.add_adapter(slot.index, "store_tasks_failed")
            self.stats.add_adapter(slot.index, "keys_store_failed", len(keys))
            self.stats.fail("l2_store_submit_error")
            logger.warning("store of %d keys to %s could not be submitted: %s", len(keys), slot.name, exc)
            return
        self._tasks[(slot.index, task_id)] = _Task(slot, task_id, keys, batch)
        batch.tasks_left += 1
        self.stats.add_adapter(slot.index, "store_tasks_submitted")
        logger.debug("Submitted store task %d to %s: %d keys", task_id, slot.name, len(keys))

    def _reap(self, slot: AdapterSlot) -> None:
        try:
            completed = slot.adapter.pop_completed_stores()
        except Exception:
            logger.exception("%s: popping store results failed", slot.name)
            self.stats.fail("l2_store_pop_error")
            return
        for task_id, results in completed.items():
            task = self._tasks.pop((slot.index, task_id), None)
            if task is None:
                continue  # not ours (cannot happen with one consumer) -- nothing to release
            self._complete(task, results)

    def _complete(self, task: _Task, results: Sequence[bool]) -> None:
        self.l1.finish_read(task.keys)
        stored = [key for key, ok in zip(task.keys, results, strict=False) if ok]
        failed = len(task.keys) - len(stored)
        index = task.slot.index
        self.stats.add_adapter(index, "store_tasks_completed")
        self.stats.add_adapter(index, "keys_stored", len(stored))
        if failed:
            self.stats.add_adapter(index, "store_tasks_failed")
            self.stats.add_adapter(index, "keys_store_failed", failed)
            self.stats.fail("l2_store_failed", failed)
        logger.debug(
            "L2 store task %d completed on %s: %d/%d keys stored",
            task.task_id,
            task.slot.name,
            len(stored),
            len(task.keys),
        )
        batch = task.batch
        batch.stored.update(stored)
        batch.tasks_left -= 1
        if batch.tasks_left == 0:
            self._finish_batch(batch)

    def _finish_batch(self, batch: _Batch) -> None:
        # A key stored in at least one adapter can be served from L2 again, so it is
        # safe for the policy to drop it from L1.
        stored = [key for key in batch.keys if key in batch.stored]
        if not stored:
            return
        try:
            doomed = self.policy.select_l1_deletions(stored)
        except Exception:
            logger.exception("store policy failed to select L1 deletions")
            self.stats.fail("store_policy_error")
            return
        doomed = [key for key in doomed if key in batch.stored]
        if not doomed:
            return
        with self.l1.lock:
            deleted = self.l1.delete(doomed)
            # Objects someone is reading right now cannot go yet; marking them temporary
            # frees them when their last reader releases them.
            busy = [key for key, gone in zip(doomed, deleted, strict=True) if not gone]
            if busy:
                self.l1.set_temporary(busy, True)
        self.stats.add("l1_deleted_after_store", sum(deleted))

    def finish(self) -> None:
        # Draining gave up (stalled adapter) or finished: release every lock still held.
        for task in self._tasks.values():
            self.l1.finish_read(task.keys)
            self.stats.add_adapter(task.slot.index, "store_tasks_failed")
            self.stats.fail("l2_store_abandoned", len(task.keys))
        self._tasks.clear()
        with self._queue_lock:
            dropped = sum(len(keys) for keys in self._queue)
            self._queue.clear()
        if dropped:
            self.stats.fail("l2_store_dropped_at_shutdown", dropped)


def _copy_out(l1: L1Manager, obj: L1Object) -> memoryview:
    """An NVMe L1 object's bytes in host memory, which is what an adapter can read."""
    buffer = aligned_buffer(obj.size)  # page-aligned: the O_DIRECT read lands in it directly
    l1.read_object(obj, buffer)
    return buffer
