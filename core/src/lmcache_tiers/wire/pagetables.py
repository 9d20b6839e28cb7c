"""Page tables of a client's mapping of the arena, filled before its copies need them.

A fresh mapping has no page-table entries: the first copy into each 4 KiB page takes a
page fault (about 1 us with the copy, so a 32 MiB store from a client that just connected
costs several times its memcpy).  ``madvise(MADV_POPULATE_READ)`` (Linux >= 5.14) maps the
pages without touching a byte (the server's pages already exist; only this process's
entries are missing), and it runs without the GIL through ctypes.  It is the read variant
because a read fault maps a whole fault-around window (64 KiB) at once where a write fault
maps one page: about a third cheaper than ``MADV_POPULATE_WRITE`` in the measurements, and on
a shared tmpfs mapping (which needs no write notification) the entries it makes are
writable, so the copies that follow run as fast as into a mapping populated for writing.
:class:`PageTables` uses it twice:

* a background pass over the whole mapping, started at connect, at the lowest CPU
  priority (nice 19), that runs only while the client is idle (no store or retrieve in
  progress, none for ``IDLE_S``), so it takes only CPU nobody else wants and never
  contends with a copy for the page-table locks; in steps short enough that a request
  or ``close`` never waits long for it;
* for a store's copy into a range the background pass has not reached yet, each
  ``COPY_PIECE`` block is populated right before its part is copied, by whichever thread
  copies that part: a large copy is split between the calling thread and a helper thread
  (:mod:`lmcache_tiers.wire.copies`), so population and copying run on two cores, and
  nobody waits for the other to wake up.

Reads are not populated ahead (a read fault already maps a fault-around window), but
large ones are split between the two threads the same way.

Population never changes a byte: if the kernel lacks it (or anything fails) the copies
fault pages in as they always did, and one log line says so.  On an arena the server put
on huge pages (a tmpfs mounted ``huge=``, see ``lmcache_tiers.l1.segment``) the same calls
map 2 MiB per entry: the mapping is 2 MiB-aligned, every step here is a multiple of 1 MiB,
so a populated block at worst maps the huge page it lies in, and the background pass and
a copy's own population finish hundreds of times sooner; nothing else changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lmcache_tiers.tmpfs import libc_function
from lmcache_tiers.wire.after_fork import renew_locks_after_fork
from lmcache_tiers.wire.copies import Piece, SplitCopier

log = logging.getLogger(__name__)

#: madvise(2) advice that maps pages (a fault-around window per fault) without touching
#: their bytes
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: bytes the background pass populates per call (~0.6 ms): how long a copy that starts
#: meanwhile, or ``close``, may wait for it
BACKGROUND_STEP = 2 << 20
#: bytes a copy populates, then copies, at a time (one piece of a split copy): the
#: mapping is tracked in blocks of this size, each populated once
COPY_PIECE = 1 << 20
#: the background pass runs only once the client has been idle this long (no request and
#: no copy): a client that connects and stores at once is served by the copy's own
#: population, and the background pass never competes with a burst of requests
IDLE_S = 0.02
_PAGE = mmap.PAGESIZE


# Through ctypes rather than mmap.madvise: ctypes releases the GIL for the call, so
# populating gigabytes in the background never stalls the caller's requests.
_madvise = libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))


class PageTables:
    """Fills the page tables of ``size`` mapped bytes at ``address`` (see the module)."""

    def __init__(self, address: int, size: int) -> None:
        self._address = address
        self._size = size
        self._done_below = 0  # the background pass has populated [0, _done_below)
        self._stop = threading.Event()
        self._failed = _madvise is None
        self._background: threading.Thread | None = None
        self._busy = 0  # requests and copies in progress (the background pass waits for none)
        self._last_active = time.monotonic()
        # which COPY_PIECE blocks are populated (either way), so no block is asked twice
        self._populated = bytearray(-(-size // COPY_PIECE))
        self._idle = threading.Condition()
        self._copier = SplitCopier()
        renew_locks_after_fork(self)

    def _after_fork(self) -> None:
        # The background pass or a copy may have held the condition's lock when the
        # process forked: in the child that thread does not exist, and ``stop`` (a
        # client's close) would wait for the lock forever.
        self._idle = threading.Condition()

    @property
    def complete(self) -> bool:
        """True once the whole mapping is populated, or when nothing will be."""
        return self._failed or self._done_below >= self._size

    def start(self) -> None:
        """Start the background pass over the whole mapping, and the copy helper, so the
        first large copy finds it waiting instead of creating it."""
        self._copier.start()
        if self.complete or self._background is not None:
            return
        self._background = threading.Thread(target=self._run_background, name="shm-populate", daemon=True)
        self._background.start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the background pass; True once it has covered the whole mapping."""
        if self._background is not None:
            self._background.join(timeout)
        return self.complete

    def write(self, target: np.ndarray[Any, Any], source: np.ndarray[Any, Any], offset: int) -> None:
        """``target[:] = source`` where ``target`` is the mapping's ``[offset, offset + n)``
        (see ``write_many``)."""
        self.write_many([(target, source, offset)])

    def write_many(self, copies: Sequence[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]]) -> None:
        """``target[:] = source`` for each ``(target, source, offset)``, ``target`` being the
        mapping's ``[offset, offset + n)``.  Each ``COPY_PIECE`` block of the mapping they
        touch is populated (once for the mapping's lifetime) right before its part is
        copied; large copies run on two threads (:mod:`lmcache_tiers.wire.copies`)."""
        for target, source, _ in copies:
            if target.nbytes != source.nbytes:
                raise ValueError(f"cannot copy {source.nbytes} bytes into a {target.nbytes}-byte range")
        ahead = not (self._failed or self._stop.is_set())
        populated = self._populated
        pieces: list[Piece] = []
        for target, source, offset in copies:
            end = offset + source.nbytes
            first = offset // COPY_PIECE
            if end <= (first + 1) * COPY_PIECE:  # within one block (small chunks): no slicing
                pieces.append((target, source, first if ahead and not populated[first] else -1))
                continue
            for block in range(first, -(-end // COPY_PIECE)):
                start = block * COPY_PIECE
                low, high = max(start, offset) - offset, min(start + COPY_PIECE, end) - offset
                wanted = ahead and not populated[block]
                pieces.append((target[low:high], source[low:high], block if wanted else -1))
        with self.in_use():
            self._copier.run(pieces, self._populate_block)

    def read_many(self, copies: Sequence[tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]]) -> None:
        """``target[:] = source`` for each ``(target, source)``, ``source`` being a range of
        the mapping: not populated ahead (a read fault maps a fault-around window), but
        large copies run on two threads too."""
        pieces: list[Piece] = []
        for target, source in copies:
            if target.nbytes != source.nbytes:
                raise ValueError(f"cannot copy {source.nbytes} bytes into a {target.nbytes}-byte buffer")
            for low in range(0, source.nbytes, COPY_PIECE):
                pieces.append((target[low : low + COPY_PIECE], source[low : low + COPY_PIECE], -1))
        self._copier.run(pieces, self._populate_block)

    def _populate_block(self, block: int) -> None:
        # Either copying thread: two populating the same block (two slots sharing it) only
        # repeat a call that changes nothing.
        if not self._populated[block]:
            start = block * COPY_PIECE
            if self._advise(start, min(COPY_PIECE, self._size - start)):
                self._populated[block] = 1

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Pause the background pass while the block runs (a request and its copies), so it
        never takes a core, or the page-table locks, from the work it exists to speed up."""
        with self._idle:
            self._busy += 1
        try:
            yield
        finally:
            with self._idle:
                self._busy -= 1
                self._last_active = time.monotonic()
                self._idle.notify_all()

    def stop(self) -> None:
        """Stop populating and wait for the calls in progress (before unmapping)."""
        self._stop.set()
        self._copier.stop()
        with self._idle:
            self._idle.notify_all()
        thread = self._background
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    # -- threads ---------------------------------------------------------------------------

    def _run_background(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            # Linux applies a nice value to the one thread whose id is given.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        populated = self._populated
        step = BACKGROUND_STEP // COPY_PIECE
        for first in range(0, len(populated), step):
            if self._stop.is_set():
                return
            blocks = range(first, min(len(populated), first + step))
            if not all(populated[block] for block in blocks):
                self._wait_until_idle()
                start = first * COPY_PIECE
                if self._stop.is_set() or not self._advise(start, min(step * COPY_PIECE, self._size - start)):
                    return
                populated[first : blocks.stop] = b"\x01" * len(blocks)
            self._done_below = min(self._size, blocks.stop * COPY_PIECE)

    def _wait_until_idle(self) -> None:
        with self._idle:
            while not self._stop.is_set():
                quiet = time.monotonic() - self._last_active
                if self._busy == 0 and quiet >= IDLE_S:
                    return
                self._idle.wait(IDLE_S - quiet if self._busy == 0 else None)

    def _advise(self, offset: int, length: int) -> bool:
        if self._failed:
            return False
        if _madvise(self._address + offset, length, MADV_POPULATE_READ) == 0:
            return True
        code = ctypes.get_errno()
        self._failed = True
        reason = (
            "the kernel cannot (it is older than 5.14)"
            if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)
            else os.strerror(code)
        )
        log.info("not populating the shared-memory mapping ahead (%s): first copies fault pages in", reason)
        return False
