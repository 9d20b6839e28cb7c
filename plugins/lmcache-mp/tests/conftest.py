"""In-process servers with the LMCache front end (and the native one beside it)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # mpclient, for every test module here

from mpclient import MPClient, mp_address
from writer_processes import stop_writers

from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.server import make_server

__all__ = ["make_server"]


#: options of ``make_mp_server`` that are the server's, not the lmcache_mp front end's
_SERVER_OPTIONS = (
    "l1_size_gb",
    "chunk_size",
    "l1_lock_ttl_s",
    "l1_write_ttl_s",
    "shutdown_timeout_s",
    "frontend_pool_max_mb",
)


@pytest.fixture
def make_mp_server(make_server: Callable[..., TiersServer]) -> Callable[..., TiersServer]:
    """A server whose front ends are lmcache_mp (options as given) and native."""

    def factory(*, adapters: list[str] | None = None, **options: object) -> TiersServer:
        config = {key: options.pop(key) for key in list(options) if key in _SERVER_OPTIONS}
        frontends = [{"type": "lmcache_mp", **options}, {"type": "native"}]
        return make_server(adapters=adapters, frontends=frontends, **config)

    return factory


@pytest.fixture
def mp_server(make_mp_server: Callable[..., TiersServer]) -> TiersServer:
    return make_mp_server()


@pytest.fixture
def client(mp_server: TiersServer) -> Iterator[MPClient]:
    with MPClient(mp_address(mp_server)) as connected:
        yield connected


@pytest.fixture
def writers() -> Iterator[list[subprocess.Popen[str]]]:
    """The stalled writer processes a test starts (``writer_processes.start_writer``),
    killed and reaped after it."""
    started: list[subprocess.Popen[str]] = []
    yield started
    stop_writers(started)
