"""Large copies into and out of the client's mapping of the arena, on two cores at once.

One thread copying into the mapping does not reach memcpy speed of two pre-faulted
process buffers reused on every copy: an extent of the arena is memory no cache holds
(one thread copies 32 MiB into targets out of cache in about 4 ms where the same copy into
cached targets takes 2.5, on 4 KiB and 2 MiB pages alike), and a range of the mapping this
process never touched needs its page tables populated first, about half a copy's time
again on 4 KiB pages.  A store or retrieve of a request (tens of MiB) is therefore cut into
pieces that the calling thread and one helper thread copy side by side, each taking the
next pieces nobody has taken yet, about ``GROUP_BYTES`` of them at a time (and populating
each first when asked):

* the calling thread takes pieces from the front, the helper from the back, so each
  works through a range of its own and they meet somewhere in the middle: two threads
  taking alternate 1 MiB pieces would populate the same 2 MiB page-table page at once and
  fight over its lock (populating 32 MiB that way took 3.0 ms on two threads against 1.0 ms
  in two halves, and 1.7 ms on one thread);
* nobody waits for the helper to wake up: the calling thread starts on the first piece at
  once, and on a machine too busy to run the helper soon it simply copies every piece
  itself; it waits at most for the group the helper is copying when the rest are done;
* the helper can be started ahead of the first copy (``start``: a client does it at
  connect), so a fresh client's first store does not pay for creating a thread;
* copies under ``SPLIT_MIN_BYTES`` stay in the calling thread (a hand-off costs more than
  it saves there), and so does everything once the copier is stopped.

Both threads copy through numpy and populate through ctypes, which release the GIL for the
bytes, so the two copies really run in parallel.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from lmcache_tiers.wire.after_fork import renew_locks_after_fork

#: copies of fewer bytes run in the calling thread alone
SPLIT_MIN_BYTES = 4 << 20
#: a thread takes pieces of a split copy about this many bytes at a time (one piece at
#: least): the job's lock twice per piece of a store of 256 KiB chunks costs more than the
#: bookkeeping it guards, and a group is short enough that the other thread waits at most
#: that long at the end.  A group is counted in pieces of the copy's average size: a
#: store's pieces are of about one size (its chunks, or ``COPY_PIECE`` blocks of larger
#: ones), and where they are not, a group of its larger pieces holds more bytes
GROUP_BYTES = 1 << 20

#: one piece: copy ``source`` into ``target`` (same size), after ``prepare(block)`` unless
#: ``block`` is negative
Piece = tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], int]


class _Job:
    """Pieces of one copy and who has taken which; its condition guards every field."""

    __slots__ = ("back", "error", "front", "group", "helping", "pieces", "prepare", "running", "settled")

    def __init__(self, pieces: Sequence[Piece], prepare: Callable[[int], object], total: int) -> None:
        self.pieces = pieces
        self.prepare = prepare
        # pieces taken at a time: GROUP_BYTES of pieces of the average size (counted, not
        # summed under the lock)
        self.group = max(1, GROUP_BYTES * len(pieces) // max(1, total))
        # Pieces [front, back) are not taken yet (none are once one failed): the calling
        # thread takes them from the front, the helper from the back.
        self.front = 0
        self.back = len(pieces)
        self.running = 0  # groups taken and not yet done with
        # those of them the helper copies: a signal handler's exception can leave the
        # calling thread's count behind, never the helper's (see ``abandon``)
        self.helping = 0
        self.error: BaseException | None = None
        self.settled = threading.Condition()

    def work(self, from_back: bool = False) -> None:
        """Copy pieces, taking a group of them at a time from the front (or the back),
        until none is left."""
        pieces, group = self.pieces, self.group
        while True:
            with self.settled:
                if self.front >= self.back:
                    return
                if from_back:
                    taken = range(max(self.front, self.back - group), self.back)
                    self.back = taken.start
                else:
                    taken = range(self.front, min(self.back, self.front + group))
                    self.front = taken.stop
                self.running += 1
                self.helping += from_back
            failed: BaseException | None = None
            try:
                for index in taken:
                    target, source, block = pieces[index]
                    if block >= 0:
                        self.prepare(block)
                    target[...] = source
            except BaseException as exc:  # re-raised in the calling thread; the rest of
                failed = exc  # the group is left alone, as are the pieces nobody took
            with self.settled:
                self.running -= 1
                self.helping -= from_back
                if failed is not None and self.error is None:
                    self.error = failed
                    self.front = self.back  # nobody starts another piece
                if self.front >= self.back and not (self.running and self.helping):
                    # ``wait`` (called once nothing is left to take) waits for this alone,
                    # ``abandon`` for the helper's last group: a notify per group costs a
                    # store of many small chunks more than its bookkeeping does.
                    self.settled.notify_all()

    def wait(self) -> None:
        """Until every piece taken is done with (call after ``work``, which leaves none to
        take); then raise the first error, if any."""
        with self.settled:
            while self.running:
                self.settled.wait()
        if self.error is not None:
            raise self.error

    def abandon(self) -> None:
        """The calling thread leaves the copy early (an exception outside its pieces, a
        signal handler's, in ``work`` or ``wait``): no piece is started any more, and the
        group the helper is copying is waited for.  The caller gives the memory back once
        it returns -- a store aborts its reservation, a retrieve releases its extents, a
        client closed meanwhile unmaps the arena -- and a copy after that would write into
        another writer's object, or fault.  At most one group (``GROUP_BYTES``) is waited
        for, also through further exceptions of the kind: the first is the caller's."""
        while True:
            try:
                with self.settled:
                    self.front = self.back
                    while self.helping:
                        self.settled.wait()
                return
            except BaseException:  # another signal handler's: the group ends all the same
                continue


class _HelperQueue:
    """The jobs waiting for the helper, and whether it must end: all the helper thread
    holds between jobs.  Never the copier itself, so that a copier dropped without ``stop``
    (a client the engine never closed) is collected, and its finalizer ends the helper:
    else every such client would leave a thread waiting for work for good.

    The helper sleeps on ``wakeups`` (one token per job offered, one for the stop), not on
    a condition: the finalizer runs in whatever thread a collection started in, the
    helper's own included, between its look at ``stopped`` and its wait.  A notify there
    would wake nobody; a token put there is still taken by the wait that follows, and a
    ``SimpleQueue``'s put may run inside any other call."""

    __slots__ = ("jobs", "lock", "stopped", "wakeups")

    def __init__(self) -> None:
        self.jobs: deque[_Job] = deque()
        self.lock = threading.Lock()
        self.wakeups: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.stopped = False

    def renew_after_fork(self) -> None:
        # In a forked child the helper is gone, and it may have held the lock when the
        # parent forked: a child that took it would wait forever.
        self.lock = threading.Lock()
        self.wakeups = queue.SimpleQueue()
        self.jobs = deque()

    def stop(self) -> None:
        # No lock: the finalizer may run this in a thread that holds it.  Jobs still queued
        # are their callers' to copy and withdraw.
        self.stopped = True
        self.wakeups.put(None)

    def serve(self) -> None:
        """The helper thread: take jobs from the back until stopped."""
        while True:
            self.wakeups.get()
            with self.lock:
                if self.stopped:
                    return
                job = self.jobs.popleft() if self.jobs else None  # None: withdrawn meanwhile
            if job is not None:
                job.work(from_back=True)  # a job the caller already finished has nothing left to take
            # Its ``prepare`` is the page tables' method: kept while idle, it would keep
            # them and this copier from being collected.
            del job


class SplitCopier:
    """The calling thread plus one helper thread (started on the first large copy) copying
    pieces side by side; see the module's docstring."""

    def __init__(self, name: str = "shm-copy") -> None:
        self._name = name
        self._queue = _HelperQueue()
        self._helper: threading.Thread | None = None
        # Not at exit: the helper is a daemon, and nothing needs to wait for it then.
        weakref.finalize(self, self._queue.stop).atexit = False
        renew_locks_after_fork(self)

    def _after_fork(self) -> None:
        # The same queue object, renewed: the finalizer and the helper refer to it.
        self._queue.renew_after_fork()
        self._helper = None

    def run(self, pieces: Sequence[Piece], prepare: Callable[[int], object]) -> None:
        """Copy every piece; returns once all are copied, raising the first error (the
        pieces not started yet are left alone then)."""
        total = sum(source.nbytes for _, source, _ in pieces)
        helper_queue = self._queue
        offered = False
        if len(pieces) > 1 and total >= SPLIT_MIN_BYTES:
            job = _Job(pieces, prepare, total)
            with helper_queue.lock:
                offered = not helper_queue.stopped
                if offered:
                    self._start_helper()
                    helper_queue.jobs.append(job)
        if not offered:
            # Nobody else takes a piece: copied in order, with no locking per piece.
            for target, source, block in pieces:
                if block >= 0:
                    prepare(block)
                target[...] = source
            return
        helper_queue.wakeups.put(None)
        try:
            try:
                job.work()
                job.wait()
            except BaseException:
                job.abandon()
                raise
        finally:
            # Not taken up by the helper (busy with another copy): it would keep this
            # copy's buffers alive until it is.
            with helper_queue.lock, contextlib.suppress(ValueError):
                helper_queue.jobs.remove(job)

    def start(self) -> None:
        """Start the helper now rather than on the first large copy (no-op once stopped)."""
        with self._queue.lock:
            if not self._queue.stopped:
                self._start_helper()

    def _start_helper(self) -> None:
        # Caller holds the queue's lock.  A helper that is not alive was never started, or
        # was left behind in the parent of this forked process.
        if self._helper is None or not self._helper.is_alive():
            self._helper = threading.Thread(target=self._queue.serve, name=self._name, daemon=True)
            self._helper.start()

    def stop(self) -> None:
        """Stop the helper (after the piece it is copying); later copies run in the caller."""
        self._queue.stop()
        helper = self._helper
        if helper is not None and helper is not threading.current_thread():
            helper.join()
