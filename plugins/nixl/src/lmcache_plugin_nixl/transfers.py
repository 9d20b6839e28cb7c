"""One batched NIXL transfer between host buffers and storage, with per-item results.

A batch becomes a single NIXL request (one descriptor per object), which is what makes
NIXL fast.  NIXL reports success or failure for the request as a whole, so when a batch
fails it is retried item by item: callers get an exact answer per key, and one bad file
costs only its own key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from lmcache_plugin_nixl.memory import HostMemory
from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError, Registration, descriptors

log = logging.getLogger(__name__)

#: Where an item lives in storage: (file offset or 0, length, fd or object device id).
StorageRow = tuple[int, int, int]
#: Given an item's index and its host address, where it lives in storage.
Locator = Callable[[int, int], StorageRow]
#: Registers the storage side of a batch (files opened for it), or None when the storage
#: was registered once up front.
StorageRegistrar = Callable[[list[StorageRow]], "Registration | None"]


class BatchTransfer:
    """Runs READ or WRITE batches for one adapter."""

    def __init__(self, runtime: NixlRuntime, backend: str, host: HostMemory, storage_mem: str) -> None:
        self.runtime = runtime
        self.backend = backend
        self.host = host
        self.storage_mem = storage_mem

    def run(
        self,
        operation: str,
        buffers: Sequence[memoryview],
        locate: Locator,
        register_storage: StorageRegistrar | None = None,
        *,
        background: bool = False,
    ) -> list[bool]:
        """Move every buffer to (WRITE) or from (READ) the place ``locate`` gives for it
        (``background``: for write-back, see :meth:`NixlRuntime.transfer`)."""
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
            if not self._try(operation, *batch, background):
                if len(moving) == 1:
                    results[moving[0]] = False
                else:
                    for i in moving:
                        results[i] = self._try(operation, [addresses[i]], [rows[i]], background)
            return results
        finally:
            if storage is not None:
                storage.release()
            if strays is not None:
                strays.release()

    def _try(self, operation: str, addresses: list[int], rows: list[StorageRow], background: bool) -> bool:
        dram = descriptors([(address, row[1], 0) for address, row in zip(addresses, rows, strict=True)])
        storage = descriptors(rows)
        try:
            self.runtime.transfer(
                self.backend, operation, dram, storage, self.storage_mem, background=background
            )
        except NixlTransferError as exc:
            log.debug("%s of %d item(s) failed: %s", operation, len(rows), exc)
            return False
        return True
