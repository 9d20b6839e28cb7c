"""What every adapter base class shares: pins, accounting, serde, listeners, results.

The operations themselves live in :mod:`lmcache_tiers.l2.ops`; the two base classes differ
only in how they run the backend call between ``prepare`` and ``finish``, so the rules
below hold for every adapter:

* a lookup pins each hit; a load holds its own pin while it runs; a delete skips pinned
  keys and a key being deleted is never reported found;
* bytes are accounted on a successful store, on the first lookup hit of a key this
  process never stored (after a restart) and are released on delete or when a lookup
  finds an accounted key gone;
* backend exceptions fail the batch (every key False or missed) and are counted, never
  propagated into a controller thread.
"""

from __future__ import annotations

import logging
import threading
from abc import abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.accounting import ByteAccounting, ObjectSize
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.interface import L2Adapter, L2Listener, L2Op, LookupResult
from lmcache_tiers.l2.ops import BatchOp
from lmcache_tiers.l2.pins import PinTable
from lmcache_tiers.l2.record import RecordHeader, decode_header, encode_header
from lmcache_tiers.l2.tasks import TaskBoard
from lmcache_tiers.serde import IdentitySerde, SerdeContext, encode_chain, serde_names

log = logging.getLogger("lmcache_tiers.l2")

#: what ``contains_many`` reports per key: None (miss), the stored size (int) or both sizes
ContainsResult = int | ObjectSize | None


