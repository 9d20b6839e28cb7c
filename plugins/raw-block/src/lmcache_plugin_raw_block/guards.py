"""What keeps a slot device safe from its neighbours: one server per device, and no
descriptor closed or mapping unmapped under a call still using it."""

from __future__ import annotations

import fcntl
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from lmcache_tiers.plugin import ConfigError

log = logging.getLogger(__name__)


def lock_device(fd: int, path: str, type_name: str) -> None:
    """``flock(LOCK_EX)`` on the device itself, held as long as ``fd`` stays open.

    The kernel drops it when the process dies, even by SIGKILL, so a restart after a
    crash is never blocked; a second server (or a second adapter of this one) naming the
    same device, under any path that leads to it, is refused.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ConfigError(
            f"{type_name}: {path} is in use by another {type_name} adapter (this server or "
            "another one holds its lock); give each adapter a device of its own"
        ) from None


class InFlight:
    """Counts calls using a resource so that closing it waits for them.

    A backend call still running when the adapter gave up waiting (a device that stopped
    answering) must not find its descriptor closed -- the number could already belong
    to another file -- or its mapping gone.  :meth:`drain` reports whether the calls
    finished; the owner releases the resource only then and leaks it otherwise.
    """

    def __init__(self) -> None:
        self._count = 0
        self._closed = False
        self._changed = threading.Condition()

    @contextmanager
    def use(self) -> Iterator[bool]:
        """Yields False once closed: the caller must then not touch the resource."""
        with self._changed:
            if self._closed:
                usable = False
            else:
                usable = True
                self._count += 1
        try:
            yield usable
        finally:
            if usable:
                with self._changed:
                    self._count -= 1
                    self._changed.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Refuse new calls and wait for running ones; True if none is left."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            self._closed = True
            while self._count:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    log.error("%d device calls still running after %.0f s", self._count, timeout_s)
                    return False
                self._changed.wait(remaining)
        return True
