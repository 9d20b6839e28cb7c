import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Helper modules of these tests (imported by name under pytest's importlib mode).
sys.path.insert(0, str(Path(__file__).parent))
# Mooncake clients of this process use the loopback address (read when a client is set
# up; the 0.3.13 wheel still binds its listening ports to all interfaces).
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

from closing_in_turn import ClosingInTurn
from lmcache_plugin_mooncake.cluster import LocalCluster, unavailable_reason
from mooncake_helpers import raw_client


@pytest.fixture(scope="session")
def mooncake_unavailable() -> str | None:
    reason = unavailable_reason()
    if reason is not None:
        print(f"\nMooncake tests skipped: {reason}")
    return reason


@pytest.fixture(scope="session")
def mooncake_pool(
    tmp_path_factory: pytest.TempPathFactory, mooncake_unavailable: str | None
) -> Iterator[LocalCluster]:
    """One master and one segment host for the tests that do not kill them."""
    if mooncake_unavailable is not None:
        pytest.skip(mooncake_unavailable)
    cluster = LocalCluster(tmp_path_factory.mktemp("mooncake-pool")).start()
    try:
        cluster.add_segment_host("512MB")
        yield cluster
    finally:
        cluster.stop()


#: how long the master of ``own_cluster_short_client_ttl`` waits for a client's heartbeat
#: before dropping it and its segment (mooncake_master's default: 10 s); the clients ping
#: once a second, so a live one is never dropped
SHORT_CLIENT_TTL_S = 3


@pytest.fixture
def own_cluster(tmp_path: Path, mooncake_unavailable: str | None) -> Iterator[LocalCluster]:
    """A cluster of the test's own (master only: add segment hosts, kill it at will)."""
    yield from _own_cluster(tmp_path, mooncake_unavailable, [])


@pytest.fixture
def own_cluster_short_client_ttl(tmp_path: Path, mooncake_unavailable: str | None) -> Iterator[LocalCluster]:
    """``own_cluster`` whose master drops a client that stopped pinging (a killed segment
    host) after ``SHORT_CLIENT_TTL_S``, not after its default 10 s."""
    yield from _own_cluster(tmp_path, mooncake_unavailable, [f"--client_ttl={SHORT_CLIENT_TTL_S}"])


def _own_cluster(
    tmp_path: Path, mooncake_unavailable: str | None, flags: list[str]
) -> Iterator[LocalCluster]:
    if mooncake_unavailable is not None:
        pytest.skip(mooncake_unavailable)
    cluster = LocalCluster(tmp_path / "mooncake", master_flags=flags).start()
    try:
        yield cluster
    finally:
        # Killed, not stopped: a test's cluster leaves nothing behind (no files, no shared
        # memory) and mooncake_master takes most of a second to stop when asked.
        for host in list(cluster.segment_hosts):
            cluster.kill_segment_host(host)
        cluster.kill_master()


@pytest.fixture(scope="module")
def closing() -> Iterator[ClosingInTurn]:
    """Adapters on ``mooncake_pool`` whose tests ended, closed a few at a time (a Mooncake
    client's close holds the process until the client next wakes, once a second); all by
    the end of the module."""
    closing = ClosingInTurn()
    yield closing
    closing.close_all()


@pytest.fixture(scope="module")
def raw(mooncake_pool: LocalCluster) -> Iterator[Any]:
    """A plain Mooncake client on the shared pool: another party writing into it.

    One per module: it holds no state of a test's (each test's objects are under a
    key_prefix of its own), and closing a Mooncake client takes up to a second (its
    close waits for a background thread of the client that wakes once a second).  Not
    shared between modules: another module may freeze the pool's master."""
    client = raw_client(mooncake_pool)
    yield client
    client.close()
