"""Access to object bytes: views into the arena, copies in and out of either backing, and
loans (``l1/loan.py``).

The checks run under the L1 lock; the copies do not.  The caller holds a lock on the
object (a read lock, or the write lock it is filling under), so its extent cannot change
hands during the copy -- a forced delete meanwhile quarantines the extent -- and a slow
NVMe transfer never stalls other callers.  A close (the server stopping) landing between
the check and the copy releases the backing, which then refuses the copy: the read is a
miss (``l1_read_closed``), the write a failed store (``l1_write_closed``), each a KeyError
as for an object that left L1, counted and logged once a minute.  A close landing while the
copy runs, found by the checks after it, ends the copy the same way.

Bytes copied out of the NVMe file are checked against its write-back errors
(``NvmeL1File.writeback_errors``): an error the kernel reports after an object's bytes
were written may have lost them, and which pages it concerns is not known, so such an
object is refused (KeyError: its reader answers a miss) and every READY object written
before the error leaves L1 at once -- lookups then miss instead of hitting objects whose
every read would fail.  Errors, refusals and objects dropped are counted (``failures``).
"""

from __future__ import annotations

import logging
import threading

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.errors import TiersError
from lmcache_tiers.l1.arena import L1Arena
from lmcache_tiers.l1.backing import L1Backing
from lmcache_tiers.l1.leases import ExtentLeases
from lmcache_tiers.l1.loan import L1Loan
from lmcache_tiers.l1.nvme import NvmeL1File, aligned_buffer
from lmcache_tiers.l1.objects import L1Object, ObjectState
from lmcache_tiers.l1.table import ObjectTable

logger = logging.getLogger(__name__)

_READY = ObjectState.READY
_WRITING = ObjectState.WRITING


