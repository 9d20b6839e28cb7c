"""Record files in a local directory with plain ``os`` calls: pwrite/preadv, O_DIRECT.

A store encodes the header (with the payload's checksum), writes payload and header to a
new temporary file and renames it over the record (:meth:`LocalFiles.publish`).  A
buffered load reads the header together with the first piece of the payload, then the
rest piece by piece, each piece hashed as soon as it landed, while it is still in the
CPU's cache; the headers of a batch are judged after its reads, in one pass (core's
:meth:`~lmcache_tiers.l2.files.loads.RecordLoads.load_many`).  Nothing is handed back
that did not verify.  A batch of large objects is spread over a few I/O threads, each
handling whole records: the copies to and from the page cache, the checksums and the
system calls all release the GIL, so records move in parallel on as many cores (handing
checksums to a helper thread instead costs a GIL hand-off per object and gained less).

With ``O_DIRECT`` the header goes through a page-aligned scratch block and the payload
straight from (or into) the caller's buffer when its address is page-aligned (L1 extents
and serde staging buffers are); the last partial block of an odd-sized payload is read or
written with ``O_DIRECT`` cleared on the descriptor, so no byte beyond a buffer is ever
touched.  A buffer that is not aligned is written or read through the page cache instead
(``direct_io_fallbacks``).
"""

from __future__ import annotations

import fcntl
import logging
import os
from collections.abc import Callable, Sequence
from contextlib import suppress
from stat import S_ISREG

import numpy as np

from lmcache_plugin_fs.closing import explain_unwritten
from lmcache_tiers.plugin import (
    ABSENT_FILE_ERRORS,
    RECORD_ALIGN,
    WRITE_BACK,
    BackendContext,
    BatchWorkers,
    FileIdentity,
    HeaderSizes,
    LocalFiles,
    ObjectKey,
    ObjectSize,
    RecordError,
    RecordHeader,
    RecordLoads,
    WriteFailures,
    identity_of,
    is_out_of_space,
    printable,
    record_name,
    verify_payload,
)

log = logging.getLogger(__name__)

#: a batch of at least this many bytes (and two objects) is spread over the I/O threads;
#: smaller ones run on the calling thread, where handing them over would cost more
PARALLEL_BYTES = 512 << 10
#: I/O threads per adapter (records of one batch in flight at once)
IO_THREADS = max(2, min(4, os.cpu_count() or 2))
_DIRECT = getattr(os, "O_DIRECT", 0)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def _aligned(view: memoryview) -> bool:
    return _address(view) % RECORD_ALIGN == 0


def _set_direct(fd: int, on: bool) -> None:
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _DIRECT) if on else (flags & ~_DIRECT))


def _pwrite_all(fd: int, data: memoryview, offset: int, stop: Callable[[], bool]) -> bool:
    """Write all of ``data`` at ``offset``; False once ``stop()`` said so before a write."""
    while data.nbytes:
        if stop():
            return False
        written = os.pwrite(fd, data, offset)
        if written <= 0:
            raise OSError(28, "No space left on device (short write)")
        data, offset = data[written:], offset + written
    return True


def _pread_all(fd: int, buffers: list[memoryview], offset: int, stop: Callable[[], bool]) -> int:
    """Fill ``buffers`` from ``offset``; returns the bytes read (short at EOF, or once
    ``stop()`` said so before a read: the buffers may no longer be the caller's)."""
    total = 0
    pending = [b for b in buffers if b.nbytes]
    while pending:
        if stop():
            break
        got = os.preadv(fd, pending, offset)
        if got <= 0:
            break
        total += got
        offset += got
        while pending and got >= pending[0].nbytes:
            got -= pending[0].nbytes
            pending.pop(0)
        if pending and got:
            pending[0] = pending[0][got:]
    return total


