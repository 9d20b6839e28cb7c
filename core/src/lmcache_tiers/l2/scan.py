"""The start-up scan: what the backend already holds, accounted from its listing.

A persistent backend reopened after a restart holds objects this process never stored.
The scan reads ``list_keys`` once, in batches, and accounts every listed object (bytes in
total and per ``cache_salt``), so usage is right soon after start rather than only once
each key was looked up.  The first batches are read while the adapter is built, which is
all of a small cache; the rest on a thread of its own, with progress in ``stats()``
(``scan_running``, ``scan_keys``, ``scan_bytes``).  Stores that would add bytes while it
runs are refused: the usage they would be checked against is not known yet.

Every key the scan accounts is announced to listeners (``on_l2_keys_scanned``, batch by
batch): what counts in the usage must be known to the eviction policy, which would
otherwise hear only of the keys its own listing of the store read -- a key stored by
another server between that listing and the scan's would count here and never be evicted.
The batches accounted while the adapter is built precede any listener; an eviction
controller's own listing, taken after them, brings those.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from lmcache_tiers.config import redact_url_secrets
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.accounting import UNKNOWN_L1
from lmcache_tiers.l2.runners import Entry, Runner
from lmcache_tiers.l2.state import AdapterState, impossible_size
from lmcache_tiers.protocols import Capacity, ObjectSize

log = logging.getLogger("lmcache_tiers.l2")

#: listed objects accounted while the adapter is being built
FOREGROUND_ENTRIES = 4096
#: objects taken from the listing at a time
BATCH_ENTRIES = 1024


class KeyScan:
    """Accounts the backend's listing once, partly in the foreground, then on a thread."""

    def __init__(self, state: AdapterState, runner: Runner, capacity: Callable[[], Capacity | None]) -> None:
        self.state = state
        self.runner = runner
        self.capacity = capacity
        self.keys = 0
        self.bytes = 0
        self.invalid = 0  # entries ignored: not (key, size) pairs, or of impossible sizes
        self.impossible = 0  # of which listed with a size no object can have
        self.past_capacity = 0  # accounted objects larger than the whole capacity
        self.errors = 0
        self.relisted = 0  # listings begun again (``_relist``)
        self.running = False
        self._thread: threading.Thread | None = None
        self._batches: Iterator[list[Entry]] | None = None
        self._started = 0.0
        self._lock = threading.Lock()

    def start(self) -> None:
        self.state.accounting.begin_scan()
        self.running = True
        self._started = time.monotonic()
        if self.runner.opened(0.0) is True and self._account(FOREGROUND_ENTRIES):
            return
        self._thread = threading.Thread(
            target=self._background, name=f"l2-{self.state.name}-scan", daemon=True
        )
        self._thread.start()

    def pair(self, entry: Any) -> tuple[ObjectKey, ObjectSize] | None:
        """A listed entry as (key, sizes); None for one that is not a (key, size) pair."""
        try:
            key, size = entry
        except (TypeError, ValueError):
            return None
        if not isinstance(key, ObjectKey):
            return None
        if isinstance(size, ObjectSize):
            return (key, size) if size.stored >= 0 and size.l1 >= 0 else None
        if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
            return key, ObjectSize(size, size if self.state.chain.identity else UNKNOWN_L1)
        return None

    def _account(self, limit: int | None) -> bool:
        """Account batches until ``limit`` entries (None: all); True once finished, and the
        listing then ended (outside the lock: a backend's clean-up may block)."""
        finished = self._account_batches(limit)
        if finished:
            self._stop_listing()
        return finished

    def _account_batches(self, limit: int | None) -> bool:
        taken = 0
        try:
            if self._batches is None:
                self._batches = self.runner.listing(BATCH_ENTRIES)
            while limit is None or taken < limit:
                if self.state.closing.is_set():
                    self._finish("the adapter closed first")
                    return True
                batch = next(self._batches, None)
                if batch is None:
                    self._finish(None)
                    return True
                taken += len(batch)
                sizes = self._possible([size for size in map(self.pair, batch) if size is not None])
                self.invalid += len(batch) - len(sizes)
                with self._lock:
                    if not self.running:  # ended by close() while this batch was listed
                        return True
                    scanned = self.state.accounting.add_scanned(sizes)
                    if scanned is not None:
                        added, added_bytes = scanned
                        self.keys += len(added)
                        self.bytes += added_bytes
                if scanned is None:
                    self._relist()
                    continue
                self._note_past_capacity(added, sizes)
                # Outside the lock (a listener takes its own): every key accounted is
                # announced, so an eviction policy can evict what counts in the usage.
                self.state.notify("on_l2_keys_scanned", added)
        except Exception as exc:  # the rest is accounted lazily, on first lookup
            self.errors += 1
            # A remote store's error may quote a URL, password and all.
            self._finish(f"listing failed: {type(exc).__name__}: {redact_url_secrets(str(exc))}")
            return True
        return False

    def _relist(self) -> None:
        """Read the store's listing again from its start: the accounting forgot keys touched
        while this one ran (``ByteAccounting._touch``), and it may list some of them still
        (counted as ``scan_relisted``, logged once per burst).  Keys accounted from it stay."""
        self.relisted += 1
        self.state.count("scan_relisted")
        self.state.burst.warn(
            "scan_relisted",
            "%s: the start-up scan reads the store's listing again: more keys were stored and "
            "deleted while it ran than it remembers (counted as scan_relisted)",
            self.state.name,
        )
        self._stop_listing()
        # The new listing names again the entries the old one did: those it ignores are
        # counted from it alone, or each would be counted once per listing read.
        self.invalid = self.impossible = 0
        self.state.accounting.relisting()
        self._batches = self.runner.listing(BATCH_ENTRIES)

    def _possible(self, sizes: list[tuple[ObjectKey, ObjectSize]]) -> list[tuple[ObjectKey, ObjectSize]]:
        """``sizes`` without the entries no object can have (past ``MAX_OBJECT_BYTES``):
        ignored as invalid entries, never accounted.

        An object larger than the backend's whole capacity is kept: an earlier run with a
        larger ``max_capacity_gb`` (or a server sharing the store) may have written it,
        and it is on the backend all the same.  Left out, its bytes would fill the store
        uncounted and no eviction would ever hear of it; accounted, the usage says what
        is stored (stores are refused until eviction made room) and the eviction policy
        is told of it like any key.  It is not deleted here: the store may be another
        server's too, and removing what cannot be told from a valid object is eviction's
        call, made and counted there (:meth:`_note_past_capacity`)."""
        possible = [(key, size) for key, size in sizes if not impossible_size(size, None)]
        self.impossible += len(sizes) - len(possible)
        return possible

    def _note_past_capacity(self, added: list[ObjectKey], sizes: list[tuple[ObjectKey, ObjectSize]]) -> None:
        """Count (``scan_objects_past_capacity``) the objects of ``added`` -- accounted from
        this batch of ``sizes`` -- larger than the whole capacity.  Only those accounted:
        an entry the accounting left out (a key it knew, listed twice, or listed again by
        a listing begun anew) is no other object."""
        if not added:
            return
        limit = self.capacity()
        if limit is None or limit.bytes is None:
            return
        listed: dict[ObjectKey, ObjectSize] = {}
        for key, size in sizes:
            listed.setdefault(key, size)  # the first entry of a key is the one accounted
        past_capacity = sum(1 for key in added if impossible_size(listed[key], limit))
        if past_capacity:
            self.past_capacity += past_capacity
            self.state.count("scan_objects_past_capacity", past_capacity)

    def _stop_listing(self) -> None:
        """Close a listing the scan stopped before its end, on the thread that iterates it:
        a backend's generator may hold a directory open (keeping an unmount busy) or a
        connection until it is closed, and the scan outlives the adapter's close."""
        batches, self._batches = self._batches, None
        close = getattr(batches, "close", None)
        if close is not None:
            try:
                close()
            except Exception as exc:  # the backend's own clean-up failing changes nothing here
                log.warning(
                    "%s: ending the start-up listing failed: %s",
                    self.state.name,
                    redact_url_secrets(str(exc)),
                )

    def _background(self) -> None:
        try:
            while not self.state.closing.is_set():
                opened = self.runner.opened(0.1)
                if opened is None:
                    continue
                if opened:
                    self._account(None)
                else:
                    self._finish("the backend did not open")
                return
            self._finish("the adapter closed first")
        finally:  # a close seen before the first batch: the foreground's listing ends here
            self._stop_listing()

    def _finish(self, problem: str | None) -> None:
        with self._lock:
            if not self.running:
                return
            self.running = False
            self.state.accounting.end_scan(complete=problem is None and not self.invalid)
        if self.invalid:
            self.state.count("scan_invalid_entries", self.invalid)
            log.warning(
                "%s: %d listed entries ignored: %d not (key, size) pairs, %d with an impossible size "
                "(past any object's)",
                self.state.name,
                self.invalid,
                self.invalid - self.impossible,
                self.impossible,
            )
        if self.past_capacity:
            log.warning(
                "%s: %d stored objects are larger than the capacity of %d bytes (stored by a run "
                "with a larger max_capacity_gb?); accounted and left to eviction (counted as "
                "scan_objects_past_capacity)",
                self.state.name,
                self.past_capacity,
                _capacity_bytes(self.capacity()),
            )
        elapsed = time.monotonic() - self._started
        if problem is None:
            log.info(
                "%s: start-up scan accounted %d objects, %d bytes in %.1f s",
                self.state.name,
                self.keys,
                self.bytes,
                elapsed,
            )
        else:
            log.warning(
                "%s: start-up scan stopped after %d objects (%s); the rest is accounted on first lookup",
                self.state.name,
                self.keys,
                problem,
            )

    def join(self, deadline: float) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.running:
            self._finish("the adapter closed first")

    def stats(self) -> dict[str, int]:
        return {
            "scan_running": int(self.running),
            "scan_keys": self.keys,
            "scan_bytes": self.bytes,
            "scan_errors": self.errors,
        }


def _capacity_bytes(limit: Capacity | None) -> int:
    """The byte capacity a log line names (0: none)."""
    return limit.bytes if limit is not None and limit.bytes is not None else 0
