"""Loads of ``nixl_store_dynamic`` record files with ``preadv``, verified piece by piece.

On NIXL's POSIX backend with buffered I/O a load is a copy out of the page cache, and a
NIXL request adds its own set-up and threads around that copy; the checksum, taken after
a whole group has landed, then reads bytes that have already left the CPU's caches.  Here
each file is read with ``preadv`` (which releases the GIL) in pieces of ``READ_PIECE``
bytes -- the header together with the first piece -- and each piece is fed to the
record's checksum right after it is read, while it is still in cache.  A load is split
over ``READ_THREADS`` threads (file by file), so with a free core the checksum costs
close to nothing and without one about a fifth of the read.

A buffer is reported loaded only after its whole payload matched the header's checksum;
a record that does not verify is removed (``corrupt_records_removed``), one whose file
changed size under the read is a miss.  Direct I/O and every other NIXL backend keep
going through NIXL (:mod:`lmcache_plugin_nixl.recordio`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from lmcache_tiers.plugin import (
    BackendContext,
    LocalFiles,
    ObjectKey,
    PayloadVerifier,
    RecordError,
    printable,
)

if TYPE_CHECKING:
    from lmcache_plugin_nixl.recordio import _Pending

log = logging.getLogger(__name__)

#: bytes read (and checksummed) per ``preadv``: small enough to stay in a core's cache
#: between the read and the checksum, large enough that the calls cost little
READ_PIECE = 256 << 10
#: threads a batch's files are spread over (the calling thread is one of them)
READ_THREADS = 2


class PlainReads:
    """Verified ``preadv`` loads for one adapter."""

    def __init__(self, context: BackendContext, files: LocalFiles) -> None:
        self._context = context
        self._files = files
        self._threads = max(1, READ_THREADS)
        self._pool = (
            ThreadPoolExecutor(max_workers=self._threads - 1, thread_name_prefix="nixl-read")
            if self._threads > 1
            else None
        )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def read(
        self,
        keys: Sequence[ObjectKey],
        pending: list[_Pending],
        buffers: Sequence[memoryview],
        results: list[bool],
    ) -> None:
        """Load every pending file into its buffer; ``results[item.index]`` True where verified."""
        shares = [pending[start :: self._threads] for start in range(self._threads)]
        pool = self._pool
        others = (
            []
            if pool is None
            else [pool.submit(self._read_all, keys, share, buffers, results) for share in shares[1:] if share]
        )
        try:
            self._read_all(keys, shares[0], buffers, results)
        finally:
            for other in others:
                other.result()

    def _read_all(
        self,
        keys: Sequence[ObjectKey],
        items: list[_Pending],
        buffers: Sequence[memoryview],
        results: list[bool],
    ) -> None:
        for item in items:
            key = keys[item.index]
            try:
                results[item.index] = self._read_one(key, item, buffers[item.index])
            except RecordError as exc:
                self._files.discard(key, item.identity, "corrupt_records_removed", str(exc))
            except OSError as exc:
                log.warning("cannot read %s: %s", printable(item.path, 300), exc)

    def _read_one(self, key: ObjectKey, item: _Pending, buffer: memoryview) -> bool:
        header_bytes = bytearray(item.offset)
        piece = buffer[: min(READ_PIECE, item.length)]
        if os.preadv(item.fd, [header_bytes, piece], 0) != item.offset + piece.nbytes:
            return False  # the file shrank since it was opened: a miss
        header = self._context.read_record_header(bytes(header_bytes), key)
        if header is None:
            return False  # intact, but of another serde chain: a miss that is kept
        if header.header_len != item.offset or header.payload_len != item.length:
            raise RecordError(
                f"record header says {header.header_len}+{header.payload_len} bytes, "
                f"file holds {item.offset}+{item.length}"
            )
        verifier = PayloadVerifier(header)
        verifier.update(piece)
        position = piece.nbytes
        while position < item.length:
            piece = buffer[position : position + READ_PIECE]
            if os.preadv(item.fd, [piece], item.offset + position) != piece.nbytes:
                return False
            verifier.update(piece)
            position += piece.nbytes
        verifier.verify()
        return True
