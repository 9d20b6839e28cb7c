"""Verified loads of record files: each object's system calls and hash on the thread that took it.

A load of one record file is: open it, check its size against the header length (known
from the key) plus the payload length (known from the lookup), read the header and the
payload -- the payload in pieces, each hashed as it lands (:func:`read_record_file`) --
and close it.  Backends spread a batch's objects over a few threads
(:class:`~lmcache_tiers.l2.workers.BatchWorkers`) and call :meth:`RecordLoads.load` on
each, or call :meth:`RecordLoads.load_many` for the batch: an object's system calls and
its hash run on the thread that took it, never serially on the calling thread before or
after the workers (opening 64 files one after the other there cost about a tenth of a
64 x 1 MiB load).

Outcomes, one per object, never an exception: True once every payload byte matched the
header's checksum; False for a miss -- no file, a file of another size (another intact
object: kept, counted ``load_size_changed``; damage: removed), a record of another serde
chain or another key (kept; the latter counted ``foreign_records``), a file that
shrank under the read, an I/O error (counted ``load_read_errors``, one line a burst; a
path running through a file, ENOTDIR, is one too: the tree is damaged or moved aside,
which the operator must hear of -- a lookup meeting it fails, counted, as only ENOENT is
``ABSENT_FILE_ERRORS``); a
damaged record is removed (``corrupt_records_removed``) only if it is still the file that
was judged.

A load still running when the adapter starts closing (``BackendContext.closing``) is a
miss: core fails its task and closes the backend once its deadline passed, even while a
read is stuck (a hung mount), and the buffers then belong to other objects.  So no file
is opened and no further piece read into a caller's buffer once closing began; only a
read already in flight may still land.

:meth:`RecordLoads.load_many` loads a whole batch of buffered reads in three passes.  A
1 MiB copy out of the page cache, and the hash after it, leave little of the
interpreter's own code and data in the core's caches, so every line of Python run
between two objects' copies ran several times slower than in a loop (on this project's
2-core machines, decoding a header there took ~25 us against ~2.5 us): the Python work
of a load, not its system calls, was what kept it below ``preadv``.  So the per-object
Python work is done in loops before and after the copies, where it stays in cache: the
paths and header views of every object first; then, spread over the workers, only
``open``, the ``preadv`` of header and payload, the payload's XXH3-128 taken while it is
still in cache, and ``close``; then every header is decoded and checked (key, serde
chain, lengths, crc) and its checksum compared with the digest taken.  No buffer is
reported loaded before that comparison.  Every object that does not pass all of it --
missing, short, damaged, of other lengths, or written with the old blake3 checksum -- is
loaded again by :meth:`RecordLoads.load`, which judges and counts it exactly as a single
load does.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

from lmcache_tiers.keycodec import printable
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.files.layout import record_name
from lmcache_tiers.l2.files.local import FileIdentity, LocalFiles, identity_of
from lmcache_tiers.l2.record import (
    CHECKSUM_XXH3_128,
    MAX_HEADER_LEN,
    RecordError,
    RecordHeader,
    RecordL1SizeError,
    verify_payload,
)
from lmcache_tiers.l2.verified import VERIFY_PIECE, read_and_digest, read_record_file

if TYPE_CHECKING:
    from lmcache_tiers.l2.context import BackendContext
    from lmcache_tiers.l2.workers import BatchWorkers

__all__ = ["ReadRecord", "RecordLoads"]

#: how the bytes of an open record file are read and verified: ``read(fd, header,
#: payload, decode) -> bool`` with the contract of :func:`read_record_file`
ReadRecord = Callable[[int, memoryview, memoryview, Callable[[memoryview], RecordHeader | None]], bool]


#: headers of a batch kept for the next one per loading thread (1024 of 4096 bytes)
_KEPT_BATCH_BYTES = 4 << 20


class _HeaderScratch(threading.local):
    """A page-aligned block per thread for headers (``O_DIRECT`` needs aligned memory),
    as large as the longest header a record may have."""

    def __init__(self) -> None:
        self.view = memoryview(mmap.mmap(-1, MAX_HEADER_LEN))
        #: headers of a whole batch (load_many), kept for the next batch of this thread
        self.batch = bytearray()

    def batch_views(self, lengths: list[int]) -> list[memoryview]:
        """One view per length, cut from this thread's batch block (grown when short; a
        batch of more than ``_KEPT_BATCH_BYTES`` of headers gets a block of its own)."""
        total = sum(lengths)
        if total > _KEPT_BATCH_BYTES:
            batch = bytearray(total)
        else:
            if len(self.batch) < total:
                self.batch = bytearray(total)  # zero-filled now: no page faults in the reads
            batch = self.batch
        block = memoryview(batch)
        views = []
        offset = 0
        for length in lengths:
            views.append(block[offset : offset + length])
            offset += length
        return views


class RecordLoads:
    """Whole verified loads of one store's record files, one object per call."""

    def __init__(
        self,
        files: LocalFiles,
        context: BackendContext,
        header_length: Callable[[ObjectKey], int],
        *,
        first_piece: int | None = None,
    ) -> None:
        self._files = files
        self._layout = files.layout
        self._context = context
        self._header_length = header_length
        self._first_piece = first_piece
        self._scratch = _HeaderScratch()

    def load(
        self,
        key: ObjectKey,
        buffer: memoryview,
        flags: int = 0,
        read: ReadRecord | None = None,
        *,
        l1_size_counted: bool = False,
    ) -> bool:
        """Load ``key``'s record into ``buffer`` (its exact payload length); True only
        once all of it verified.  ``flags`` are added to the file's open flags
        (``O_DIRECT``); ``read`` replaces the piecewise buffered read (a direct read).
        ``l1_size_counted``: a read of the record just counted its impossible L1 size."""
        context = self._context
        if context.closing:
            return False  # the buffer may belong to another object by now
        path = self._layout.path_for(key)
        header = self._scratch.view[: self._header_length(key)]
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | flags)
        except FileNotFoundError:
            return False
        except OSError as exc:
            return self._read_error("cannot open", path, exc)
        if context.closing:  # closed while the open was stuck (a hung mount)
            os.close(fd)
            return False

        def decode(view: memoryview) -> RecordHeader | None:
            return context.read_record_header(view, key, l1_size_counted=l1_size_counted)

        try:
            # The file is read before it is sized: a file of another size fails the read
            # (it ends early, or its header names other lengths) and is sized then.  Every
            # system call releases the GIL, and with several threads loading, each release
            # can wait for another thread's Python work: one call fewer per object shows.
            failure: RecordError | None = None
            try:
                if read is not None:
                    loaded = read(fd, header, buffer, decode)
                else:
                    loaded = read_record_file(
                        fd, header, buffer, decode, first_piece=self._first_piece, stop=self._stopped
                    )
                if context.closing:
                    return False  # closed under the read: not judged, not handed out
                if loaded:
                    return True
            except RecordError as exc:
                if context.closing:
                    return False
                failure = exc
            return self._failed(key, fd, header, buffer.nbytes, failure)
        except OSError as exc:
            return self._read_error("cannot read", path, exc)
        finally:
            os.close(fd)

    def load_many(
        self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview], workers: BatchWorkers
    ) -> list[bool]:
        """:meth:`load` of every key into its buffer (buffered reads), the objects spread
        over ``workers``; True where every payload byte verified (see the module doc)."""
        path_for, header_length = self._layout.path_for, self._header_length
        paths = [path_for(key) for key in keys]
        headers = self._scratch.batch_views([header_length(key) for key in keys])
        first_piece = self._first_piece or VERIFY_PIECE
        read = partial(read_and_digest, first_piece=first_piece, stop=self._stopped)
        digests = workers.map(read, paths, headers, buffers)
        if self._context.closing:
            return [False] * len(keys)  # closed under the reads (see the module doc)
        read_header = self._context.read_record_header
        results: list[bool] = []
        for key, header, buffer, digest in zip(keys, headers, buffers, digests, strict=True):
            if digest is None:  # missing, shorter than expected, or a failed read
                results.append(self.load(key, buffer))
                continue
            try:
                record = read_header(header, key)
            except RecordL1SizeError:  # counted as it was read: load judges it, not counting it again
                results.append(self.load(key, buffer, l1_size_counted=True))
                continue
            except RecordError:  # damaged, or another key's: load judges it
                results.append(self.load(key, buffer))
                continue
            if record is None:  # intact but of another serde chain: a miss that is kept
                results.append(False)
                continue
            if (
                record.header_len == header.nbytes
                and record.payload_len == buffer.nbytes
                and (
                    record.checksum == digest
                    if record.checksum_algo == CHECKSUM_XXH3_128
                    else self._verified(record, buffer)
                )
            ):
                results.append(True)
            else:  # other lengths or a checksum mismatch: judged again on its own
                results.append(self.load(key, buffer))
        return results

    def _read_error(self, what: str, path: str, exc: OSError) -> bool:
        """A record file that cannot be opened or read: a miss, counted.  A failing disk
        or mount fails every load alike: a burst is one line, not one line each."""
        self._context.count("load_read_errors")
        self._context.warn("load_read_error", "%s %s: %s", what, printable(path, 300), exc)
        return False

    def _stopped(self) -> bool:
        """Whether the adapter started closing: no more reads into callers' buffers."""
        return self._context.closing

    @staticmethod
    def _verified(record: RecordHeader, buffer: memoryview) -> bool:
        """A record of another checksum algorithm (the first records' blake3)."""
        try:
            verify_payload(record, buffer)
        except RecordError:
            return False
        return True

    def _failed(
        self, key: ObjectKey, fd: int, scratch: memoryview, expected: int, failure: RecordError | None
    ) -> bool:
        """After a read that did not verify: a file of another size is explained (another
        intact object is kept, damage removed), a damaged record of the expected size is
        removed, an intact record of another key kept (keys that differ only in case
        share a file on a case-insensitive filesystem); False, always."""
        stat = os.fstat(fd)
        identity: FileIdentity = identity_of(stat)
        try:
            if stat.st_size != scratch.nbytes + expected:
                self._explain_size(key, fd, scratch, stat.st_size, expected)
            elif failure is not None:
                raise failure
        except RecordError as exc:
            if not self._context.kept_record(key, exc):
                self._files.discard(key, identity, "corrupt_records_removed", str(exc))
        return False

    def _explain_size(self, key: ObjectKey, fd: int, scratch: memoryview, size: int, expected: int) -> None:
        """A file of an unexpected size: another intact object (kept, a miss) or damage
        (raises a ``RecordError``: the caller removes it).  The header is read into the
        aligned ``scratch``, which an ``O_DIRECT`` descriptor needs."""
        got = os.preadv(fd, [scratch], 0)
        header = self._context.read_record_header(scratch[:got], key)
        if header is None:
            return  # of another serde chain: kept
        if header.header_len + header.payload_len != size:
            raise RecordError(
                f"file is {size} bytes, its header says {header.header_len + header.payload_len}"
            )
        # Header and payload told apart: a record whose header length differs (another
        # layout string) may hold a payload of the very size a load expected.  Another
        # writer replaced it since the lookup (another chunk size): counted under the name
        # the other adapters count it, a burst told in one line.
        self._context.count("load_size_changed")
        self._context.warn(
            "size_changed",
            "%s is a record of %d bytes (header %d, payload %d), a load expected %d (header %d, "
            "payload %d) (replaced since the lookup): a miss, kept",
            printable(record_name(key)),
            size,
            header.header_len,
            header.payload_len,
            scratch.nbytes + expected,
            scratch.nbytes,
            expected,
        )
