"""The segment host -- the process lending the memory the objects live in -- dies or
hangs under a running adapter: its objects are misses (never other bytes), counted and
released, nothing waits past the timeouts, and a new host takes new stores."""

from __future__ import annotations

import signal
import threading
import time

from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import config_for, eventually, open_adapter

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.processes import wait_stopped

SIZE = 64 << 10
#: generous bound on a call against a dead or stopped host with a 1 s timeout: a guard
#: against hangs, not a performance expectation
HANG_GUARD_S = 20.0


def _load(client: BlockingAdapterClient, keys: list[ObjectKey]) -> tuple[list[bool], list[bytes]]:
    buffers = [memoryview(bytearray(SIZE)) for _ in keys]
    ok = client.load(keys, buffers)
    return ok, [bytes(buffer) for buffer in buffers]


def _stored_patterns(client: BlockingAdapterClient, count: int) -> tuple[list[ObjectKey], list[bytes]]:
    """``count`` objects of distinct bytes, stored, each acknowledged."""
    keys = make_keys(count)
    data = [pattern(i, SIZE) for i in range(count)]
    assert client.store(keys, [memoryview(d) for d in data]) == [True] * count
    return keys, data


def _lookup(adapter: BackendAdapter, client: BlockingAdapterClient, keys: list[ObjectKey]) -> list[bool]:
    found = client.lookup_and_lock(keys).found
    adapter.unlock([key for key, hit in zip(keys, found, strict=True) if hit])
    return found


def test_a_killed_segment_host_s_objects_miss_are_released_and_a_new_host_takes_stores(
    own_cluster_short_client_ttl: LocalCluster,
) -> None:
    # The master drops the dead host's segment once its heartbeats are missed for the
    # client TTL: a short one, so the test does not wait out the default 10 s.
    own_cluster = own_cluster_short_client_ttl
    host = own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=1.0))
    client = BlockingAdapterClient(adapter, timeout=60)
    try:
        keys, _ = _stored_patterns(client, 3)
        assert adapter.used_bytes() == 3 * SIZE

        own_cluster.kill_segment_host(host)
        # Until the master notices the host gone, it still lists the objects: a load of
        # them reaches a dead process and fails, a miss of each key, never other bytes.
        started = time.monotonic()
        ok, contents = _load(client, keys)
        assert time.monotonic() - started < HANG_GUARD_S
        assert ok == [False] * 3, "bytes loaded from a dead segment host"
        stats = adapter.stats()
        assert stats.get("load_failures", 0) + stats.get("load_vanished", 0) == 3, stats
        # A delete cannot read the record's header there: it removes nothing and says so
        # -- the read failed, or was given up at the deadline while Mooncake retried the
        # connection -- or, once the master dropped the segment, finds the object gone.
        assert adapter.delete(keys[:1]) == [False]
        stats = adapter.stats()
        counted = ("delete_header_read_failures", "backend_errors", "objects_vanished")
        assert sum(stats.get(name, 0) for name in counted) >= 1, stats
        # A store the master places in the dead host's segment fails (nothing acknowledged),
        # or, once the segment is dropped, finds no room: either way counted.
        late = make_keys(1, start=20)
        assert client.store(late, [memoryview(pattern(20, SIZE))]) == [False]
        stats = adapter.stats()
        assert stats.get("store_failures", 0) + stats.get("store_no_room", 0) == 1, stats

        eventually(
            lambda: _lookup(adapter, client, keys) == [False] * 3,
            timeout=60,
            what="lookups missing the dead host's objects",
        )
        assert adapter.stats()["objects_vanished"] == 3
        assert adapter.used_bytes() == 0, "the dead host's objects are still accounted"
        ok, _ = _load(client, keys)
        assert ok == [False] * 3
        assert adapter.stats()["load_vanished"] >= 3

        eventually(lambda: own_cluster.segments() == [], timeout=60, what="the master unmounting the host")
        own_cluster.add_segment_host("64MB")
        # The failed store left no reservation behind: its key is stored like any other.
        fresh = [*make_keys(1, start=10), *late]
        fresh_data = [pattern(10, SIZE), pattern(20, SIZE)]
        assert client.store(fresh, [memoryview(d) for d in fresh_data]) == [True, True]
        assert client.lookup_and_lock(fresh).found == [True, True]
        ok, contents = _load(client, fresh)
        adapter.unlock(fresh)
        assert ok == [True, True] and contents == fresh_data
        assert adapter.used_bytes() == 2 * SIZE
        assert _lookup(adapter, client, keys) == [False] * 3, "objects of the dead host came back"
    finally:
        adapter.close()


def test_a_load_from_a_stopped_segment_host_fails_within_its_timeout(own_cluster: LocalCluster) -> None:
    host = own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=1.0))
    client = BlockingAdapterClient(adapter, timeout=60)
    try:
        keys, data = _stored_patterns(client, 2)
        assert client.lookup_and_lock(keys).found == [True, True]
        host.send_signal(signal.SIGSTOP)
        wait_stopped(host.pid, HANG_GUARD_S)
        outcome: list[tuple[list[bool], list[bytes]]] = []
        try:
            loading = threading.Thread(target=lambda: outcome.append(_load(client, keys)), daemon=True)
            loading.start()
            loading.join(HANG_GUARD_S)
            assert not loading.is_alive(), "a load from a stopped segment host hung"
            started = time.monotonic()
            late = make_keys(1, start=20)
            assert client.store(late, [memoryview(pattern(20, SIZE))]) == [False]
            assert time.monotonic() - started < HANG_GUARD_S
        finally:
            host.send_signal(signal.SIGCONT)
        adapter.unlock(keys)
        ((ok, contents),) = outcome
        assert ok == [False, False], "a load from a stopped host reported success"
        # Per-key misses, counted; not failures of the pool: the master answered
        # throughout, so the circuit stays closed (it guards the master).
        stats = adapter.stats()
        assert stats.get("load_failures", 0) + stats.get("load_vanished", 0) == 2, stats
        assert stats.get("store_failures", 0) + stats.get("store_no_room", 0) == 1, stats
        assert adapter.stats()["circuit_open"] == 0
        assert adapter.stats().get("backend_errors", 0) == 0
        # Running again, the host serves its objects intact -- unless it stayed stopped
        # long enough for the master to drop its segment: then they miss.  Never other bytes.
        found = client.lookup_and_lock(keys).found
        hits = [key for key, hit in zip(keys, found, strict=True) if hit]
        ok, contents = _load(client, hits)
        adapter.unlock(hits)
        assert all(ok) and contents == [data[i] for i, hit in enumerate(found) if hit]
    finally:
        adapter.close()
