"""A client hammering a refused request costs counters, not log volume: each kind of
refusal is explained in the log once per burst, and every one of them is counted."""

from __future__ import annotations

import http.client
import logging
import threading
from collections import Counter

import pytest

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.server import http as http_endpoint
from lmcache_tiers.server.http import REFUSED_STATUS, HttpEndpoint

#: enough refusals that logging each would show many lines, where one burst logs one or two
HAMMERED = 100


def test_status_hammered_with_a_wrong_token_logs_once_per_burst_and_counts_each(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh burst: an earlier test's refusal within the window would hold back the first line.
    # (raising=False: without the fix there is no such log, and the test fails on the lines.)
    fresh = BurstLog(http_endpoint.logger, REFUSED_STATUS, level=logging.INFO)
    monkeypatch.setattr(http_endpoint, "_status_refusals", fresh, raising=False)
    counted: Counter[str] = Counter()
    lock = threading.Lock()

    def failed(reason: str) -> None:
        with lock:  # the endpoint serves on its own threads
            counted[reason] += 1

    served = HttpEndpoint(
        "127.0.0.1",
        0,
        metrics=bytes,
        status=dict,
        health=lambda: (True, "ok"),
        status_token="t0k",
        failed=failed,
    )
    served.start()
    caplog.set_level(logging.DEBUG, logger="lmcache_tiers.server.http")
    try:
        port = int(served.url.rsplit(":", 1)[1])
        for _ in range(HAMMERED):
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                connection.request("GET", "/status", headers={"Authorization": "Bearer wrong"})
                assert connection.getresponse().status == 401
            finally:
                connection.close()
    finally:
        served.stop()
    assert counted[REFUSED_STATUS] == HAMMERED
    refusal_lines = [r for r in caplog.records if "/status refused" in r.getMessage()]
    # one burst window (60 s) holds the whole run; a slow machine may cross into a second
    assert 1 <= len(refusal_lines) <= 2, [r.getMessage() for r in refusal_lines]
