"""An in-process server (real StorageManager, L1 only unless told) on a thread, for the
server's unit tests; end-to-end tests with separate processes live in tests/server."""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmcache_tiers.config import build_config
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.server.app import TiersServer

Factory = Callable[..., TiersServer]


@pytest.fixture
def make_server() -> Iterator[Factory]:
    """Build and start servers; each is stopped, closed and checked for leftovers after."""
    started: list[tuple[TiersServer, threading.Thread]] = []

    def factory(
        adapters: list[str] | None = None, server_options: dict[str, Any] | None = None, **config: Any
    ) -> TiersServer:
        registry = load_registry()
        settings = {
            "l1_size_gb": 0.0625,
            "port": 0,
            "metrics_port": 0,
            "l1_shm_name": f"tiers_unit_{uuid.uuid4().hex[:12]}",
            **config,
        }
        resolved = build_config(registry, overrides=settings, adapter_json=adapters or [])
        server = TiersServer(resolved, registry=registry, **(server_options or {}))
        thread = threading.Thread(target=server.serve, name="test-server", daemon=True)
        thread.start()
        started.append((server, thread))
        return server

    yield factory
    for server, thread in started:
        server.request_stop()
        thread.join(30)
        assert not thread.is_alive(), "the server loop did not stop"
        arena_path = server.storage.l1.arena.path
        server.close()
        assert not os.path.exists(arena_path)


@pytest.fixture
def server(make_server: Factory) -> TiersServer:
    return make_server()
