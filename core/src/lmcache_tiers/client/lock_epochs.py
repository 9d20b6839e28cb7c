"""Which keys this client read-locked last over a connection that has dropped since.

The server keeps a client's locks per connection (its session), so the locks taken over a
connection that has dropped since -- perhaps to a server that restarted at the address
since -- are out of reach of any request over the next one.  A RELEASE by key over the
next connection would release none of them: it would only go to whatever server listens
at the address now, by the key limit of the one greeted before (refused as ``TOO_LARGE``
by a restarted one with a lower limit), or wait out its timeout while none is back yet.
``Client.release`` leaves those keys out.  A connection is told by the drops the client
had seen when a request went out over it (``Connection._link_epoch``).

Every lookup, retrieve and release goes through here, under the client's lock, and drops
are rare: while none has happened, no key is left out, so a call only files its key list
(no work per key).  The calls filed are read once, at the first call after a drop, into
the keys whose newest lock went with the dropped connection; only while some of those are
left does a call look at its keys one by one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from lmcache_tiers.keys import ObjectKey

#: keys of the calls remembered at most (locks noted and releases), the oldest calls
#: forgotten first; keys whose newest lock went with a dropped connection are forgotten
#: once as many keys as that were noted or released after the drop was taken in.  A key
#: forgotten is released by key, as one this client never locked.
REMEMBERED_KEYS = 1 << 16


class LockEpochs:
    """Which keys' newest read locks this client took over a connection that has dropped
    since (the caller holds the client's lock around every method)."""

    def __init__(self) -> None:
        # The calls since the last drop taken in, oldest first: (keys, released) of a note
        # (False) or a release (True); the lists are the client's own, never changed after.
        self._calls: deque[tuple[Sequence[ObjectKey], bool]] = deque()
        self._filed = 0  # keys of those calls
        self._drops = 0  # the drops seen when those calls were made
        # keys whose newest lock went with a dropped connection, and how many keys more may
        # be noted or released before they are forgotten (see REMEMBERED_KEYS)
        self._gone: set[ObjectKey] = set()
        self._gone_budget = 0

    def __bool__(self) -> bool:
        """Whether a release may have keys to leave out, now or after a drop."""
        return bool(self._calls) or bool(self._gone)

    def note(self, keys: Sequence[ObjectKey], epoch: int, drops: int) -> None:
        """``keys`` were read-locked by a request sent at ``epoch``; ``drops``: the drops
        seen so far, which no epoch noted can be above."""
        if drops != self._drops:
            self._take_in_drops(drops)
        if epoch >= drops:  # the newest connection: no lock noted is newer
            if self._gone:
                self._gone.difference_update(keys)
                self._spend(len(keys))
            self._file(keys, False)
        else:  # a reply read late, after other requests' over a newer connection
            held = self._held_over_this_connection()
            self._add_gone([key for key in keys if key not in held])

    def release(self, keys: list[ObjectKey], drops: int) -> tuple[list[ObjectKey], int]:
        """A release of ``keys`` is about to go over the connection that came after
        ``drops`` drops: ``keys`` less those whose newest lock was taken over an earlier
        one, and how many distinct keys were left out.  Each of ``keys`` is forgotten: a
        release by key drops every lock this client holds on it over this connection, and
        nothing over an earlier one is ever released."""
        if drops != self._drops:
            self._take_in_drops(drops)
        self._file(keys, True)
        gone = self._gone
        if not gone:
            return keys, 0
        older = gone.intersection(keys)
        self._spend(len(keys))
        if not older:
            return keys, 0
        gone.difference_update(older)
        return [key for key in keys if key not in older], len(older)

    def _file(self, keys: Sequence[ObjectKey], released: bool) -> None:
        calls = self._calls
        calls.append((keys, released))
        self._filed += len(keys)
        # (The newest call stays, however long.)
        while self._filed > REMEMBERED_KEYS and len(calls) > 1:
            self._filed -= len(calls.popleft()[0])

    def _held_over_this_connection(self) -> set[ObjectKey]:
        """The keys noted since the last drop taken in and not released since."""
        held: set[ObjectKey] = set()
        for keys, released in self._calls:
            if released:
                held.difference_update(keys)
            else:
                held.update(keys)
        return held

    def _take_in_drops(self, drops: int) -> None:
        """The connection the calls filed went over has dropped: the keys they left locked
        are out of reach of any release from now on."""
        held = self._held_over_this_connection()
        self._calls.clear()
        self._filed = 0
        self._drops = drops
        if len(self._gone) + len(held) > REMEMBERED_KEYS:
            self._gone.clear()  # the oldest forgotten first
        self._add_gone(held)

    def _add_gone(self, keys: Sequence[ObjectKey] | set[ObjectKey]) -> None:
        if keys:
            self._gone.update(keys)
            self._gone_budget = REMEMBERED_KEYS

    def _spend(self, count: int) -> None:
        """``count`` keys more were noted or released since the drop was taken in."""
        self._gone_budget -= count
        if self._gone_budget <= 0:
            self._gone.clear()
