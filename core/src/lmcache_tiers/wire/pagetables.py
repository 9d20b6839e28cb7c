"""Page tables of a client's mapping of the arena, filled before its copies need them.

A fresh mapping has no page-table entries: the first copy into each 4 KiB page takes a
page fault (about 1 us with the copy, so a 32 MiB store from a client that just connected
costs several times its memcpy).  ``madvise(MADV_POPULATE_WRITE)`` (Linux >= 5.14) maps
the pages in one call at about a third of that, without touching a byte (the server's
pages already exist; only this process's entries are missing), and it runs without the
GIL through ctypes.  :class:`PageTables` uses it twice:

* a background pass over the whole mapping, started at connect, at the lowest CPU
  priority (nice 19), that runs only while the client is idle (no store or retrieve in
  progress, none for ``IDLE_S``), so it takes only CPU nobody else wants and never
  contends with a copy for the page-table locks; in steps short enough that a request
  or ``close`` never waits long for it;
* for a store's copy into a range the background pass has not reached yet, the copying
  thread populates the range a piece at a time right before copying that piece: cheaper
  than faulting page by page, and, unlike handing the population to another thread, it
  costs no wake-up per piece, which on a busy machine can take longer than the copy.

Reads are left alone: a read fault maps a whole fault-around window (64 KiB) at once,
so a copy out of a fresh mapping is already near memcpy speed.

Population never changes a byte: if the kernel lacks it (or anything fails) the copies
fault pages in as they always did, and one log line says so.  Huge pages would avoid most
of this, but tmpfs only gives them where ``shmem_enabled`` allows, which cannot be
assumed.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: madvise(2) advice that maps pages writable without touching their bytes
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
#: bytes the background pass populates per call (~0.6 ms): how long a copy that starts
#: meanwhile, or ``close``, may wait for it
BACKGROUND_STEP = 2 << 20
#: bytes a store's copy populates, then copies, at a time: the mapping is tracked in
#: blocks of this size, each populated once
COPY_PIECE = 1 << 20
#: the background pass runs only once the client has been idle this long (no request and
#: no copy): a client that connects and stores at once is served by the copy's own
#: population, and the background pass never competes with a burst of requests
IDLE_S = 0.02
_PAGE = mmap.PAGESIZE


def _load_madvise() -> Any:
    # Through ctypes rather than mmap.madvise: ctypes releases the GIL for the call, so
    # populating gigabytes in the background never stalls the caller's requests.
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _load_madvise()


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

    @property
    def complete(self) -> bool:
        """True once the whole mapping is populated, or when nothing will be."""
        return self._failed or self._done_below >= self._size

    def start(self) -> None:
        """Start the background pass over the whole mapping."""
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
        """``target[:] = source`` where ``target`` is the mapping's ``[offset, offset + n)``;
        each ``COPY_PIECE`` block of the mapping it touches is populated (once for the
        mapping's lifetime) right before its part is copied."""
        size = source.nbytes
        if target.nbytes != size:
            raise ValueError(f"cannot copy {size} bytes into a {target.nbytes}-byte range")
        end = offset + size
        if self._failed or self._stop.is_set() or end <= self._done_below:
            target[:] = source
            return
        populated = self._populated
        with self.in_use():
            for block in range(offset // COPY_PIECE, -(-end // COPY_PIECE)):
                start = block * COPY_PIECE
                if not populated[block] and self._advise(start, min(COPY_PIECE, self._size - start)):
                    populated[block] = 1
                low, high = max(start, offset) - offset, min(start + COPY_PIECE, end) - offset
                target[low:high] = source[low:high]

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
        if _madvise(self._address + offset, length, MADV_POPULATE_WRITE) == 0:
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
