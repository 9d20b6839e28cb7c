"""A reservation its client commits or aborts past the write TTL, before the sweep saw it
expire, is counted as expired as the sweep counts it.

The sweep forgets each reservation left uncommitted past the write TTL and counts it
(``store_reservation_expired``).  A commit or abort arriving after the TTL but before the
sweep found it expired itself and counted nothing: an abort left its key in no counter
(neither stored, skipped nor refused, nor expired), a commit counted it lost only.  The
front end's clock is moved past the TTL for that one request, the sweep's is not.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from lmcache_plugin_frontend_native import handlers
from native_keys import keys_accounted, keys_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p


class _Later:
    """The ``time`` module of the handlers, ``ahead_s`` in the future."""

    def __init__(self, ahead_s: float) -> None:
        self.ahead_s = ahead_s

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead_s


def past_the_write_ttl(server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The requests handled from now on arrive past the write TTL of what is reserved;
    the sweep, on the loop's own clock, has not seen it pass."""
    monkeypatch.setattr(handlers, "time", _Later(server.storage.l1.write_ttl_s + 1))


@pytest.mark.parametrize(
    ("ending", "done"),
    [(p.StoreAbort, [False]), (p.StoreCommit, [False])],
    ids=["abort", "commit"],
)
def test_a_reservation_ended_past_the_ttl_before_the_sweep_is_counted_expired(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch, ending: Callable[..., object], done: list[bool]
) -> None:
    (key,) = keys_of(1)
    stats = stats_of(server)
    with Client(server.endpoint) as writer:
        writer._call(p.StoreReserve(0, "", [key], [4096]), p.StoreReserveReply)
        past_the_write_ttl(server, monkeypatch)
        assert writer._call(ending(0, "", [key]), p.StoreReply).done == done
        monkeypatch.undo()
        assert stats.failures["store_reservation_expired"] == 1
        assert stats.store_keys_skipped["aborted"] == 0
        # as the sweep would have: the key is in no counter of stored, skipped or refused
        # keys for an abort, and among the refused (reservation_lost) for a commit
        assert keys_accounted(server) == (1 if ending is p.StoreCommit else 0)
        # and the session holds nothing of it the sweep could count again
        assert server.frontends[0].handlers.sessions.gauges(time.monotonic()).reserved_stores == 0
