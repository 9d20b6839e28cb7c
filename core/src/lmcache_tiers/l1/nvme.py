"""NVMe L1 backing: objects live in blocks of one preallocated file instead of memory.

The file ``<directory>/lmcache_tiers_l1_<pid>_<random>.blocks`` is sized to the L1 capacity
once, so a full disk is an error at start-up rather than in the middle of a write, and is
read and written at object offsets with ``O_DIRECT``: KV objects are large and read once
or twice, so the page cache would only double the memory they cost. ``O_DIRECT`` needs the
buffer address, file offset and length aligned to the device block; the allocator's extents
give aligned offsets and room to round lengths up, and caller buffers that are not aligned
go through page-aligned bounce buffers.

GPUDirect Storage (cuFile) moves data between NVMe and *GPU* memory. This L1 always
transfers to and from host memory (client bytes, adapter buffers), where cuFile would
fall back to the same POSIX I/O, so its presence is only detected and reported.

The creating process removes the file on :meth:`NvmeL1File.close` (or, when close stopped
waiting for transfers stuck on a hung disk, as the last of them ends), at garbage
collection or at interpreter exit; :func:`remove_stale_block_files` reaps files of killed
servers.

A write that reaches the page cache (buffered I/O, or a filesystem that falls back to it
under ``O_DIRECT``) can still fail when the kernel writes it back, and the pages it dropped
then read back as whatever the disk holds.  The kernel keeps such an error for each open
file description until asked; :meth:`NvmeL1File.writeback_errors` asks after every read
(``sync_file_range`` of a range past the end of the file: no pages to wait for, one
syscall) and counts the errors it learns of.  Which pages failed is not reported, so the
L1 manager treats every object written before an error as lost (``l1/access.py``).
"""

from __future__ import annotations

import contextlib
import ctypes.util
import errno
import logging
import mmap
import os
import re
import secrets
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import Self  # annotations only: Python 3.10 has no typing.Self

from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.l1.stale import create_as_creator, release_as_creator, remove_files_of_dead_processes

logger = logging.getLogger(__name__)

#: Alignment of O_DIRECT transfers: the page size, which is a multiple of the logical
#: block size of every common device (512 B or 4 KiB).
DIRECT_IO_ALIGN = 4096
FILE_PREFIX = "lmcache_tiers_l1_"
FILE_SUFFIX = ".blocks"
# The pid as default_block_file_name writes it (ASCII, short enough for kill(2)'s pid_t):
# a stray longer "pid" made the reaping at start-up fail with OverflowError.  \Z, not $,
# which also matches before a final newline.
_FILE_NAME = re.compile(rf"^{FILE_PREFIX}([1-9][0-9]{{0,8}})_[0-9a-f]+{re.escape(FILE_SUFFIX)}\Z")
# Unaligned caller buffers are copied through bounce buffers of at most this size, so a
# large object costs a bounded amount of extra memory per concurrent transfer.
BOUNCE_BYTES = 4 << 20
#: How long :meth:`NvmeL1File.close` waits for transfers in progress: one stuck on a hung
#: disk must not hold the shutdown for good.  The descriptor stays open for those left,
#: and the last of them to end closes and removes the file.
CLOSE_WAIT_S = 10.0


#: sync_file_range(2) flag: wait for write-back already running on the range (none, past
#: the end of the file), then report the file's write-back error not yet reported
_SYNC_FILE_RANGE_WAIT_BEFORE = 1
_libc = ctypes.CDLL(None, use_errno=True)
_sync_file_range = getattr(_libc, "sync_file_range", None)
#: errors of sync_file_range that refuse the call rather than report a write-back failure
_CALL_REFUSED = frozenset({errno.ENOSYS, errno.EPERM, errno.EINVAL, errno.ESPIPE})
if _sync_file_range is not None:
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    _sync_file_range.restype = ctypes.c_int


def cufile_library() -> str | None:
    """Name of the cuFile (GPUDirect Storage) library if the loader can find it; never loads it."""
    return ctypes.util.find_library("cufile")