class AdapterCore(L2Adapter):
    """State and rules shared by the sync and the async adapter base classes."""

    needs_l1_buffers: ClassVar[bool] = False
    #: how long ``close()`` waits for backend calls already running before failing them
    close_timeout_s: ClassVar[float] = 30.0

    def __init__(self, config: L2AdapterConfig, context: AdapterContext) -> None:
        self.config = config
        self.context = context
        self.name = context.name
        self.serde = tuple(context.serde)
        self.identity = all(isinstance(serde, IdentitySerde) for serde in self.serde)
        self.accounting = ByteAccounting()
        self.pins = PinTable()
        self.board = TaskBoard()
        self.closing = threading.Event()
        self._state_lock = threading.Lock()
        self._closed = False
        self._listeners: list[L2Listener] = []
        self._counters: Counter[str] = Counter()
        self._counter_lock = threading.Lock()
        #: L1 sizes of keys whose store is in the backend call right now
        self._storing: dict[ObjectKey, int] = {}
        self._storing_lock = threading.Lock()

    # -- what subclasses provide ----------------------------------------------------------

    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """Capacity the usage fraction is measured against; None = no natural size."""

    # -- helpers for subclasses ----------------------------------------------------------

    def sleep_unless_closed(self, seconds: float) -> bool:
        """Sleep (simulated latency, back-off); returns False if ``close()`` cut it short."""
        return not self.closing.wait(seconds) if seconds > 0 else not self.closing.is_set()

    def account_recovered(self, items: Sequence[tuple[ObjectKey, ObjectSize]]) -> None:
        """Account objects a persistent adapter found on start-up (a recovery scan).

        Without it bytes of a previous run are accounted lazily, on their first lookup.
        """
        for key, size in items:
            self.accounting.record_if_absent(key, size)

    def l1_size_of(self, key: ObjectKey) -> int | None:
        """L1 (decoded) size of a key being stored right now, else of an accounted key.

        ``put_many`` only receives encoded payloads; a persistent adapter calls this (or
        :meth:`record_header`) to write the L1 size into the record header.
        """
        with self._storing_lock:
            storing = self._storing.get(key)
        if storing is not None:
            return storing
        size = self.accounting.get(key)
        return None if size is None else size.l1

    def record_header(
        self, key: ObjectKey, payload: memoryview, *, layout: str = "", align: int = 1
    ) -> bytes:
        """Record header for a payload ``put_many`` received (L1 size and serde filled in)."""
        l1_size = self.l1_size_of(key)
        return encode_header(
            key,
            payload,
            l1_size=payload.nbytes if l1_size is None else l1_size,
            serde=serde_names(self.serde),
            layout=layout,
            align=align,
        )

    def read_record_header(self, data: bytes | memoryview, key: ObjectKey) -> RecordHeader:
        """Decode a stored header, refusing another key's record or another serde chain.

        Raises a :class:`~lmcache_tiers.l2.record.RecordError`; the adapter reports the key
        as a miss (and should delete it and ``count("corrupt_records")``).
        """
        return decode_header(data, expected_key=key, expected_serde=serde_names(self.serde))

    def storing_begin(self, keys: Sequence[ObjectKey], l1_sizes: Sequence[int]) -> None:
        with self._storing_lock:
            self._storing.update(zip(keys, l1_sizes, strict=True))

    def storing_end(self, keys: Sequence[ObjectKey]) -> None:
        with self._storing_lock:
            for key in keys:
                self._storing.pop(key, None)

    def count(self, name: str, amount: int = 1) -> None:
        if amount:
            with self._counter_lock:
                self._counters[name] += amount

    # -- shared machinery ---------------------------------------------------------------

    def encode(self, key: ObjectKey, buffer: memoryview, layout: str = "") -> memoryview:
        view = memoryview(buffer).cast("B")
        if self.identity:
            return view
        return encode_chain(self.serde, view, SerdeContext(key, view.nbytes, layout))

    def resolve_size(
        self, key: ObjectKey, reported: ContainsResult, known: ObjectSize | None
    ) -> ObjectSize | None:
        """Both sizes of a key the backend reported found, accounting it if new; None = miss."""
        if reported is None:
            return None
        if isinstance(reported, ObjectSize):
            size = reported
        elif known is not None and known.stored == reported:
            return known
        elif self.identity:
            size = ObjectSize(reported, reported)
        else:
            # A size-changing serde and a backend that only knows the stored size: the L1
            # size cannot be derived, so the key is a miss rather than a wrong reservation.
            self.count("lookup_size_unknown")
            log.warning(
                "%s: %s found but its L1 size is unknown (serde chain changes sizes and the "
                "adapter reported only the stored size); treated as a miss",
                self.name,
                key,
            )
            return None
        if known is None:
            if not self.accounting.record_if_absent(key, size):
                current = self.accounting.get(key)
                return current if current is not None else size
        elif known != size:
            self.accounting.record(key, size)
        return size

    def accounting_forget_if_unchanged(self, key: ObjectKey, known: ObjectSize | None) -> None:
        if known is not None and self.accounting.get(key) is known:
            self.accounting.forget(key)

    def notify(self, method: str, keys: Sequence[ObjectKey]) -> None:
        if not keys:
            return
        for listener in list(self._listeners):
            try:
                getattr(listener, method)(self, keys)
            except Exception:  # a listener bug must not fail the adapter's operations
                log.exception("%s: listener %r failed in %s", self.name, listener, method)

    def publish(self, task_id: int, op: BatchOp, result: Any) -> None:
        if not self.board.complete(task_id, result):
            op.released()

    def check_result(self, result: Sequence[Any], expected: int, method: str) -> Sequence[Any]:
        if len(result) != expected:
            raise ValueError(f"{method} returned {len(result)} results for {expected} keys")
        return result

    def backend_failed(self, method: str, exc: BaseException) -> None:
        self.count("backend_errors")
        log.warning("%s: %s failed: %s: %s", self.name, method, type(exc).__name__, exc)

    def validate_batch(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None = None,
    ) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if layouts is not None and len(layouts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, op: L2Op, count: int, start: Callable[[int], None]) -> int:
        """Register a task and start it, or fail it at once after close."""
        task_id = self.board.new_task(op, count)
        with self._state_lock:
            if not self._closed:
                self.count(f"{op.name.lower()}_tasks")
                start(task_id)
                return task_id
        self.count("tasks_failed_closed")
        self.board.fail(task_id)
        return task_id

    def begin_close(self) -> bool:
        """Mark closed (first call only) and interrupt sleeps; False if already closed."""
        with self._state_lock:
            if self._closed:
                return False
            self._closed = True
        self.closing.set()
        return True

    def finish_close(self) -> None:
        failed = self.board.fail_all_pending()
        self.count("tasks_failed_closed", failed)

    # -- L2Adapter --------------------------------------------------------------------------

    def event_fd(self, op: L2Op) -> int:
        return self.board.event_fd(op)

    def pop_completed_stores(self) -> dict[int, list[bool]]:
        return self.board.pop(L2Op.STORE)

    def pop_completed_lookups(self) -> dict[int, LookupResult]:
        return self.board.pop(L2Op.LOOKUP)

    def pop_completed_loads(self) -> dict[int, list[bool]]:
        return self.board.pop(L2Op.LOAD)

    def unlock(self, keys: Sequence[ObjectKey]) -> None:
        self.pins.unpin(keys)

    def usage(self) -> float:
        capacity = self.capacity_bytes()
        if capacity is None:
            return -1.0
        return self.accounting.used_bytes / capacity if capacity > 0 else 1.0

    def used_bytes(self) -> int:
        return self.accounting.used_bytes

    def used_bytes_by_salt(self) -> dict[str, int]:
        return self.accounting.by_salt()

    def add_listener(self, listener: L2Listener) -> None:
        self._listeners.append(listener)

    def pinned_keys(self) -> dict[ObjectKey, int]:
        """Pin count of every pinned key (diagnostics; tests that locks return to zero)."""
        return self.pins.snapshot()

    def stats(self) -> dict[str, int]:
        with self._counter_lock:
            counters = dict(self._counters)
        counters["pending_tasks"] = self.board.pending_count()
        counters["pinned_keys"] = len(self.pins.snapshot())
        return counters
