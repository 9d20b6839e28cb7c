"""A standalone store's lookups run on a connection of the calling thread's own
(direct.py).  Some calls come from threads that end right after: the L2 eviction runs
each delete on a thread of its own, and a delete that removed nothing asks on that thread
whether its keys are gone (core's absence check, a lookup).  The connection of a thread
that ended must not stay open for the adapter's lifetime: one per eviction batch would
pile up until the store refuses new clients (``maxclients``) or the process runs out of
file descriptors."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from lmcache_plugin_redis.testing import RedisServer, missing_reason

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A server of the test's own: every client it lists is the adapter's."""
    if (reason := missing_reason()) is not None:
        pytest.skip(reason)
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def _connections(server: RedisServer) -> int:
    """Clients connected to ``server``, but the redis-cli asking."""
    return len(server.cli("CLIENT", "LIST").stdout.strip().splitlines()) - 1


def _delete_on_a_thread_of_its_own(adapter: BackendAdapter, keys: list[ObjectKey]) -> list[bool]:
    """``adapter.delete(keys)`` as the L2 eviction calls it: on a thread that then ends."""
    outcome: list[list[bool]] = []
    thread = threading.Thread(target=lambda: outcome.append(adapter.delete(keys)))
    thread.start()
    thread.join(60.0)
    assert not thread.is_alive() and outcome, "the delete returned"
    return outcome[0]


def test_lookups_on_threads_that_ended_leave_no_connection_open(
    own_server: RedisServer, prefix: str, open_adapter: Callable[..., BackendAdapter]
) -> None:
    adapter = open_adapter(url=own_server.url, key_prefix=prefix)
    keys = make_keys(12)
    client = BlockingAdapterClient(adapter, timeout=60.0)
    buffers = [memoryview(bytearray(pattern(index, 4096))) for index in range(len(keys))]
    assert client.store(keys, buffers) == [True] * len(keys)
    # Removed behind the adapter's back (another server's eviction, the store's maxmemory
    # policy): each delete removes nothing, and asks whether its key is gone.
    own_server.cli("FLUSHDB")

    assert _delete_on_a_thread_of_its_own(adapter, keys[:1]) == [False]
    before = _connections(own_server)
    for key in keys[1:]:
        assert _delete_on_a_thread_of_its_own(adapter, [key]) == [False]

    assert adapter.stats()["delete_keys_checked"] == len(keys), "each delete asked on its thread"
    assert adapter.used_bytes() == 0, "the absence checks released every key"
    assert _connections(own_server) <= before, "no connection is left per thread that ended"
