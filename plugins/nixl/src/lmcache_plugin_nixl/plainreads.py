"""Loads of ``nixl_store_dynamic`` record files with ``preadv``, verified piece by piece.

On NIXL's POSIX backend with buffered I/O a load is a copy out of the page cache, and a
NIXL request adds its own set-up and threads around that copy; the checksum, taken after
a whole group has landed, then reads bytes that have already left the CPU's caches.  Here
each file is read by core's :func:`~lmcache_tiers.l2.verified.read_record_file`: the
header together with the first piece of the payload, then the rest in pieces, each
piece fed to the record's checksum right after it is read, while it is still in cache.
A batch's files are shared out over ``READ_THREADS`` threads (the calling one included).

A buffer is reported loaded only after its whole payload matched the header's checksum;
a record that does not verify is removed (``corrupt_records_removed``), one whose file
changed size under the read is a miss.  Direct I/O and every other NIXL backend keep
going through NIXL (:mod:`lmcache_plugin_nixl.recordio`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lmcache_tiers.plugin import (
    BackendContext,
    BatchWorkers,
    LocalFiles,
    ObjectKey,
    RecordError,
    printable,
    read_record_file,
)

if TYPE_CHECKING:
    from lmcache_plugin_nixl.recordio import _Pending

log = logging.getLogger(__name__)

#: threads a batch's files are spread over (the calling thread is one of them)
READ_THREADS = 2


class PlainReads:
    """Verified ``preadv`` loads for one adapter."""

    def __init__(self, context: BackendContext, files: LocalFiles) -> None:
        self._context = context
        self._files = files
        self._workers = BatchWorkers(READ_THREADS, "nixl-read")

    def close(self) -> None:
        self._workers.shutdown()

    def read(
        self,
        keys: Sequence[ObjectKey],
        pending: list[_Pending],
        buffers: Sequence[memoryview],
        results: list[bool],
    ) -> None:
        """Load every pending file into its buffer; ``results[item.index]`` True where verified."""
        outcomes = self._workers.map(
            self._read_one,
            [keys[item.index] for item in pending],
            pending,
            [buffers[item.index] for item in pending],
        )
        for item, ok in zip(pending, outcomes, strict=True):
            results[item.index] = ok

    def _read_one(self, key: ObjectKey, item: _Pending, buffer: memoryview) -> bool:
        try:
            return read_record_file(
                item.fd,
                memoryview(bytearray(item.offset)),
                buffer,
                lambda header: self._context.read_record_header(header, key),
            )
        except RecordError as exc:
            self._files.discard(key, item.identity, "corrupt_records_removed", str(exc))
        except OSError as exc:
            log.warning("cannot read %s: %s", printable(item.path, 300), exc)
        return False
