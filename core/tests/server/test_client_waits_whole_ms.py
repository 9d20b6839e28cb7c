"""A socket waits in whole milliseconds: a client's wait for a reply is rounded up to them,
never down, so that a call whose last wait ends its time does not give up before its
timeout (rounded down, a 5.9 ms wait was one of 5 ms)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from lmcache_tiers.client import Client, RequestTimeoutError
from lmcache_tiers.client.connection import _wait_ms
from lmcache_tiers.testing.fake_peer import FakePeer, PeerReply
from lmcache_tiers.wire import protocol as p


@pytest.mark.parametrize(
    ("seconds", "ms"), [(0.0, 1), (0.0001, 1), (0.001, 1), (0.0011, 2), (0.0059, 6), (0.25, 250), (2.5, 2500)]
)
def test_a_wait_is_rounded_up_to_whole_milliseconds(seconds: float, ms: int) -> None:
    assert _wait_ms(seconds) == ms


def _late_pings(request: Any) -> PeerReply | None:
    if isinstance(request, p.Ping):
        time.sleep(0.05)  # answered (by the peer's own PING reply) after every timeout below
    return None


@pytest.mark.parametrize("timeout", [0.0029, 0.0059, 0.0119])
def test_a_call_never_gives_up_before_its_timeout(timeout: float) -> None:
    with FakePeer(_late_pings, name="late-pings") as peer, Client(peer.url, timeout=1.0) as client:
        for _ in range(3):
            started = time.monotonic()
            with pytest.raises(RequestTimeoutError):
                client.ping(timeout=timeout)
            assert time.monotonic() - started >= timeout
