"""In-process servers for tests: a real StorageManager and real front ends, on a thread.

``ServerHarness.make(...)`` builds and starts a :class:`~lmcache_tiers.server.app.TiersServer`
(L1 of 64 MiB in its own segment, ephemeral ports, no HTTP unless asked);
``close()`` stops every server it made and checks that the segment is gone.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmcache_tiers.client import Client, RequestTimeoutError
from lmcache_tiers.config import build_config
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.server.app import TiersServer

__all__ = ["ServerHarness", "make_server", "server", "until_reachable"]


class ServerHarness:
    """Servers started by one test; :meth:`close` stops them all."""

    def __init__(self) -> None:
        self._started: list[tuple[TiersServer, threading.Thread]] = []

    def make(
        self,
        adapters: list[str] | None = None,
        server_options: dict[str, Any] | None = None,
        frontends: list[dict[str, Any]] | None = None,
        **config: Any,
    ) -> TiersServer:
        """A serving TiersServer; ``config`` holds ServerConfig fields, ``adapters`` the
        ``--l2-adapter`` JSON texts, ``frontends`` the ``--frontend`` objects."""
        registry = load_registry()
        settings = {
            "l1_size_gb": 0.0625,
            "port": 0,
            "metrics_port": 0,
            "l1_shm_name": f"tiers_unit_{uuid.uuid4().hex[:12]}",
            **config,
        }
        resolved = build_config(
            registry,
            overrides=settings,
            adapter_json=adapters or [],
            frontend_json=[json.dumps(spec) for spec in frontends or []],
        )
        server = TiersServer(resolved, registry=registry, **(server_options or {}))
        thread = threading.Thread(target=server.serve, name="test-server", daemon=True)
        thread.start()
        self._started.append((server, thread))
        return server

    def close(self) -> None:
        started, self._started = self._started, []
        for server, thread in started:
            server.request_stop()
            thread.join(30)
            assert not thread.is_alive(), "the server loop did not stop"
            arena_path = server.storage.l1.arena.path
            server.close()
            assert not os.path.exists(arena_path)


@pytest.fixture
def make_server() -> Iterator[Callable[..., TiersServer]]:
    """Build and start servers (:meth:`ServerHarness.make`); each is stopped, closed and
    checked for leftovers after the test.  Import it into a conftest to use it."""
    harness = ServerHarness()
    yield harness.make
    harness.close()


@pytest.fixture
def server(make_server: Callable[..., TiersServer]) -> TiersServer:
    """One server with the defaults of :meth:`ServerHarness.make`."""
    return make_server()


def until_reachable(client: Client, within_s: float = 30) -> None:
    """Ping until ``client`` reaches a server again (one restarted on its port): a request
    sent while the socket reconnects may be lost, so each try waits only briefly."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            client.ping(timeout=0.5)
            return
        except RequestTimeoutError:
            assert time.monotonic() < deadline, "the client never reconnected"
