"""Client work in progress, as background work sees it: is the data plane quiet right now?

Write-back competes with clients for the same cores and memory bandwidth: a store thread
copying into the page cache while a client copies a request into the L1 segment slows
both, and the client is the one waiting.  Front ends and the storage manager report what
they do here, and the store controller holds write-back back while anything is going on
(:mod:`lmcache_tiers.controllers.store_pacing`, which also bounds how long).

Two kinds of reports:

* *spans* -- work with a known end: a request handed to a front end's pool until its reply
  goes, a write reservation until its commit or abort (the client copies into L1 in
  between).  Reported with ``begin``/``end`` (or ``begin_many``/``end_many``) under any
  hashable token unique while the span lasts.  A span whose end never comes (a client that
  died between reserve and commit) stops counting after ``stale_s``, so nothing is held
  back for ever by a lost report;
* *touches* -- a request answered at once, a reply sent: the client is likely to follow up
  within moments (a commit after its reserve, a release after copying out a retrieve), so
  the data plane counts as busy for ``linger_s`` after the last one.

The calls on the request path are a clock read and a dict operation under an uncontended
lock; the one process-wide instance is :data:`DATA_PLANE` (contention is a fact of the
machine, not of one front end).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable, Iterable

__all__ = ["DATA_PLANE", "DataPlaneActivity"]

#: how long after the last request or reply the data plane still counts as busy: covers
#: the gap between a reply and the client's follow-up request (its copy of a retrieve)
LINGER_S = 0.003
#: a span older than this no longer counts (its end was lost, or it is a long wait)
STALE_S = 1.0


class DataPlaneActivity:
    """Spans and touches of client work; thread-safe."""

    def __init__(
        self,
        *,
        linger_s: float = LINGER_S,
        stale_s: float = STALE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.linger_s = linger_s
        self.stale_s = stale_s
        self._clock = clock
        self._lock = threading.Lock()
        # token -> start; insertion order is start order (a re-begun token moves to the end)
        self._spans: dict[Hashable, float] = {}
        self._last = float("-inf")  # monotonic time of the last report
        self._forget_at = float("-inf")  # when a begin next drops stale spans

    # -- reports (request path) -------------------------------------------------------------

    def touch(self) -> None:
        """Client work just happened (a request answered, a reply sent)."""
        self._last = self._clock()  # one store: atomic under the GIL, no lock needed

    def begin(self, token: Hashable) -> None:
        now = self._clock()
        with self._lock:
            self._spans.pop(token, None)
            self._spans[token] = now
            if now >= self._forget_at:
                self._forget_stale(now)
        self._last = now

    def end(self, token: Hashable) -> None:
        with self._lock:
            self._spans.pop(token, None)
        self._last = self._clock()

    def begin_many(self, tokens: Iterable[Hashable]) -> None:
        now = self._clock()
        with self._lock:
            spans = self._spans
            for token in tokens:
                spans.pop(token, None)
                spans[token] = now
            if now >= self._forget_at:
                self._forget_stale(now)
        self._last = now

    def end_many(self, tokens: Iterable[Hashable]) -> None:
        with self._lock:
            spans = self._spans
            for token in tokens:
                spans.pop(token, None)
        self._last = self._clock()

    def _forget_stale(self, now: float) -> None:
        # ``quiet_in`` drops stale spans too, but nothing calls it where no write-back
        # waits (a server without L2): the span of every reservation a client abandoned
        # would stay for good.  Oldest first, each dropped once -- but finding the oldest
        # skips the holes that ended spans left at the front of the dict (after a burst of
        # spans ended, tens of microseconds), so the request path does it once a stale_s.
        self._forget_at = now + self.stale_s
        spans = self._spans
        while spans:
            token, began = next(iter(spans.items()))
            if now - began < self.stale_s:
                return
            del spans[token]

    # -- for background work -------------------------------------------------------------

    def quiet_in(self, now: float | None = None) -> float:
        """Seconds until the data plane counts as quiet (0.0: quiet now), assuming nothing
        new is reported meanwhile."""
        now = self._clock() if now is None else now
        wait = self._last + self.linger_s - now
        with self._lock:
            spans = self._spans
            # Oldest first: drop the stale ones, then the oldest live span decides.
            while spans:
                token, began = next(iter(spans.items()))
                if now - began < self.stale_s:
                    wait = max(wait, began + self.stale_s - now)
                    break
                del spans[token]
        return max(0.0, wait)

    def spans(self) -> int:
        """Spans open now (stale ones included until the next ``quiet_in``, or a ``begin`` up to
        ``stale_s`` later)."""
        with self._lock:
            return len(self._spans)


#: the server process's one instance: front ends and the storage manager report to it
DATA_PLANE = DataPlaneActivity()
