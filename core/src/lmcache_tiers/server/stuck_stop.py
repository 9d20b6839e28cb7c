"""Ending the process when a forced stop cannot finish: a thread stuck holding a lock.

A second stop signal (or SIGQUIT as the first) forces the stop: the drain is cut short,
the flush abandoned, and the main thread goes on to close the storage.  A plugin stuck
while it holds a lock that close needs (an L1 eviction policy whose hook never returns
holds L1's lock) keeps the main thread waiting for good.  Python runs signal handlers on
the main thread only, between its bytecodes, so every further signal went unheard too
and only SIGKILL ended the process, leaving the L1 segment in /dev/shm.

:class:`StuckStopGuard` hears the signals without the main thread: Python's C-level
handler writes each signal's number to the wake-up descriptor (``signal.set_wakeup_fd``)
whichever thread the signal interrupted, and a thread of the guard's own reads it.  When
the forced stop has not finished :data:`FORCED_STOP_WINDOW_S` after the signal that forced
it, or at the next stop signal, the guard ends the process: the L1 segment (or NVMe L1
file) and the ipc socket files are removed by name, which takes no lock, one line says
what was left undone, and the exit status is the stop's -- 1 (the stop failed), or 3
(:data:`EXIT_ACKNOWLEDGED_WRITES_LOST`) unless the L2 stores
still pending could be counted as none.

A graceful stop (one signal) is held up the same way, and nobody may send a second one
(a supervisor waits its own timeout, then sends SIGKILL, which leaves the segment behind).
Every step of it has a deadline (the drain, the front ends' join, the flush), so one still
running :func:`graceful_stop_window_s` after its signal, which adds
:data:`GRACEFUL_CLOSE_WINDOW_S` for the close, is ended the same way.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lmcache_tiers.storage import StorageManager

__all__ = [
    "EXIT_ACKNOWLEDGED_WRITES_LOST",
    "EXIT_STOP_FAILED",
    "FORCED_STOP_WINDOW_S",
    "GRACEFUL_CLOSE_WINDOW_S",
    "CreatedFile",
    "StuckStopGuard",
    "files_created",
    "graceful_stop_window_s",
]

logger = logging.getLogger("lmcache_tiers.server.app")

#: how long the forced stop gets to finish its close by itself before the guard ends the
#: process.  A forced close that no thread holds up takes well under a second (every wait
#: in it is cut short or has a deadline of its own); one still running after this waits
#: on a thread that will not let go.
FORCED_STOP_WINDOW_S = 3.0
#: how long a graceful stop's close gets once its deadlines (drain, join, flush) have all
#: passed.  Far longer than a forced one's: nearly every stop is graceful, and an adapter
#: closing its connections after a real flush must never be taken for a stuck thread.
GRACEFUL_CLOSE_WINDOW_S = 30.0
#: how long a step of the ending that may need a lock (counting the pending L2 stores,
#: writing the log line) is waited for before the process ends without it
_STEP_WAIT_S = 0.5
#: the exit status of a stop that failed (``run_server`` documents every status)
EXIT_STOP_FAILED = 1
#: ``serve``'s exit status after a stop that gave up writes acknowledged to clients (the
#: flush cut short by a second signal, SIGQUIT or its deadline, or a stop this module
#: ended): distinct from 0 (a stop that lost nothing), 1 (cannot start, a front end
#: failed, or the stop failed), 2 (a configuration mistake) and 128 + N (signal N
#: interrupted start-up), so that a supervisor or a script can tell a stop that lost data
#: from a clean one.  It outranks 1: a front end or a stop step that also failed is in the
#: log and the error line, while lost data hidden behind a generic failure would go
#: unnoticed by whoever alerts on 3
EXIT_ACKNOWLEDGED_WRITES_LOST = 3


@dataclass(frozen=True)
class CreatedFile:
    """A file the server created and removes when it stops, as it was when serving began:
    removed only while the name still holds that file (a restart may have taken it over).
    The server holds each one (the segment mapped, the NVMe file open, the socket bound),
    so no other file gets its inode while it lives."""

    path: str
    what: str
    device: int
    inode: int

    @classmethod
    def of(cls, path: str, what: str) -> CreatedFile | None:
        try:
            info = os.lstat(path)
        except OSError:
            return None
        return cls(path, what, info.st_dev, info.st_ino)

    def remove(self) -> bool:
        """Unlink the name if it still holds this file; whether it was removed."""
        try:
            info = os.lstat(self.path)
            if (info.st_dev, info.st_ino) != (self.device, self.inode):
                return False
            os.unlink(self.path)
        except OSError:
            return False
        return True


def files_created(storage: StorageManager, endpoints: Sequence[str]) -> list[CreatedFile]:
    """The files the serving server created that outlive its process unless removed: the
    L1 segment in shared memory (or the NVMe L1 file) and the ipc sockets it listens on."""
    paths: list[tuple[str, str]] = []
    l1 = storage.l1
    if l1.is_memory:
        if l1.arena.owner:
            paths.append((l1.arena.path, "the L1 segment"))
    elif l1.nvme_file_path is not None:
        paths.append((l1.nvme_file_path, "the NVMe L1 file"))
    for endpoint in endpoints:
        if endpoint.startswith("ipc://"):
            paths.append((endpoint.removeprefix("ipc://"), "the ipc socket"))
    created = (CreatedFile.of(path, what) for path, what in paths)
    return [
        file
        for file in created
        if file is not None and (file.what != "the ipc socket" or _is_socket(file.path))
    ]


def _is_socket(path: str) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    return False


def graceful_stop_window_s(drain_timeout_s: float, join_grace_s: float) -> float:
    """How long after its signal a graceful stop has surely passed every deadline of its
    own: the drain and the front ends' join, then the L2 flush (each ``drain_timeout_s``),
    then :data:`GRACEFUL_CLOSE_WINDOW_S` for the close."""
    return 2 * drain_timeout_s + join_grace_s + GRACEFUL_CLOSE_WINDOW_S


class StuckStopGuard:
    """Ends the process when a forced stop does not finish (see the module's text).

    Started on the main thread once the server serves (``start``), with the stop signals
    (``stop_signals``, those among them that force at once: ``forcing``); ``finish`` once
    the stop is over (the close returned or raised) puts the previous wake-up descriptor
    back and ends the guard's thread.  ``pending_l2_stores`` counts what L2 has not got
    (it may need a lock a stuck thread holds: waited for briefly); ``has_l2`` tells whether
    any write could be waiting for L2 at all.  ``graceful_window_s`` (None: no bound) is
    how long a graceful stop may run after its signal before it is ended too."""

    def __init__(
        self,
        stop_signals: Collection[int],
        forcing: Collection[int],
        files: Sequence[CreatedFile],
        *,
        has_l2: bool,
        pending_l2_stores: Callable[[], int],
        window_s: float = FORCED_STOP_WINDOW_S,
        graceful_window_s: float | None = None,
    ) -> None:
        self._stop_signals = frozenset(stop_signals)
        self._forcing = frozenset(forcing)
        self._files = list(files)
        self._has_l2 = has_l2
        self._pending_l2_stores = pending_l2_stores
        self._window_s = window_s
        self._graceful_window_s = graceful_window_s
        # held while the guard ends the process and while ``finish`` marks the stop done:
        # a stop that finished just as the window ran out is not ended over its summary
        self._ending = threading.Lock()
        self._finished = False
        self._read_fd = self._write_fd = -1
        self._previous_fd = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Take the wake-up descriptor and start the thread; on the main thread only.  One
        that fails leaves nothing behind (the descriptor it had is put back)."""
        read_fd, write_fd = os.pipe()
        try:
            os.set_blocking(write_fd, False)  # the C handler must never block on it
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
            try:
                thread = threading.Thread(target=self._watch, name="stuck-stop-guard", daemon=True)
                self._read_fd, self._write_fd, self._previous_fd = read_fd, write_fd, previous
                thread.start()
            except BaseException:
                signal.set_wakeup_fd(previous)
                raise
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            self._read_fd = self._write_fd = self._previous_fd = -1
            raise
        self._thread = thread

    def finish(self) -> None:
        """The stop is over: the guard ends nothing from now on."""
        with self._ending:
            self._finished = True
        if self._thread is None:
            return
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._write_fd)  # the thread reads the end of the pipe and returns
        self._thread.join()
        os.close(self._read_fd)
        self._thread = None
        self._read_fd = self._write_fd = self._previous_fd = -1

    def _watch(self) -> None:
        poller = select.poll()
        poller.register(self._read_fd, select.POLLIN)
        stops = 0
        forced_by: str | None = None
        # when the stop running is ended unless it finished, and what the line says then
        deadline: float | None = None
        overdue = ""
        while True:
            timeout_ms = None
            if deadline is not None:
                timeout_ms = max(0, math.ceil((deadline - time.monotonic()) * 1000))
            if not poller.poll(timeout_ms):
                self._end(overdue)
                return
            numbers = os.read(self._read_fd, 64)
            if not numbers:
                return  # finish closed the pipe
            self._pass_on(numbers)
            for number in numbers:
                if number not in self._stop_signals:
                    continue
                stops += 1
                name = signal.Signals(number).name
                if forced_by is not None:
                    self._end(f"{name} came while the stop forced by {forced_by} was still running")
                    return
                if stops > 1 or number in self._forcing:
                    forced_by = "a second signal" if stops > 1 else name
                    forced_deadline = time.monotonic() + self._window_s
                    if deadline is None or forced_deadline < deadline:
                        deadline = forced_deadline
                        overdue = f"the stop forced by {forced_by} did not finish within {self._window_s:g}s"
                elif self._graceful_window_s is not None:
                    deadline = time.monotonic() + self._graceful_window_s
                    overdue = (
                        f"the stop begun by {name} did not finish within {self._graceful_window_s:g}s, "
                        "its drain, flush and close deadlines all past"
                    )

    def _pass_on(self, numbers: bytes) -> None:
        """Whoever set a wake-up descriptor before (a process embedding the server) still
        gets its bytes."""
        if self._previous_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self._previous_fd, numbers)

    def _end(self, why: str) -> None:
        """End the process now, without the close that is stuck (see the module's text)."""
        with self._ending:
            if self._finished:
                return
            removed = [file.what for file in self._files if file.remove()]
            code, l2 = self._outcome()
            _bounded(
                lambda: logger.error(
                    "stopping at once: %s (a thread is stuck holding what the stop needs): "
                    "exiting without closing the storage; %s; removed %s",
                    why,
                    l2,
                    ", ".join(removed) if removed else "no file",
                )
            )
            _bounded(lambda: _write_error(f"the stop failed: {why}; {l2}"))
            os._exit(code)

    def _outcome(self) -> tuple[int, str]:
        """The exit status and what became of the writes acknowledged for L2."""
        if not self._has_l2:
            return EXIT_STOP_FAILED, "no L2, no acknowledged write waits for one"
        counted: list[int] = []
        _bounded(lambda: counted.append(self._pending_l2_stores()))
        if not counted:
            return (
                EXIT_ACKNOWLEDGED_WRITES_LOST,
                "the pending L2 stores could not be counted (a stuck thread holds what that needs); "
                "acknowledged writes not yet in L2 are lost",
            )
        if counted[0]:
            return (
                EXIT_ACKNOWLEDGED_WRITES_LOST,
                f"{counted[0]} L2 stores not waited for; the writes they hold, acknowledged "
                "to clients, are lost",
            )
        return EXIT_STOP_FAILED, "no L2 store was pending"


def _bounded(step: Callable[[], object]) -> None:
    """Run ``step`` on a thread of its own and wait for it at most :data:`_STEP_WAIT_S`:
    it may need a lock (a log handler's, a queue's) the stuck thread holds."""

    def run() -> None:
        with contextlib.suppress(Exception):  # the process ends next whatever the step did
            step()

    runner = threading.Thread(target=run, name="stuck-stop-step", daemon=True)
    runner.start()
    runner.join(_STEP_WAIT_S)


def _write_error(message: str) -> None:
    sys.stderr.write(f"error: {' '.join(message.split())}\n")
    sys.stderr.flush()
