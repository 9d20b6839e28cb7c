"""An fs root on a store reached over the network (an fsspec URL) goes away mid-run and
comes back: core's circuit breaker is on by default for it, as for the other remote
adapters -- after failed calls lookups answer misses at once and stores are skipped, all
counted, its probe finds the store again and closes it, and the same adapter finds its
records.  A local directory has no breaker unless configured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fs_helpers import Arena, client, fs_config, load, open_fs, store

from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.seaweedfs import SeaweedS3, serving
from lmcache_tiers.testing.threads import wait_until

BUCKET = "tiers-fs-circuit"
SIZE = 64 << 10
#: how long a call may take while the store is down: far above the configured bounds, so
#: only a hang fails it (timing itself is for bench/)
HANG_GUARD_S = 30.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SeaweedS3]:
    with serving(tmp_path / "seaweedfs", buckets=[BUCKET]) as own:  # its own: this test kills it
        yield own


def test_a_store_gone_away_opens_the_default_circuit_and_its_return_closes_it(
    server: SeaweedS3,
) -> None:
    storage_options = {
        "endpoint_url": server.endpoint,
        "key": server.access_key,
        "secret": server.secret_key,
        # bounded calls while the store is down (botocore retries for long otherwise)
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 2, "retries": {"max_attempts": 1}},
    }
    config = fs_config(
        f"s3://{BUCKET}/kv",
        storage_options=storage_options,
        circuit={"failure_threshold": 2, "probe_interval_s": 0.2},
    )
    arena = Arena()
    adapter = open_fs(config, arena.view)
    try:
        blocking = client(adapter)
        blocking.timeout = HANG_GUARD_S
        keys = make_keys(3)
        data = [pattern(index, SIZE) for index in range(3)]
        assert store(adapter, arena, keys, data) == [True] * 3
        assert adapter.stats()["circuit_open"] == 0, "an fsspec URL's store is behind the breaker"

        server.kill()
        for _ in range(2):  # two failed calls in a row open the circuit
            assert blocking.lookup_and_lock(keys).found == [False] * 3
        stats = adapter.stats()
        assert stats["circuit_open"] == 1 and stats["backend_errors"] == 2, stats
        assert blocking.lookup_and_lock(keys).found == [False] * 3, "open: answered without the store"
        assert store(adapter, arena, make_keys(2, start=50), data[:2]) == [False, False]
        stats = adapter.stats()
        assert stats["backend_errors"] == 2, "nothing reached the store while the circuit was open"
        assert stats["circuit_missed_lookup_keys"] == 3 and stats["circuit_skipped_store_keys"] == 2

        server.start()
        wait_until(lambda: not adapter.stats()["circuit_open"], "the probe to close it", HANG_GUARD_S)
        assert adapter.stats()["circuit_closed"] == 1
        assert blocking.lookup_and_lock(keys).found == [True] * 3
        try:
            ok, loaded = load(adapter, arena, keys, [SIZE] * 3)
        finally:
            adapter.unlock(keys)
        assert ok == [True] * 3 and loaded == data
    finally:
        adapter.close()


def test_a_local_directory_has_no_breaker_unless_configured(tmp_path: Path) -> None:
    adapter = open_fs(fs_config(str(tmp_path / "plain")))
    try:
        assert "circuit_open" not in adapter.stats()
    finally:
        adapter.close()
    adapter = open_fs(fs_config(str(tmp_path / "guarded"), circuit={"enabled": True}))
    try:
        assert adapter.stats()["circuit_open"] == 0
    finally:
        adapter.close()