class ObjectBytes:
    """Views, copies and loans of object bytes; ``arena`` is None for an NVMe backing."""

    def __init__(
        self,
        lock: threading.RLock,
        table: ObjectTable,
        leases: ExtentLeases,
        backing: L1Backing,
        arena: L1Arena | None,
        backing_path: str | None,
    ) -> None:
        self._lock = lock
        self._table = table
        self._leases = leases
        self._backing = backing
        self._arena = arena
        self._backing_path = backing_path
        self._nvme = backing if isinstance(backing, NvmeL1File) else None
        self._refused = 0  # copies refused for a write-back error since the object's write
        self._dropped = 0  # objects taken out of L1 for such an error
        # of those, acknowledged writes whose L2 store had not settled: in no tier now
        self._lost_before_l2 = 0
        self._read_errors = 0  # copies out of the NVMe file that failed (EIO)
        # of the objects those took out of L1, acknowledged writes whose L2 store had not settled
        self._read_errors_lost_before_l2 = 0
        self._write_errors = 0  # copies into the NVMe file that failed (EIO, ENOSPC)
        self._closed_reads = 0  # copies out that found L1 closed after their presence check
        self._closed_writes = 0  # copies in that found L1 closed after their reservation check
        self._read_error_log = BurstLog(logger, "l1_nvme_read_error")
        self._closed_read_log = BurstLog(logger, "l1_read_closed")
        self._closed_write_log = BurstLog(logger, "l1_write_closed")
        self._write_error_log = BurstLog(logger, "l1_nvme_write_error")

    def view(self, obj: L1Object) -> memoryview:
        with self._lock:
            self._table.check_present(obj)
            if self._arena is None:
                raise TiersError(
                    f"L1 objects in the NVMe file {self._backing_path} have no memory view: "
                    "copy them with read_object/write_object"
                )
            return self._arena.buffer[obj.offset : obj.offset + obj.size]

    def read_object(self, obj: L1Object, out: memoryview) -> None:
        out = byte_view(out)
        if out.nbytes < obj.size:
            raise ValueError(f"a {out.nbytes}-byte buffer cannot hold {obj.key} ({obj.size} bytes)")
        with self._lock:
            if not self._leases.holds(obj):
                self._table.check_present(obj)
        self._copy_out(obj, out)
        self._check_kept(obj)
        self._check_written_back(obj)

    def write_object(self, obj: L1Object, data: memoryview) -> None:
        data = byte_view(data)
        if data.nbytes != obj.size:
            raise ValueError(f"{obj.key} holds {obj.size} bytes, got {data.nbytes}")
        with self._lock:
            self._check_writing(obj)
            if self._nvme is not None:
                # Errors counted before the write begins cannot concern the pages it dirties.
                obj.written_in = self._nvme.writeback_errors_seen
        try:
            self._backing.write_from(obj.offset, data)
        except OSError as exc:
            if self._nvme is not None:
                self._count_write_error(obj, exc)
            raise
        except (RuntimeError, ValueError):
            # As for a copy out (``_copy_out``): a close landing after the check released
            # the backing (a released arena view, a closed file), which refuses the copy.
            self._fail_if_closed(obj)
            raise
        if self._table.closed:
            # A close that landed while the copy ran (it waits for NVMe transfers, and an
            # arena stays mapped under views): the bytes went into a released L1, never
            # to be committed.  A bool read: no lock on every write's path.
            self._fail_if_closed(obj)

    def _count_write_error(self, obj: L1Object, exc: OSError) -> None:
        """A copy into the NVMe file failed.  The OSError goes on to the writer, whose store
        or load then fails and is never committed (nothing acknowledged is lost); counted
        here so that a failing disk shows as itself, not only as its callers' errors."""
        with self._lock:
            self._write_errors += 1
        self._write_error_log.warn(
            "write",
            "NVMe L1: %s could not be written to %s (%s); its writer's store or load fails",
            obj.key.file_stem(),
            self._backing_path,
            exc.strerror,
        )

    def lend(self, obj: L1Object, *, fill: bool) -> L1Loan:
        with self._lock:
            if fill:
                self._check_writing(obj)
            elif not self._leases.holds(obj):
                # Deleted by force under its lock holder (an L2 store about to copy it out):
                # its extent is held for the holder, its bytes are still the object's.
                self._table.check_present(obj)
        if self._arena is not None:
            if fill:
                return L1Loan(self._arena_extent(self._arena, obj, fill=True), staged=False)
            return L1Loan(
                self._arena_extent(self._arena, obj, fill=False).toreadonly(),
                staged=False,
                verify=lambda: self._check_kept(obj),
            )
        staged = aligned_buffer(obj.size)  # page-aligned: O_DIRECT moves it without a bounce
        if fill:
            return L1Loan(staged, staged=True, commit=lambda: self._commit_staged(obj, staged))
        self._copy_out(obj, staged)
        self._check_kept(obj)
        self._check_written_back(obj)
        return L1Loan(staged, staged=True)

    def _commit_staged(self, obj: L1Object, staged: memoryview) -> None:
        """Write a staged fill into the NVMe file.  The close may land during the fill,
        before this check: that fill failed like one the close caught mid-copy."""
        try:
            self.write_object(obj, staged)
        except RuntimeError:
            self._fail_if_closed(obj)
            raise

    def _arena_extent(self, arena: L1Arena, obj: L1Object, *, fill: bool) -> memoryview:
        """A view of ``obj``'s extent in the arena, for a reader whose presence check passed
        or a writer (``fill``) whose reservation check did.  Taken without the L1 lock: a
        close landing after the check released the arena, and the caller gets a counted
        KeyError (a miss, a failed store), not the released view's error."""
        try:
            return arena.buffer[obj.offset : obj.offset + obj.size]
        except ValueError:
            if fill:
                self._fail_if_closed(obj)
            else:
                self._miss_if_closed(obj)
            raise

    def _copy_out(self, obj: L1Object, out: memoryview) -> None:
        """Copy ``obj``'s bytes into ``out``.  The NVMe file answering an error (EIO from a
        failing disk) raises KeyError, a miss, after taking ``obj`` out of L1: left in, every
        lookup would hit an object whose every read fails."""
        try:
            self._backing.read_into(obj.offset, obj.size, out)
        except OSError as exc:
            if self._nvme is None:
                raise
            self._drop_unreadable(obj, exc)
            raise KeyError(f"{obj.key}: the NVMe L1 file could not be read: {exc.strerror}") from None
        except (RuntimeError, ValueError):
            # The copy runs without the L1 lock: a close landing after the presence check
            # released the backing under it (a released arena view, a closed file).  A
            # miss: the object is gone with L1.
            self._miss_if_closed(obj)
            raise

    def _miss_if_closed(self, obj: L1Object) -> None:
        """Raise KeyError (a miss) if L1 is closed, counting and logging the read of
        ``obj`` that failed for it; else return, for the caller to raise its error."""
        with self._lock:
            if not self._table.closed:
                return
            self._closed_reads += 1
        self._closed_read_log.warn(
            "closed",
            "L1 closed while an object was being read out of it (the server stopping); the "
            "read is answered as a miss (failure reason l1_read_closed)",
        )
        raise KeyError(f"{obj.key}: L1 closed while it was being read") from None

    def _fail_if_closed(self, obj: L1Object) -> None:
        """Raise KeyError (the object left L1: its store fails, as when its reservation was
        reaped) if L1 is closed, counting and logging the write of ``obj`` that failed for
        it; else return, for the caller to raise its error.  Nothing was written: the
        released backing refused the copy, so no byte lands in a mapping or file that may
        be another's by now."""
        with self._lock:
            if not self._table.closed:
                return
            self._closed_writes += 1
        self._closed_write_log.warn(
            "closed",
            "L1 closed while an object was being written into it (the server stopping); the "
            "write fails and is not stored (failure reason l1_write_closed)",
        )
        raise KeyError(f"{obj.key}: L1 closed while it was being written") from None

    def _drop_unreadable(self, obj: L1Object, exc: OSError) -> None:
        with self._lock:
            self._read_errors += 1
            present = not self._table.closed and self._table.objects.get(obj.key) is obj
            unstored = present and obj.unstored
            self._read_errors_lost_before_l2 += int(unstored)
            if present:
                # Read-locked or not: its extent is held for its lock holders (counted as
                # dropped, not as a client's forced delete; the line below explains it).
                self._table.free([obj], taken_by="dropped")
        # A dead disk fails the read of every object in L1, each once: one line a minute.
        self._read_error_log.warn(
            "lost" if unstored else "read",
            "NVMe L1: %s could not be read from %s (%s)%s",
            obj.key.file_stem(),
            self._backing_path,
            exc.strerror,
            "; dropped before its L2 store: an acknowledged write lost"
            if unstored
            else ("; dropped from L1" if present else ""),
            level=logging.ERROR if unstored else None,
        )

    def _check_kept(self, obj: L1Object) -> None:
        """Raise KeyError unless ``obj``'s extent is still its own after a copy out of it.

        A reader's lock does not always outlast its copy: its lease can end, and after a
        forced delete a release of the key by another reader is credited to the held
        extent (``l1/leases.py``).  An extent goes back to the allocator before anyone
        else can write it, and never comes back to the same object, so an object still
        in L1, or still held for its readers, had its bytes in place during the copy.
        """
        with self._lock:
            if self._leases.holds(obj) or self._table.objects.get(obj.key) is obj:
                return
        # A close landing after the copy's own transfer empties the table: the close's
        # counted miss, not an object that left an open L1.
        self._miss_if_closed(obj)
        raise KeyError(f"{obj.key} left L1 while it was being copied out: its extent may hold other bytes")

    def _check_written_back(self, obj: L1Object) -> None:
        """NVMe L1, after a copy out of ``obj``'s extent: raise KeyError if the file reported
        a write-back error since ``obj``'s bytes were written (the copy may hold what the
        disk had instead), after taking every object written before it out of L1."""
        if self._nvme is None:
            return
        try:
            errors = self._nvme.writeback_errors()
        except RuntimeError:
            # The file closed after the copy (the question is a transfer of its own).
            self._miss_if_closed(obj)
            raise
        if obj.written_in == errors:
            return
        with self._lock:
            self._refused += 1
            self._drop_written_before(errors)
        raise KeyError(
            f"{obj.key}: the NVMe L1 file reported a write-back error since its bytes were written; "
            "they may not be the ones committed"
        )

    def _drop_written_before(self, errors: int) -> None:
        """Take the READY objects written before the ``errors``-th write-back error out of L1
        (read-locked ones too: their extents are held for their readers).  Objects being
        written then are refused when first read, which drops them."""
        table = self._table
        if table.closed:
            return
        lost = [obj for obj in table.objects.values() if obj.state is _READY and obj.written_in < errors]
        if not lost:
            return
        unstored = sum(1 for obj in lost if obj.unstored)
        self._dropped += len(lost)
        self._lost_before_l2 += unstored
        logger.error(
            "NVMe L1: %d objects written before a write-back error dropped (%d of them not stored "
            "in L2 yet: acknowledged writes lost)",
            len(lost),
            unstored,
        )
        table.free(lost, taken_by="dropped")

    def failures(self) -> dict[str, int]:
        """Write-back errors of the NVMe file, copies refused and objects dropped for them
        (and, of those, the ones not stored in L2 yet: acknowledged writes lost), and the
        leftover block files start-up removed or kept, and the transfers still running
        when close stopped waiting for them; for either backing, the reads answered a miss
        because L1 closed during their copy (``l1_read_closed``), and the writes failed
        for it (``l1_write_closed``)."""
        with self._lock:
            closed = {"l1_read_closed": self._closed_reads, "l1_write_closed": self._closed_writes}
            closed_copies = {reason: count for reason, count in closed.items() if count}
        if self._nvme is None:
            return closed_copies
        with self._lock:
            counts = {
                "l1_nvme_writeback_error": self._nvme.writeback_errors_seen,
                "l1_nvme_writeback_refused": self._refused,
                "l1_nvme_writeback_dropped": self._dropped,
                "l1_nvme_writeback_lost_before_l2": self._lost_before_l2,
                "l1_nvme_read_error": self._read_errors,
                "l1_nvme_read_error_lost_before_l2": self._read_errors_lost_before_l2,
                "l1_nvme_write_error": self._write_errors,
                # once: every write-back question since is an fdatasync
                "l1_nvme_sync_file_range_refused": int(self._nvme.sync_file_range_refused),
                # fixed at start-up: leftover block files of other servers in the directory
                "l1_nvme_stale_files_removed": len(self._nvme.stale_files_removed),
                "l1_nvme_stale_files_kept": len(self._nvme.stale_files_kept),
                # at close: transfers stuck past the wait, the file left open for them
                "l1_nvme_close_transfers_left": self._nvme.transfers_left_at_close,
            }
        return {reason: count for reason, count in counts.items() if count} | closed_copies

    def _check_writing(self, obj: L1Object) -> None:
        self._table.check_present(obj)
        if obj.state is not _WRITING:
            raise ValueError(f"{obj.key} is {obj.state.value}, not being written")


def byte_view(buffer: memoryview) -> memoryview:
    """``buffer`` as a flat view of unsigned bytes, the only shape slice assignment mixes."""
    view = memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")
