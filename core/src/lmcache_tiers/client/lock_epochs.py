"""Over which connection this client took its newest read lock on each key.

The server keeps a client's locks per connection (its session), so the locks taken over a
connection that has dropped since -- perhaps to a server that restarted at the address
since -- are out of reach of any request over the next one.  A RELEASE by key over the
next connection would release none of them: it would only go to whatever server listens
at the address now, by the key limit of the one greeted before (refused as ``TOO_LARGE``
by a restarted one with a lower limit), or wait out its timeout while none is back yet.
``Client.release`` leaves those keys out.  A connection is told by the drops the client
had seen when a request went out over it (``Connection._link_epoch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice, repeat

from lmcache_tiers.keys import ObjectKey

#: keys remembered at most, the first noted forgotten first: a key forgotten is released
#: by key, as one this client never locked
REMEMBERED_KEYS = 1 << 16


class LockEpochs:
    """The ``_link_epoch`` of the newest request that read-locked each key (the caller
    holds the client's lock around every method)."""

    def __init__(self) -> None:
        self._epochs: dict[ObjectKey, int] = {}

    def __len__(self) -> int:
        return len(self._epochs)

    def note(self, keys: Sequence[ObjectKey], epoch: int, drops: int) -> None:
        """``keys`` were read-locked by a request sent at ``epoch``; ``drops``: the drops
        seen so far, which no epoch noted can be above."""
        epochs = self._epochs
        if epoch >= drops:  # the newest connection: no lock noted is newer
            epochs.update(zip(keys, repeat(epoch)))
        else:  # a reply read late, after other requests' over a newer connection
            for key in keys:
                if epochs.get(key, -1) < epoch:
                    epochs[key] = epoch
        excess = len(epochs) - REMEMBERED_KEYS
        if excess > 0:
            for key in list(islice(epochs, excess)):
                del epochs[key]

    def release(self, keys: list[ObjectKey], drops: int) -> tuple[list[ObjectKey], int]:
        """A release of ``keys`` is about to go over the connection that came after
        ``drops`` drops: ``keys`` less those whose newest lock was taken over an earlier
        one, and how many distinct keys were left out.  Each of ``keys`` is forgotten: a
        release by key drops every lock this client holds on it over this connection, and
        nothing over an earlier one is ever released."""
        epochs = self._epochs
        if not epochs:
            return keys, 0
        older = {key for key in keys if epochs.pop(key, drops) < drops}
        if not older:
            return keys, 0
        return [key for key in keys if key not in older], len(older)