class LocalRecords:
    """Reads and writes the record files of one ``fs`` adapter on a local root."""

    def __init__(
        self,
        files: LocalFiles,
        context: BackendContext,
        *,
        direct: bool,
        read_ahead: int | None,
        failures: WriteFailures,
    ) -> None:
        self.files = files
        self.context = context
        self.direct = direct and bool(_DIRECT)
        self.read_ahead = read_ahead
        self.failures = failures
        self.sizes = HeaderSizes(self._encode_header)
        self._loads = RecordLoads(files, context, self.sizes.length, first_piece=read_ahead)
        # Loads and stores have threads of their own: a thread inherits the CPU priority
        # of the one that started it, and stores run at write-back priority (nice 10).
        self._readers = BatchWorkers(IO_THREADS, f"fs-{context.name}-read")
        self._writers = BatchWorkers(IO_THREADS, f"fs-{context.name}-write", background=True)

    def close(self) -> None:
        # Neither readers nor writers are waited for: core closes the backend once its
        # deadline passed, even while a read or write is stuck (a hung mount).  RecordLoads
        # reads nothing more into a caller's buffer once the adapter is closing, and a
        # store writes nothing more and publishes nothing (_write).
        self._readers.shutdown(wait=False)
        self._writers.shutdown(wait=False)

    def _encode_header(self, key: ObjectKey, payload: memoryview) -> bytes:
        return self.context.record_header(key, payload, align=RECORD_ALIGN)

    @staticmethod
    def _each(
        workers: BatchWorkers,
        work: Callable[[int, ObjectKey, memoryview], bool],
        keys: Sequence[ObjectKey],
        views: Sequence[memoryview],
    ) -> list[bool]:
        """``work(index, key, view)`` per record, a share of the records per I/O thread for
        a large batch.  Every record fails or succeeds alone; all are finished before this
        returns (the views are the caller's)."""
        large = len(keys) > 1 and sum(view.nbytes for view in views) >= PARALLEL_BYTES
        return workers.map(work, range(len(keys)), keys, views, parallel=large)

    # -- stores -------------------------------------------------------------------------------

    def write_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        """Each record fails alone: a full disk fails the records that do not fit, not the
        batch, and a smaller record after a failed one may still fit.  Records written in
        parallel compete for the last free blocks, so those that found the disk full are
        tried once more, one after the other, before they count as not fitting.

        Records not yet published when the adapter starts closing fail (core counts them
        ``store_keys_failed``; one log line says why)."""
        full: set[int] = set()

        def attempt(index: int, key: ObjectKey, payload: memoryview) -> bool:
            return self._write(key, payload, on_full=lambda: full.add(index))

        results = self._each(self._writers, attempt, keys, payloads)
        for index in sorted(full):
            results[index] = self._write(keys[index], payloads[index])
        explain_unwritten(self.context.name, self.context.closing, results)
        return results

    def _write(self, key: ObjectKey, payload: memoryview, on_full: Callable[[], None] | None = None) -> bool:
        """Write ``key``'s record to a temporary file and publish it; False if it failed.

        Once the adapter is closing nothing more is written and nothing published: core
        closes the backend past its deadline while a write is stuck (a hung mount), fails
        the store and hands its payload buffer back, and the adapter then releases its
        directory.  So the flag is asked before the file is created (and before a vanished
        root would be created again, :meth:`LocalFiles.create_temp`), before each further
        write and right before the rename (:meth:`LocalFiles.publish`); a store stopped
        there removes its temporary file and fails."""
        stop = self._closing
        if stop():
            return False
        header_len = self.sizes.length(key)
        direct = self.direct and _aligned(payload)
        if self.direct and not direct:
            self.context.count("direct_io_fallbacks")
        path = None
        fd = -1
        try:
            fd, path = self.files.create_temp(key, _DIRECT if direct else 0, stop=stop)
            whole = payload.nbytes - payload.nbytes % RECORD_ALIGN if direct else payload.nbytes
            # The copy and the checksum release the GIL: idle-class (l2/background.py)
            with WRITE_BACK.copying():
                if not _pwrite_all(fd, payload[:whole], header_len, stop):
                    return False
                if direct:
                    _set_direct(fd, False)  # the tail and the header go through the page cache
                    if not _pwrite_all(fd, payload[whole:], header_len + whole, stop):
                        return False
                encoded = self._encode_header(key, payload)
            if len(encoded) != header_len:
                self.context.header_too_long(key, len(encoded), header_len)
                return False
            if not _pwrite_all(fd, memoryview(encoded), 0, stop):
                return False
            written, fd = fd, -1
            if not self.files.publish(key, path, written, stop=stop):  # closes it
                return False
            path = None
            return True
        except OSError as exc:
            if on_full is not None and is_out_of_space(exc):
                on_full()  # not counted yet: tried again once the batch is done
            else:
                self.failures.failed(record_name(key), exc)
            return False
        except ValueError as exc:  # the header cannot be encoded (e.g. an oversized layout)
            log.warning("%s: cannot store %s: %s", self.context.name, printable(record_name(key)), exc)
            return False
        finally:
            if fd >= 0:  # not published: its close cannot fail anything more
                with suppress(OSError):
                    os.close(fd)
            if path is not None:
                self.files.remove_quietly(path)

    # -- lookups ------------------------------------------------------------------------------

    def stored_size(self, key: ObjectKey) -> int | ObjectSize | None:
        path = self.files.layout.path_for(key)
        try:
            stat = os.stat(path)
        except ABSENT_FILE_ERRORS:
            return None  # other errors fail the lookup batch
        if not S_ISREG(stat.st_mode):
            # A directory (or another kind of file) someone made at the record's name holds
            # no record: the key is absent, not a damaged record to remove.
            return None
        header_len = self.sizes.length(key)
        stored = stat.st_size - header_len
        if stored < 0:
            self.files.discard(key, identity_of(stat), "truncated_records_removed", "shorter than its header")
            return None
        if self.context.l1_size_of(key) is not None:
            return stored
        # A key core has no L1 size for: only the header knows it under a size-changing
        # chain, and whether the record is of this key at all (keys that differ only in
        # case share a file on a case-insensitive filesystem; a hit would be adopted).
        header = self._peek_header(key, path)
        if header is None or isinstance(header, RecordHeader):  # (a RecordHeader is a tuple too)
            return None if header is None else ObjectSize(header.payload_len, header.l1_size)
        error, identity = header  # a damaged record
        self.files.discard(key, identity, "corrupt_records_removed", str(error))
        return None

    def _peek_header(
        self, key: ObjectKey, path: str
    ) -> RecordHeader | tuple[RecordError, FileIdentity] | None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except ABSENT_FILE_ERRORS:
            return None  # removed since the stat (other errors fail the batch)
        try:
            identity = identity_of(os.fstat(fd))
            data = os.pread(fd, self.sizes.length(key), 0)
            return self.context.read_record_header(data, key)
        except RecordError as exc:
            # another key's intact record or a newer format's: kept; damage: removed
            return None if self.context.kept_record(key, exc) else (exc, identity)
        finally:
            os.close(fd)

    # -- loads --------------------------------------------------------------------------------

    def read_many(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        if not self.direct:
            # Buffered: the read threads only read and hash; headers are judged after,
            # in one pass (core's RecordLoads.load_many, as nixl_store_dynamic does).
            return self._loads.load_many(keys, buffers, self._readers)
        return self._each(self._readers, self._load, keys, buffers)

    def _closing(self) -> bool:
        return self.context.closing

    def _load(self, _index: int, key: ObjectKey, buffer: memoryview) -> bool:
        """Read and verify one record into ``buffer``; True only once all of it matched."""
        direct = self.direct and _aligned(buffer)
        if self.direct and not direct:
            self.context.count("direct_io_fallbacks")
        if direct:
            return self._loads.load(key, buffer, _DIRECT, self._read_direct)
        # Buffered: each piece is checksummed as it lands, while still in cache.
        return self._loads.load(key, buffer)

    def _read_direct(
        self,
        fd: int,
        header: memoryview,
        buffer: memoryview,
        decode: Callable[[memoryview], RecordHeader | None],
    ) -> bool:
        """An ``O_DIRECT`` read: the device fills the buffer, nothing of it is in cache to
        checksum piece by piece, and a read per piece would wait for the device each time.
        Once the adapter is closing no further read starts (the buffer may hold another
        object by then, core's RecordLoads)."""
        header_len = header.nbytes
        whole = buffer.nbytes - buffer.nbytes % RECORD_ALIGN
        stop = self._closing
        got = _pread_all(fd, [header, buffer[:whole]], 0, stop)
        _set_direct(fd, False)
        got += _pread_all(fd, [buffer[whole:]], header_len + whole, stop)
        if got != header_len + buffer.nbytes:
            return False  # shrunk under us: not a record anyone may trust now
        record = decode(header)
        if record is None:
            return False  # intact, of another serde chain: a miss that is kept
        if record.header_len != header_len or record.payload_len != buffer.nbytes:
            raise RecordError(
                f"record header says {record.header_len}+{record.payload_len} bytes, "
                f"file holds {header_len}+{buffer.nbytes}"
            )
        verify_payload(record, buffer)
        return True
