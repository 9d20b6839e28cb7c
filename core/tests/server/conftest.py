"""In-process servers (real StorageManager, L1 only unless told) on a thread; end-to-end
tests with separate processes live in tests/server."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import make_server, server
from lmcache_tiers.testing.threads import new_threads

__all__ = ["make_server", "new_threads", "restart_at_the_same_port", "server"]


@pytest.fixture
def restart_at_the_same_port(
    make_server: Callable[..., TiersServer],
) -> Callable[[TiersServer], TiersServer]:
    """Stop a server and start another at its port, where its clients follow it (a new
    L1 segment, new locks): the first server's port may take a moment to come free."""

    def restart(first: TiersServer) -> TiersServer:
        port = int(first.endpoint.rsplit(":", 1)[1])
        first.request_stop()
        deadline = time.monotonic() + 30
        while True:
            try:
                return make_server(port=port)
            except ConfigError:
                assert time.monotonic() < deadline, "the port of the stopped server never came free"
                time.sleep(0.1)  # the first one's port is still being given back

    return restart
