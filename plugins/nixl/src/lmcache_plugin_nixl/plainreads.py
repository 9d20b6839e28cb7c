"""Loads of ``nixl_store_dynamic`` record files with ``preadv``, verified piece by piece.

On NIXL's POSIX backend with buffered I/O a load is a copy out of the page cache, and a
NIXL request adds its own set-up and threads around that copy; the checksum, taken after
a whole group has landed, then reads bytes that have already left the CPU's caches.  Here
a batch is loaded by core's :meth:`~lmcache_tiers.l2.files.loads.RecordLoads.load_many`:
each file opened, its header read together with the first piece of the payload, the rest
in pieces, each piece fed to XXH3-128 right after it is read, while it is still in cache,
and the file closed, on the thread that took the object; the objects are shared out over
``READ_THREADS`` threads (the calling one included), so while one thread hashes a piece
the other is reading.  The Python work of each object (its path before, the header's
decoding and checks after) runs in loops around those copies rather than between them,
where a 1 MiB copy had left it out of cache and it cost ~10x as much.

A buffer is reported loaded only after its whole payload matched the header's checksum;
a record that does not verify is removed (``corrupt_records_removed``), one whose file
changed size under the read is a miss.  Direct I/O and every other NIXL backend keep
going through NIXL (:mod:`lmcache_plugin_nixl.recordio`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from lmcache_tiers.plugin import BackendContext, BatchWorkers, LocalFiles, ObjectKey, RecordLoads

#: threads a batch's files are spread over (the calling thread is one of them)
READ_THREADS = 2


class PlainReads:
    """Verified ``preadv`` loads for one adapter."""

    def __init__(
        self, context: BackendContext, files: LocalFiles, header_length: Callable[[ObjectKey], int]
    ) -> None:
        self._loads = RecordLoads(files, context, header_length)
        self._workers = BatchWorkers(READ_THREADS, f"nixl-{context.name}-read")

    def close(self) -> None:
        # Never waits: core closes the backend once its deadline passed, even while a
        # load is still stuck in a read (a hung mount).
        self._workers.shutdown(wait=False)

    def read(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        """Load every key's record into its buffer; True where it verified."""
        return self._loads.load_many(keys, buffers, self._workers)
