"""The shutdown flush: wait for pending L2 stores, say so, and give up when told.

A slow L2 makes the flush the longest part of a stop.  Instead of silent seconds the
operator sees one log line ("flushing N L2 stores (up to Xs; Ctrl-C again to abandon)")
and, on a terminal, a progress bar of the stores left.  The wait runs in short slices so
a second signal or SIGQUIT (``abandon`` naming it) ends it at once; what is still pending is then
abandoned by the storage's close and counted (``l2_store_abandoned``,
``l2_store_dropped_at_shutdown``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from lmcache_tiers.storage import StorageManager

__all__ = ["ABANDONED_FAILURES", "flush_l2", "flush_message", "pending_l2_stores"]

logger = logging.getLogger("lmcache_tiers.server.app")

#: the failure counters a stop that did not store everything in L2 bumps (keys/objects)
ABANDONED_FAILURES = ("l2_store_abandoned", "l2_store_dropped_at_shutdown")
#: how often the flush looks at the abandon flag and updates its progress
_SLICE_S = 0.1


def pending_l2_stores(storage: StorageManager) -> int:
    """Store tasks in flight plus batches not yet handed to an adapter."""
    store = storage.store
    return store.in_flight() + store.pending_batches()


def flush_message(pending: int, timeout_s: float) -> str:
    return f"flushing {pending} L2 stores (up to {timeout_s:g}s; Ctrl-C again to abandon)"


def flush_l2(
    storage: StorageManager,
    timeout_s: float,
    abandon: Callable[[], str | None],
    console: Console | None = None,
) -> bool:
    """Wait up to ``timeout_s`` for every pending L2 store; False when the time ran out or
    ``abandon()`` named what abandons the flush (``"a second signal"``) first."""
    pending = pending_l2_stores(storage)
    if pending:
        logger.info("%s", flush_message(pending, timeout_s))
    # With no store pending only evictions catching up are waited for: nothing to show.
    deadline = time.monotonic() + timeout_s
    live = pending > 0 and console is not None and console.is_terminal
    progress = Progress(
        TextColumn("flushing L2 stores (Ctrl-C again to abandon)"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
        disable=not live,
    )
    try:
        with progress:
            task = progress.add_task("flush", total=max(pending, 1))
            return _wait(
                storage,
                timeout_s,
                deadline,
                abandon,
                lambda left: progress.update(task, completed=max(0, pending - left)),
            )
    except OSError as exc:
        # The terminal went away (a hangup, a closed pty): the progress is for people, and
        # the flush of acknowledged writes goes on without it.
        logger.warning("flush progress cannot be shown (%s); flushing on without it", exc)
        return _wait(storage, timeout_s, deadline, abandon, lambda left: None)


def _wait(
    storage: StorageManager,
    timeout_s: float,
    deadline: float,
    abandon: Callable[[], str | None],
    show: Callable[[int], object],
) -> bool:
    """The flush's wait, in slices; ``show(left)`` after each with the stores left."""
    while True:
        if storage.flush(timeout=min(_SLICE_S, max(0.0, deadline - time.monotonic()))):
            show(0)
            return True
        left = pending_l2_stores(storage)
        show(left)
        abandoned_by = abandon()
        if abandoned_by:
            logger.warning("flush abandoned on %s: %d L2 stores not waited for", abandoned_by, left)
            return False
        if time.monotonic() >= deadline:
            logger.warning("flush timed out after %gs: %d L2 stores not waited for", timeout_s, left)
            return False
