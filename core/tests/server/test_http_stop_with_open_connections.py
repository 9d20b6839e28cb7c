"""Stopping the HTTP endpoint ends the connections it is serving: one left open by a
client (idle, or partway through its request) must not hold the stop until that
connection's deadline -- a forced stop gets a few seconds before it is taken for a stuck
thread and the process is ended as a failed stop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from lmcache_tiers.server import http as http_endpoint
from lmcache_tiers.server.http import CONNECTION_THREAD, HttpEndpoint
from lmcache_tiers.testing.http_endpoints import counting_endpoint, port_of

#: a deadline no stop may wait for: the stop must not depend on it
NEVER_S = 3600.0
#: how long the test waits for the stop before calling it stuck (the deadline is NEVER_S)
STOP_WAIT_S = 30.0


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[HttpEndpoint, list[str]]]:
    monkeypatch.setattr(http_endpoint, "REQUEST_TIMEOUT_S", NEVER_S)
    with counting_endpoint() as endpoint:
        yield endpoint


def _connect(served: HttpEndpoint, sent: bytes) -> socket.socket:
    """A connection the endpoint has taken (its thread runs), having sent ``sent``."""
    client = socket.create_connection(("127.0.0.1", port_of(served)), timeout=STOP_WAIT_S)
    client.sendall(sent)
    deadline = time.monotonic() + STOP_WAIT_S
    while not any(thread.name == CONNECTION_THREAD for thread in threading.enumerate()):
        assert time.monotonic() < deadline, "the endpoint never took the connection"
        time.sleep(0.01)
    return client


def _stop(served: HttpEndpoint) -> None:
    stopper = threading.Thread(target=served.stop, daemon=True)
    stopper.start()
    stopper.join(STOP_WAIT_S)
    assert not stopper.is_alive(), "the stop waits for a connection the client keeps open"


@pytest.mark.parametrize(
    "sent",
    [b"", b"GET /metrics HTTP/1.1\r\nHost: tiers\r\n"],
    ids=["idle", "partway-through-its-headers"],
)
def test_a_stop_ends_a_connection_left_open(endpoint: tuple[HttpEndpoint, list[str]], sent: bytes) -> None:
    served, counted = endpoint
    with _connect(served, sent) as client:
        _stop(served)
        assert client.recv(1 << 16) == b""  # closed by the stop, nothing answered
    # the stop's own doing, not a client cut at its deadline
    assert http_endpoint.TIMED_OUT not in counted