def aligned_buffer(size: int) -> memoryview:
    """A writable, zeroed, page-aligned buffer of ``size`` bytes.

    Anonymous mappings start on a page boundary, so an ``O_DIRECT`` transfer into or out of
    such a buffer needs no bounce copy. The mapping is unmapped once the view is released.
    """
    if size < 0:
        raise ValueError(f"buffer size must not be negative, got {size}")
    region = mmap.mmap(-1, max(_round_up(size), DIRECT_IO_ALIGN))
    return memoryview(region)[:size]


def default_block_file_name() -> str:
    """``lmcache_tiers_l1_<pid>_<random>.blocks``: unique per server, traceable to its process."""
    return f"{FILE_PREFIX}{os.getpid()}_{secrets.token_hex(4)}{FILE_SUFFIX}"


def _round_up(size: int) -> int:
    return -(-size // DIRECT_IO_ALIGN) * DIRECT_IO_ALIGN


def _is_aligned(buffer: memoryview) -> bool:
    # numpy reads the address through the buffer protocol without a copy, read-only
    # buffers (bytes) included, which ctypes.from_buffer refuses. Imported here because
    # only an NVMe L1 needs it and it is slow to import.
    import numpy as np

    address = int(np.frombuffer(buffer, dtype=np.uint8).ctypes.data)
    return address % DIRECT_IO_ALIGN == 0


def _no_direct_io(directory: str) -> ConfigError:
    return ConfigError(
        f"--gds-l1-path {directory}: the filesystem does not support O_DIRECT; put the NVMe L1 "
        "on a local disk filesystem (ext4, xfs) or pass --no-gds-l1-use-direct-io"
    )


def _release(fd: int, path: str, owner_pid: int) -> None:
    """Finalizer: in the creating process only, remove the file; then close it (after the
    unlink: the descriptor holds the creator's lock, and the name never exists unlocked
    while its creator lives).

    Must not reference the NvmeL1File, or it could never be collected. A forked child
    inherits the finalizer; the pid check keeps it from removing its parent's file.
    """
    try:
        if os.getpid() == owner_pid:
            _remove_block_file(path)
    finally:
        release_as_creator(fd)


def _remove_block_file(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        # A failed disk (EIO) or a read-only remount: closing must still let go of the
        # descriptor and its lock, so that the next start-up reaps the file.
        logger.warning(
            "NVMe L1 file %s could not be removed (%s); the next server started on its directory removes it",
            path,
            exc.strerror,
        )


class NvmeL1File:
    """Byte-addressed storage for L1 objects in one preallocated file under ``directory``.

    Offsets must be multiples of :data:`DIRECT_IO_ALIGN` and the block rounded up from
    ``offset + size`` must lie inside the file: the L1 allocator's extents satisfy both.
    Transfers may run concurrently from any thread; :meth:`close` waits for them, up to
    :data:`CLOSE_WAIT_S`.
    """

    path: str
    size: int
    direct_io: bool

    def __init__(self, directory: str, size_bytes: int, *, direct_io: bool = True) -> None:
        if size_bytes <= 0 or size_bytes % DIRECT_IO_ALIGN:
            raise ConfigError(
                f"NVMe L1 size must be a positive multiple of {DIRECT_IO_ALIGN} bytes, got {size_bytes}"
            )
        if not os.path.isdir(directory):
            raise ConfigError(f"--gds-l1-path {directory}: not an existing directory")
        kept: list[str] = []
        removed = remove_stale_block_files(directory, kept)
        path = os.path.join(directory, default_block_file_name())
        fd = _create(path, directory, direct_io)
        try:
            _preallocate(fd, path, directory, size_bytes)
            if direct_io:
                _probe_direct_io(fd, directory)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            release_as_creator(fd)
            raise
        self.path = path
        self.size = size_bytes
        #: leftover block files of other servers that start-up removed (killed servers'),
        #: and those it left in place (in use, or not provably not): each logged, and
        #: counted in the L1's failures
        self.stale_files_removed = removed
        self.stale_files_kept = kept
        self.direct_io = direct_io
        self._fd = fd
        self._bounce_pool: list[memoryview] = []
        self._state = threading.Condition()
        self._in_flight = 0
        self._closed = False
        #: transfers still running when :meth:`close` stopped waiting (counted in the L1's
        #: failures); the last of them to end releases the file
        self.transfers_left_at_close = 0
        # Write-back errors learnt of so far; asking and counting is one step, so a reader
        # that asks right after another learnt of one finds it counted.
        self._writeback_lock = threading.Lock()
        self._no_sync_file_range = False  # set once the system refuses the call itself
        self._writeback_errors = 0
        # weakref.finalize also runs at interpreter exit, which covers servers that exit
        # through an exception without calling close().
        self._finalizer = weakref.finalize(self, _release, fd, path, os.getpid())
        logger.info("NVMe L1: %s", _io_path_description(path, direct_io))

    # -- transfers ---------------------------------------------------------------------

    def read_into(self, offset: int, size: int, out: memoryview) -> None:
        """Copy ``size`` bytes at ``offset`` into ``out[:size]`` (a writable byte view)."""
        if out.nbytes < size:
            raise ValueError(f"output buffer of {out.nbytes} bytes cannot hold {size} bytes")
        self._check_range(offset, size)
        if size == 0:
            return
        out = out[:size]
        with self._transfer():
            direct = self._direct_bytes(out, writable=True)
            if direct:
                self._pread_all(out[:direct], offset)
            done = direct
            while done < size:
                chunk = min(size - done, BOUNCE_BYTES)
                with self._bounce() as bounce:
                    self._pread_all(bounce[: _round_up(chunk)], offset + done)
                    out[done : done + chunk] = bounce[:chunk]
                done += chunk

    def write_from(self, offset: int, data: memoryview) -> None:
        """Copy the byte view ``data`` to ``offset``; with O_DIRECT the rest of its last
        block is zero-filled (it lies inside the object's extent and is never read)."""
        size = data.nbytes
        self._check_range(offset, size)
        if size == 0:
            return
        with self._transfer():
            direct = self._direct_bytes(data, writable=False)
            if direct:
                self._pwrite_all(data[:direct], offset)
            done = direct
            while done < size:
                chunk = min(size - done, BOUNCE_BYTES)
                length = _round_up(chunk) if self.direct_io else chunk
                with self._bounce() as bounce:
                    bounce[:chunk] = data[done : done + chunk]
                    # A pooled bounce buffer still holds an earlier object's bytes.
                    bounce[chunk:length] = bytes(length - chunk)
                    self._pwrite_all(bounce[:length], offset + done)
                done += chunk

    @property
    def sync_file_range_refused(self) -> bool:
        """Whether the system refused sync_file_range itself, so that every write-back
        question since is an fdatasync (which writes back what is dirty)."""
        return self._no_sync_file_range

    @property
    def writeback_errors_seen(self) -> int:
        """Write-back errors counted so far, without asking the kernel: a write started now
        cannot be among those that failed."""
        return self._writeback_errors

    def writeback_errors(self) -> int:
        """Write-back errors of the file so far, the kernel asked first.  Called after a read:
        if pages of the bytes read had been dropped after a failed write-back, the error was
        recorded before they could be, so it is counted here (or was, by an earlier call)."""
        with self._writeback_lock:
            if self._ask_writeback():
                self._writeback_errors += 1
            return self._writeback_errors

    def _ask_writeback(self) -> bool:
        """Whether the kernel reports a write-back error on the file not reported to us yet."""
        if _sync_file_range is not None and not self._no_sync_file_range:
            with self._transfer():
                if _sync_file_range(self._fd, self.size, DIRECT_IO_ALIGN, _SYNC_FILE_RANGE_WAIT_BEFORE) == 0:
                    return False
                code = ctypes.get_errno()
            if code not in _CALL_REFUSED:
                self._log_writeback_error(code)
                return True
            # The call itself is refused here (a seccomp filter, a file type it does not
            # take): no answer about write-back.  Taking that for an error would drop all of
            # L1 on every read; fdatasync asks the same question.
            self._no_sync_file_range = True
            logger.warning(
                "NVMe L1 file %s: sync_file_range is refused (%s); write-back errors are asked "
                "with fdatasync instead, which also writes back what is dirty",
                self.path,
                os.strerror(code),
            )
        # Not Linux, or refused: nothing to ask cheaply; fdatasync reports the same error,
        # at the price of writing back whatever is dirty.  As a transfer: after close the
        # descriptor may be another file's, and its EBADF no write-back error of ours.
        with self._transfer():
            try:
                os.fdatasync(self._fd)
            except OSError as exc:
                self._log_writeback_error(exc.errno)
                return True
        return False

    def _log_writeback_error(self, code: int | None) -> None:
        logger.error(
            "NVMe L1 file %s: writing back to the disk failed (%s); every object written before "
            "now is dropped from L1",
            self.path,
            os.strerror(code) if code else "unknown error",
        )

    def _direct_bytes(self, buffer: memoryview, *, writable: bool) -> int:
        """How many leading bytes of ``buffer`` can be transferred without a bounce copy."""
        if writable and buffer.readonly:
            raise ValueError("cannot read into a read-only buffer")
        if not self.direct_io:
            return buffer.nbytes  # buffered I/O has no alignment rules
        if not _is_aligned(buffer):
            return 0
        return buffer.nbytes // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN

    def _check_range(self, offset: int, size: int) -> None:
        if size < 0:
            raise ValueError(f"transfer size must not be negative, got {size}")
        if offset % DIRECT_IO_ALIGN:
            raise ValueError(f"NVMe L1 offset {offset} is not a multiple of {DIRECT_IO_ALIGN}")
        if offset < 0 or offset + _round_up(size) > self.size:
            raise ValueError(f"{size} bytes at offset {offset} do not fit the {self.size}-byte NVMe L1")

    def _pread_all(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < buffer.nbytes:
            count = os.preadv(self._fd, [buffer[done:]], offset + done)
            if count == 0:
                # An OSError, as EIO would be: the L1 takes the object out and answers a
                # miss (counted), where another exception left it in for every read to fail.
                raise OSError(errno.EIO, f"the file ends at byte {offset + done}: was it truncated?")
            done += count

    def _pwrite_all(self, buffer: memoryview, offset: int) -> None:
        done = 0
        while done < buffer.nbytes:
            count = os.pwrite(self._fd, buffer[done:], offset + done)
            if count == 0:
                # A write that takes no bytes would otherwise be retried forever, and
                # close() waits for every transfer.  An OSError, as ENOSPC would be: the
                # writer's store fails and the L1 counts it as a write error.
                raise OSError(errno.EIO, f"the file took no bytes at byte {offset + done}")
            done += count

    @contextmanager
    def _transfer(self) -> Iterator[None]:
        # close() must not close the descriptor under a running transfer: the number could
        # be reused by another open() and the transfer would hit an unrelated file.
        with self._state:
            if self._closed:
                raise RuntimeError(f"NVMe L1 file {self.path} is closed")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._state:
                self._in_flight -= 1
                last_left_at_close = self._in_flight == 0 and self.transfers_left_at_close > 0
                if self._in_flight == 0:
                    self._state.notify_all()
            if last_left_at_close:
                self._release_file()

    @contextmanager
    def _bounce(self) -> Iterator[memoryview]:
        # Reused rather than mapped per call: a fresh mapping costs a syscall and a page
        # fault per page. The pool grows to the number of concurrent transfers.
        with self._state:
            bounce = self._bounce_pool.pop() if self._bounce_pool else aligned_buffer(BOUNCE_BYTES)
        try:
            yield bounce
        finally:
            with self._state:
                self._bounce_pool.append(bounce)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, wait_s: float | None = None) -> None:
        """Refuse new transfers, wait up to ``wait_s`` (:data:`CLOSE_WAIT_S` if None) for
        running ones, then close and remove the file. Safe to call twice.

        Transfers still running then (a hung disk) are counted
        (:attr:`transfers_left_at_close`) and logged, and the file stays open for them:
        closing the descriptor under them could let another ``open()`` reuse its number,
        and their bytes go to an unrelated file.  The last of them to end releases it.
        """
        if wait_s is None:
            wait_s = CLOSE_WAIT_S
        with self._state:
            if self._closed:
                return
            self._closed = True
            if not self._state.wait_for(lambda: self._in_flight == 0, timeout=wait_s):
                self.transfers_left_at_close = self._in_flight
        if self.transfers_left_at_close:
            logger.error(
                "NVMe L1 file %s: %d transfers still running %gs after close began (a hung "
                "disk?); the file is closed and removed when the last of them ends, or at exit",
                self.path,
                self.transfers_left_at_close,
                wait_s,
            )
            return
        self._release_file()

    def _release_file(self) -> None:
        """Unmap the bounce buffers, then close and remove the file (once: the finalizer
        runs at most once).  Only with no transfer running."""
        with self._state:
            pool, self._bounce_pool = self._bounce_pool, []
        for bounce in pool:
            bounce.release()  # the last reference to its mapping: unmapped here
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("O_DIRECT" if self.direct_io else "buffered")
        return f"NvmeL1File(path={self.path!r}, size={self.size}, {state})"


def _create(path: str, directory: str, direct_io: bool) -> int:
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | (os.O_DIRECT if direct_io else 0)
    try:
        # The directory may be on NFS without a lock manager: no lock for anyone there.
        return create_as_creator(path, flags, lock_required=False)
    except OSError as exc:
        if exc.errno == errno.EINVAL and direct_io:
            # Linux creates the file before the filesystem gets to refuse O_DIRECT.
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise _no_direct_io(directory) from None
        raise ConfigError(f"--gds-l1-path {directory}: cannot create {path}: {exc.strerror}") from None


def _preallocate(fd: int, path: str, directory: str, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            stat = os.statvfs(directory)
            raise TiersError(
                f"cannot place a {size / 2**30:.2f} GiB NVMe L1 in {directory} "
                f"({stat.f_bavail * stat.f_frsize / 2**30:.2f} GiB free): lower --l1-size-gb "
                "or free disk space"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        # No fallocate on this filesystem: a sparse file works, but blocks are only
        # allocated on first write, so a full disk shows up then.
        logger.warning("%s does not preallocate; the NVMe L1 file %s is sparse", directory, path)
        os.ftruncate(fd, size)


def _probe_direct_io(fd: int, directory: str) -> None:
    """One aligned write and read of block 0: some filesystems (FUSE, network) accept
    O_DIRECT at open and refuse it on the first transfer, which must fail here, not in a request."""
    block = mmap.mmap(-1, DIRECT_IO_ALIGN)
    try:
        os.pwrite(fd, block, 0)
        os.preadv(fd, [block], 0)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise _no_direct_io(directory) from None
        raise
    finally:
        block.close()


def _io_path_description(path: str, direct_io: bool) -> str:
    mode = "O_DIRECT" if direct_io else "buffered"
    library = cufile_library()
    if library is None:
        return f"cuFile not available, using {mode} file I/O on {path}"
    return (
        f"cuFile found ({library}) but L1 transfers go to host memory, which GPUDirect Storage "
        f"does not accelerate; using {mode} file I/O on {path}"
    )


def remove_stale_block_files(directory: str, kept: list[str] | None = None) -> list[str]:
    """Remove default-named block files in ``directory`` whose creating process is gone;
    returns their names.

    A killed server's file would hold the disk space of a whole L1.  Only names of the form
    ``lmcache_tiers_l1_<pid>_<hex>.blocks`` are touched.  ``kept``, when given, receives
    the names of those of creators not seen here that were left in place (a live process
    this start-up cannot see holds the creator's lock, the lock cannot be checked, the file
    is not this process's to remove).
    """
    return remove_files_of_dead_processes(directory, _FILE_NAME, "NVMe L1 file", kept=kept)
