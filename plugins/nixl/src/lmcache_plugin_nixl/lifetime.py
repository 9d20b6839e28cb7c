"""What a NIXL adapter's stores and loads run on outlives every one of them, not its close.

A NIXL request is built on registrations (the L1 arena, pinned staging memory, storage
files by descriptor number) and runs on after the call that posted it was given up: core
closes an adapter once its close deadline passed, even while a call is stuck inside its
transfer (a hung mount).  Deregistering the memory, closing the descriptors (whose numbers
other files then reuse) or unlocking the directory under such a call would let a request
still running -- or posted next -- read or write memory and files no longer its own.

:class:`CallLifetime` counts the calls using those resources.  Close refuses new calls
and never waits for running ones (a transfer or a truncate can hang on a hung device):
it releases the resources at once when no call runs, else the last call to leave does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from lmcache_tiers.plugin import BackendContext

log = logging.getLogger(__name__)


class CallLifetime:
    """The stores and loads of one adapter using resources released at its close."""

    def __init__(self, context: BackendContext, resources: str, release: Callable[[], None]) -> None:
        """``resources`` names what ``release`` releases, for the log lines."""
        self._context = context
        self._resources = resources
        self._release = release
        # Calls inside (see enter) and whether close() was called: read or changed only
        # under the lock, never held during a call.
        self._state = threading.Lock()
        self._users = 0
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether close() was called (a call still inside may be finishing)."""
        return self._closed

    @property
    def busy(self) -> bool:
        """Whether a call is inside now (one may enter or leave right after)."""
        with self._state:
            return self._users > 0

    def enter(self) -> bool:
        """Register a store or load as a user of the resources, before it posts any NIXL
        request; False (the call must touch none of them) once close() was called.  A call
        that entered must :meth:`leave` once its last transfer completed, failed or raised."""
        with self._state:
            if self._closed:
                return False
            self._users += 1
            return True

    def leave(self) -> None:
        """The last call to leave after close() was called releases the resources."""
        with self._state:
            self._users -= 1
            release_now = self._closed and self._users == 0
        if release_now:
            self._release_on_call_thread()

    def close(self) -> None:
        """Refuse further calls and release the resources -- now if no call uses them, else
        when the last one leaves (one log line).  Never waits for a call."""
        # Only the first close decides who releases them (itself, or the last call
        # leaving): a second one, maybe while that call releases them, must not release
        # them again (a descriptor number closed twice may be another file's by then).
        with self._state:
            first = not self._closed
            self._closed = True
            users = self._users
        if not first:
            return
        if users:
            log.warning(
                "%s: %d stores or loads still use %s: released once the last of them is done",
                self._context.name,
                users,
                self._resources,
            )
        else:
            self._release()

    def _release_on_call_thread(self) -> None:
        """Release on the last call's thread, after close() returned: an error is logged
        (the call's keys are already reported)."""
        try:
            self._release()
        except Exception:
            log.exception("%s: releasing %s failed", self._context.name, self._resources)
        else:
            log.info("%s: %s released, the last call using them left", self._context.name, self._resources)


def count_store_stopped_closing(context: BackendContext, keys: int) -> None:
    """Count and explain the keys of a store cut short by the adapter's close: not stored."""
    if keys:
        context.count("store_stopped_closing", keys)
        log.info("%s: %d keys of a store not stored: the adapter is closing", context.name, keys)


def count_load_stopped_closing(context: BackendContext, keys: int) -> None:
    """Count and explain the keys of a load that returned once the adapter was closing:
    misses, whatever its transfers did."""
    if keys:
        context.count("load_stopped_closing", keys)
        context.warn("load_closing", "%d keys of a load not loaded: the adapter is closing", keys)
