"""A connection cut at its deadline is one failure, counted once: what it had sent of its
request line when it was cut is not also counted (and logged) as a malformed request."""

from __future__ import annotations

import socket

import pytest

from lmcache_tiers.server import http as http_endpoint
from lmcache_tiers.server.http import TIMED_OUT
from lmcache_tiers.testing.http_endpoints import counting_endpoint, port_of


@pytest.mark.parametrize(
    "sent",
    [b"GET /metrics HTT", b"GE"],
    ids=["bad-version-so-far", "one-word-so-far"],
)
def test_a_request_line_cut_at_the_deadline_is_counted_once(
    monkeypatch: pytest.MonkeyPatch, sent: bytes
) -> None:
    monkeypatch.setattr(http_endpoint, "REQUEST_TIMEOUT_S", 0.3)
    with (
        counting_endpoint() as (served, counted),
        socket.create_connection(("127.0.0.1", port_of(served)), timeout=30) as client,
    ):
        client.sendall(sent)
        assert client.recv(1 << 16) == b""  # cut at the deadline, nothing answered
    # the stop joined the connection's thread: whatever it counts is counted now
    assert counted == [TIMED_OUT]
