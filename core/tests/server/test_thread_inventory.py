"""Every thread a serving server starts carries a name an operator can tell apart in a
thread dump (py-spy, faulthandler), and a backend that hangs its calls does not make
them pile up: a bounded number while it hangs, and none left once the server closed."""

from __future__ import annotations

import json
import logging
import re
import socket
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lmcache_tiers.client import Client, RequestTimeoutError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.server.http import HttpEndpoint
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.testing.server import ServerHarness

#: the prefixes of the names of the threads this test's server starts (core, its mock
#: adapter, the fault_inject plugin); other plugins add their own (nixl-, raw-block-, ...)
PROJECT_PREFIXES = ("l1-", "l2-", "tiers-", "shm-", "stop-signal-notices")
#: names of this test's own threads
DRIVER_PREFIX = "test-"
#: what 200 lookups and stores may hold at once: the fixed pools (adapter workers, the
#: router's, the controllers), the HTTP connections a scraper holds and each adapter's
#: bounded helpers -- far below one per call
THREAD_BOUND = 64
DRIVERS = 8
ROUNDS = 25  # 8 drivers x 25 rounds: 200 stores and 200 lookups

HANGING = {
    "type": "fault_inject",
    "inner": {"type": "mock", "max_size_gb": 0.1},
    "delay_s": 2.0,
    "delay_ops": ["store", "lookup", "load"],
    "lookup_timeout_s": 0.5,
}


class _Census:
    """The threads started since it was made, sampled until :meth:`stop`."""

    def __init__(self) -> None:
        self._before = set(threading.enumerate())
        self.names: set[str] = set()
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, name=f"{DRIVER_PREFIX}census", daemon=True)
        self._thread.start()

    def started(self) -> list[threading.Thread]:
        return [
            thread
            for thread in threading.enumerate()
            if thread not in self._before and not thread.name.startswith(DRIVER_PREFIX)
        ]

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            started = self.started()
            self.peak = max(self.peak, len(started))
            self.names.update(thread.name for thread in started)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


@pytest.fixture
def harness() -> Iterator[ServerHarness]:
    harness = ServerHarness()
    yield harness
    harness.close()


def _keys(tag: str, count: int) -> list[ObjectKey]:
    return [ObjectKey("threads", 0, f"{tag}/{index}".encode()) for index in range(count)]


def _drive(server: TiersServer, driver: int) -> None:
    """Stores, and lookups of keys only L2 could hold (so both adapters are asked)."""
    with Client(server.endpoint, timeout=30) as client:
        for round_ in range(ROUNDS):
            tag = f"{driver}-{round_}"
            client.store(_keys(f"stored-{tag}", 2), [b"x" * 4096] * 2)
            try:
                # A short wait: the 200 lookups reach the hanging adapter within about
                # one of its 2 s delays, so calls that each held a thread would pile up
                # far past the bound.
                client.lookup(_keys(f"absent-{tag}", 2), timeout=0.05)
            except RequestTimeoutError:
                pass  # the hanging adapter's lookup outlived the wait: what the test makes


def _scrape(url: str, done: threading.Event) -> None:
    while not done.is_set():
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
            response.read()


def _run(targets: list[Callable[[], None]]) -> list[threading.Thread]:
    threads = [
        threading.Thread(target=target, name=f"{DRIVER_PREFIX}driver-{index}", daemon=True)
        for index, target in enumerate(targets)
    ]
    for thread in threads:
        thread.start()
    return threads


def test_a_hanging_adapter_leaves_a_bounded_set_of_named_threads(harness: ServerHarness) -> None:
    census = _Census()
    metrics_port = free_port()
    server = harness.make(
        adapters=[json.dumps({"type": "mock", "max_size_gb": 0.1}), json.dumps(HANGING)],
        metrics_port=metrics_port,
        # The stop abandons (and counts) the stores still queued behind the hanging
        # adapter after this drain instead of the default 10 s: the threads of the calls
        # still inside it must end all the same.
        shutdown_timeout_s=1.0,
    )
    scraped = threading.Event()
    drivers = _run([lambda driver=driver: _drive(server, driver) for driver in range(DRIVERS)])
    scrapers = _run([lambda: _scrape(f"http://127.0.0.1:{metrics_port}", scraped)] * 2)
    for thread in drivers:
        thread.join(300)
        assert not thread.is_alive(), "a driver is stuck"
    scraped.set()
    for thread in scrapers:
        thread.join(60)
    harness.close()
    census.stop()

    # numbers collapsed: one entry per kind of thread, not per connection served
    unnamed = sorted(
        {re.sub(r"\d+", "N", name) for name in census.names if not name.startswith(PROJECT_PREFIXES)}
    )
    assert not unnamed, f"threads without a project name: {unnamed}"
    assert census.peak <= THREAD_BOUND, f"{census.peak} threads at once: {sorted(census.names)}"
    for thread in census.started():
        thread.join(10)  # a daemon ending right after the close returned
    left = [thread.name for thread in census.started()]
    assert not left, f"threads left after the close: {left}"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_ended_by_an_exception_is_counted_and_logged(
    harness: ServerHarness, caplog: pytest.LogCaptureFixture
) -> None:
    """A thread whose target raises ends with a traceback on stderr only, beside the log
    and counted nowhere, and the work it did stops for good: while serving, the server
    counts it (``thread_crashed``) and logs it with the thread's name and traceback."""
    server = harness.make()

    def crash() -> None:
        raise RuntimeError("injected thread crash")

    with caplog.at_level(logging.ERROR, logger="lmcache_tiers"):
        crashing = threading.Thread(target=crash, name=f"{DRIVER_PREFIX}crashing")
        crashing.start()
        crashing.join()
    assert server.storage_status()["failures"].get("thread_crashed") == 1
    crashed = [record for record in caplog.records if "test-crashing" in record.getMessage()]
    assert crashed and crashed[0].exc_info is not None, caplog.text


def test_the_http_endpoint_names_the_threads_of_a_connection() -> None:
    """A connection held open (a slow scraper) keeps two threads of the endpoint: the one
    serving it and the timer that cuts it at its deadline; both under the ``tiers-http``
    prefix, and neither left once the endpoint stopped."""
    before = set(threading.enumerate())
    endpoint = HttpEndpoint("127.0.0.1", 0, metrics=bytes, status=dict, health=lambda: (True, "ok"))
    endpoint.start()
    port = endpoint.url.rsplit(":", 1)[1]
    try:
        with socket.create_connection(("127.0.0.1", int(port))) as idle:
            idle.sendall(b"GET /metrics HTTP/1.1\r\n")  # the rest of the request never comes
            serving: list[str] = []
            for _ in range(1000):  # the endpoint's own, the connection's and its timer
                serving = sorted(thread.name for thread in threading.enumerate() if thread not in before)
                if len(serving) == 3:
                    break
                time.sleep(0.01)
            assert serving == ["tiers-http", "tiers-http-connection", "tiers-http-deadline"]
    finally:
        endpoint.stop()
    for thread in set(threading.enumerate()) - before:
        thread.join(10)  # a cancelled timer ends right after the connection did
    assert [thread.name for thread in threading.enumerate() if thread not in before] == []


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([str(Path(__file__)), "-q"]))
