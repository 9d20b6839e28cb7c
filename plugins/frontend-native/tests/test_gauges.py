"""The client gauges (clients, locked keys, in-flight stores and prefetches) as scrapes see
them: current at once, and read without touching what the loop thread changes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from lmcache_plugin_frontend_native.rpc import RpcServer
from lmcache_plugin_frontend_native.sessions import Session
from native_keys import keys_of

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import TiersServer

Factory = Callable[..., TiersServer]


@pytest.fixture
def unswept(make_server: Factory, monkeypatch: pytest.MonkeyPatch) -> TiersServer:
    """A server whose periodic sweep does not run during a test: what a scrape sees comes
    from the scrape itself."""
    monkeypatch.setattr(RpcServer, "SWEEP_INTERVAL_S", 60.0)
    return make_server()


@pytest.fixture
def index_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[str]]:
    """Names of the threads that indexed a session's lock records."""
    threads: set[str] = set()
    index = Session._index

    def spy(self: Session) -> None:
        threads.add(threading.current_thread().name)
        index(self)

    monkeypatch.setattr(Session, "_index", spy)
    yield threads


def frontend_gauges(server: TiersServer) -> tuple[int, int]:
    """(clients, locked keys) as ``/metrics`` reads them."""
    ((_, stats),) = server.frontend_stats()
    return stats.sessions, stats.locked_keys


def test_gauges_are_current_when_scraped(unswept: TiersServer) -> None:
    keys = keys_of(3)
    with Client(unswept.endpoint) as client:
        client.store(keys, [b"x" * 100] * 3)
        assert client.lookup(keys) == 3
        assert frontend_gauges(unswept) == (1, 3)
        status = unswept.status()
        assert (status["server"]["clients"], status["server"]["locked_keys"]) == (1, 3)
        assert (status["frontends"][0]["clients"], status["frontends"][0]["locked_keys"]) == (1, 3)
        client.release(keys)
        assert frontend_gauges(unswept) == (1, 0)


def test_a_scrape_changes_no_session(unswept: TiersServer, index_threads: set[str]) -> None:
    keys = keys_of(2)
    with Client(unswept.endpoint) as client:
        client.store(keys, [b"x" * 100] * 2)
        assert client.lookup(keys) == 2  # leaves a lock record the loop has not indexed
        unswept.status()
        unswept.frontend_stats()
        assert threading.current_thread().name not in index_threads
        client.release(keys)
