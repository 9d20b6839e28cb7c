"""The HTTP endpoint's own troubles cost counters, not log volume: a scraper on a wrong
path, a route failing on every scrape, clients cut at the deadline -- each is counted every
time and explained in the log once per burst."""

from __future__ import annotations

import http.client
import logging
import re
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.server import http as http_endpoint
from lmcache_tiers.server.http import (
    NOT_FOUND,
    PACED,
    REFUSED_BUSY,
    REFUSED_MALFORMED,
    ROUTE_FAILED,
    TIMED_OUT,
    HttpEndpoint,
)

HAMMERED = 60
#: one burst window (60 s) holds each run; a slow machine may cross into a second
MOST_LINES = 2


class Counted:
    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()  # the endpoint counts from its connection threads

    def __call__(self, reason: str) -> None:
        with self._lock:
            self.counts[reason] += 1


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    # a fresh burst: an earlier test's refusal within the window would hold back the first line
    monkeypatch.setattr(http_endpoint, "_bad_requests", BurstLog(http_endpoint.logger, REFUSED_MALFORMED))
    monkeypatch.setattr(http_endpoint, "_refusals", BurstLog(http_endpoint.logger, REFUSED_BUSY))
    # these tests count their own reasons: no connection is held back to the pace
    monkeypatch.setattr(http_endpoint, "CONNECTION_BURST", 1 << 20)
    caplog.set_level(logging.DEBUG, logger="lmcache_tiers.server.http")
    return caplog


def serving(counted: Counted, status: Callable[[], dict[str, Any]] = dict) -> Iterator[int]:
    served = HttpEndpoint(
        "127.0.0.1", 0, metrics=bytes, status=status, health=lambda: (True, "ok"), failed=counted
    )
    served.start()
    try:
        yield int(served.url.rsplit(":", 1)[1])
    finally:
        served.stop()


def answer(port: int, method: str, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def lines(caplog: pytest.LogCaptureFixture, pattern: str) -> list[logging.LogRecord]:
    return [record for record in caplog.records if re.search(pattern, record.getMessage())]


def test_requests_for_no_route_are_counted_and_logged_once_per_burst(
    logged: pytest.LogCaptureFixture,
) -> None:
    counted = Counted()
    for port in serving(counted):
        codes = {answer(port, "GET", f"/metric/{index}") for index in range(HAMMERED)}
        codes.add(answer(port, "POST", "/elsewhere"))
        codes.add(answer(port, "HEAD", "/elsewhere"))
        assert answer(port, "GET", "/metrics") == 200
    assert codes == {404}
    assert counted.counts == {NOT_FOUND: HAMMERED + 2}
    found = lines(logged, "no such route")
    assert 1 <= len(found) <= MOST_LINES, [record.getMessage() for record in found]
    assert "'/metric/0'" in found[0].getMessage()


def test_a_route_that_fails_every_time_logs_one_traceback_then_once_per_burst(
    logged: pytest.LogCaptureFixture,
) -> None:
    def broken_status() -> dict[str, Any]:
        raise RuntimeError("status is broken")

    counted = Counted()
    for port in serving(counted, broken_status):
        codes = {answer(port, "GET", f"/status?try={index}") for index in range(HAMMERED)}
    assert codes == {500}
    assert counted.counts == {ROUTE_FAILED: HAMMERED}
    failed = lines(logged, r"HTTP /status\S* failed")
    assert [record.exc_info is not None for record in failed][:1] == [True], "the first has its traceback"
    assert 1 <= len(failed) <= MOST_LINES, [record.getMessage() for record in failed]


def test_connections_cut_at_the_deadline_are_logged_once_per_burst(
    logged: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(http_endpoint, "REQUEST_TIMEOUT_S", 0.2)
    counted = Counted()
    cut = 5
    for port in serving(counted):
        for _ in range(cut):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as idle:
                assert idle.recv(1) == b""  # shut down by the server at its deadline
    assert counted.counts == {TIMED_OUT: cut}
    found = lines(logged, "cut: not done within")
    assert 1 <= len(found) <= MOST_LINES, [record.getMessage() for record in found]


def test_a_client_that_does_not_read_its_answer_is_cut_and_counted(
    logged: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The endpoint's write of an answer larger than the socket buffers blocks while the
    client reads nothing: the deadline cuts it like any other slow connection, counted,
    never a traceback."""
    monkeypatch.setattr(http_endpoint, "REQUEST_TIMEOUT_S", 0.3)
    counted = Counted()
    big = b"x" * (64 << 20)
    served = HttpEndpoint(
        "127.0.0.1", 0, metrics=lambda: big, status=dict, health=lambda: (True, "ok"), failed=counted
    )
    served.start()
    stalled = 5
    try:
        port = int(served.url.rsplit(":", 1)[1])
        for done in range(1, stalled + 1):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
                client.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
                deadline = time.monotonic() + 10
                while sum(counted.counts.values()) < done and time.monotonic() < deadline:
                    time.sleep(0.05)  # reading nothing
                # a reset: not to drain what the kernel still holds of the answer
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        assert answer(port, "GET", "/healthz") == 200
    finally:
        served.stop()
    assert counted.counts == {TIMED_OUT: stalled}
    assert not [record for record in logged.records if record.exc_info], "a cut is no traceback"


def test_connections_faster_than_the_pace_wait_their_turn_counted(
    logged: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each connection costs a thread and parsing on the interpreter the RPC front ends
    share: a client opening them as fast as it can is held to the endpoint's pace -- every
    request still answered, the waits counted and logged once per burst."""
    monkeypatch.setattr(http_endpoint, "MAX_CONNECTIONS_PER_S", 50.0)
    monkeypatch.setattr(http_endpoint, "CONNECTION_BURST", 5)
    counted = Counted()
    for port in serving(counted):
        codes = [answer(port, "GET", "/healthz") for _ in range(HAMMERED)]
    assert codes == [200] * HAMMERED
    assert set(counted.counts) == {PACED}
    # the burst, and what the pace refilled while the first were served, went through
    assert 0 < counted.counts[PACED] < HAMMERED
    found = lines(logged, "HTTP connections arrive faster than 50 a second")
    assert 1 <= len(found) <= MOST_LINES, [record.getMessage() for record in found]
