"""One batched NIXL transfer between host buffers and storage, with per-item results.

A batch becomes a single NIXL request (one descriptor per object), which is what makes
NIXL fast.  NIXL reports success or failure for the request as a whole, so when a batch
fails it is retried item by item: callers get an exact answer per key, and one bad file
costs only its own key.

Direct-I/O write-back is the exception: it goes down in requests of at most
``WRITE_BACK_PIECE_BYTES``, all posted before any is waited for.  NIXL submits a
request's descriptors in one system call, and an O_DIRECT write's submission (pinning its
pages, building its bios) runs without a preemption point on kernels built without
preemption (PREEMPT_NONE, as on many VMs): 8 MiB took 0.22 ms of CPU at the median, so a
request of four 8 MiB objects is about 0.9 ms of it, and a client's or a request
thread's wake-up queues behind it (the tail of lookups under write-back).  A 2 MiB piece
takes about 0.1 ms, and the thread returns to user space between pieces, where the
scheduler can hand its core over.  Buffered write-back stays one request: there NIXL
copies into the page cache in the posting call, so the thread takes the GIL back after
every piece, which cost 5-20 % of its throughput, and direct I/O is the configuration
that keeps tails short anyway (docs/adapters/nixl.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from lmcache_plugin_nixl.memory import HostMemory
from lmcache_plugin_nixl.runtime import (
    NixlRuntime,
    NixlTransferError,
    OverdueTransfers,
    Registration,
    descriptors,
)
from lmcache_tiers.plugin import BurstLog

log = logging.getLogger(__name__)
#: one warning per minute per operation: a failing device must not flood the log
_FAILURES = BurstLog(log)

#: Where an item lives in storage: (file offset or 0, length, fd or object device id).
StorageRow = tuple[int, int, int]
#: Given an item's index and its host address, where it lives in storage.
Locator = Callable[[int, int], StorageRow]
#: Most bytes one write-back NIXL request moves (see the module docstring)
WRITE_BACK_PIECE_BYTES = 2 << 20
#: Registers the storage side of a batch (files opened for it), or None when the storage
#: was registered once up front.
StorageRegistrar = Callable[[list[StorageRow]], "Registration | None"]


class BatchTransfer:
    """Runs READ or WRITE batches for one adapter."""

    def __init__(
        self,
        runtime: NixlRuntime,
        backend: str,
        host: HostMemory,
        storage_mem: str,
        *,
        direct_io: bool = False,
    ) -> None:
        self.runtime = runtime
        self.backend = backend
        self.host = host
        self.storage_mem = storage_mem
        #: most bytes per write-back request; None: a batch is one request
        self.write_back_piece = WRITE_BACK_PIECE_BYTES if direct_io else None
        #: this adapter's transfers past their deadline (its stats)
        self.overdue = OverdueTransfers()

    def run(
        self,
        operation: str,
        buffers: Sequence[memoryview],
        locate: Locator,
        register_storage: StorageRegistrar | None = None,
        *,
        background: bool = False,
        stop: Callable[[], bool] | None = None,
        stopped: list[int] | None = None,
    ) -> list[bool]:
        """Move every buffer to (WRITE) or from (READ) the place ``locate`` gives for it
        (``background``: for write-back, see :meth:`NixlRuntime.transfer_many`).  Once
        ``stop()`` is true no further request is posted and the items not moved yet fail: a
        load's buffers are no longer its own once the adapter started closing.  The indices
        of the items failed that way, never tried, are appended to ``stopped``: the caller
        tells them apart from items the storage failed."""
        if not buffers:
            return []
        addresses, strays = self.host.prepare(buffers)
        storage: Registration | None = None
        try:
            rows: list[StorageRow] = [locate(i, address) for i, address in enumerate(addresses)]
            # Empty objects have no bytes to move; NIXL rejects zero-length descriptors.
            moving = [i for i, buffer in enumerate(buffers) if buffer.nbytes]
            if not moving:
                return [True] * len(buffers)
            if register_storage is not None:
                storage = register_storage([rows[i] for i in moving])
            results = [True] * len(buffers)
            batch = [addresses[i] for i in moving], [rows[i] for i in moving]
            if stop is not None and stop():
                return self._skip(results, moving, stopped)
            if not self._try(operation, *batch, background):
                if len(moving) == 1:
                    results[moving[0]] = False
                else:
                    for position, i in enumerate(moving):
                        if stop is not None and stop():
                            return self._skip(results, moving[position:], stopped)
                        results[i] = self._try(operation, [addresses[i]], [rows[i]], background)
            return results
        finally:
            if storage is not None:
                storage.release()
            if strays is not None:
                strays.release()

    @staticmethod
    def _skip(results: list[bool], items: list[int], stopped: list[int] | None) -> list[bool]:
        """Fail ``items`` without trying them (the caller asked to stop)."""
        for i in items:
            results[i] = False
        if stopped is not None:
            stopped.extend(items)
        return results

    def _try(self, operation: str, addresses: list[int], rows: list[StorageRow], background: bool) -> bool:
        if background and operation == "WRITE" and self.write_back_piece is not None:
            requests = pieces(addresses, rows, self.write_back_piece)
        else:
            dram = [(address, row[1], 0) for address, row in zip(addresses, rows, strict=True)]
            requests = [(dram, list(rows))]
        try:
            self.runtime.transfer_many(
                self.backend,
                operation,
                [(descriptors(dram), descriptors(storage)) for dram, storage in requests],
                self.storage_mem,
                background=background,
                overdue=self.overdue,
            )
        except NixlTransferError as exc:
            if len(rows) == 1:  # the item's verdict: a batch that fails is tried item by item
                _FAILURES.warn(operation, "NIXL %s of an object failed: %s", operation, exc)
            else:
                log.debug("%s of %d items failed, trying each alone: %s", operation, len(rows), exc)
            return False
        return True


Rows = list[tuple[int, int, int]]


def pieces(addresses: Sequence[int], rows: Sequence[StorageRow], limit: int) -> list[tuple[Rows, Rows]]:
    """(DRAM rows, storage rows) of requests moving at most ``limit`` bytes each, together
    covering every item once, in order.  An item longer than ``limit`` is cut at multiples
    of ``limit`` from its own start (an O_DIRECT item keeps its alignment); shorter pieces
    share a request while they fit."""
    requests: list[tuple[Rows, Rows]] = []
    dram: Rows = []
    storage: Rows = []
    size = 0
    for address, (offset, length, device) in zip(addresses, rows, strict=True):
        for start in range(0, length, limit):
            take = min(limit, length - start)
            if dram and size + take > limit:
                requests.append((dram, storage))
                dram, storage, size = [], [], 0
            dram.append((address + start, take, 0))
            storage.append((offset + start, take, device))
            size += take
    if dram:
        requests.append((dram, storage))
    return requests
