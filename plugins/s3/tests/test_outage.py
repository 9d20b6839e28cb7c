"""The S3 server dies mid-run and comes back: calls fail fast and counted, never hang, and
the same adapter finds its objects again once the server answers (no circuit breaker is
involved: this is the adapter's own behaviour)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from s3_helpers import BUCKET, blocking, open_adapter, s3_config

from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.seaweedfs import SeaweedS3, serving

SIZE = 64 << 10
REQUEST_TIMEOUT_S = 3.0
#: how long a call may take while the server is down: far above the configured bound, so
#: only a hang fails it (timing itself is for bench/)
HANG_GUARD_S = 10 * REQUEST_TIMEOUT_S


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SeaweedS3]:
    with serving(tmp_path / "seaweedfs", buckets=[BUCKET]) as own:  # its own: this test kills it
        yield own


def test_a_killed_server_turns_calls_into_counted_failures_and_a_restart_heals(server: SeaweedS3) -> None:
    l1 = memoryview(bytearray(8 << 20))
    config = s3_config(
        server,
        "outage",
        connect_timeout_s=1.0,
        read_timeout_s=2.0,
        request_timeout_s=REQUEST_TIMEOUT_S,
        retries=1,
    )
    adapter = open_adapter(config, l1)
    try:
        client = blocking(adapter, timeout=HANG_GUARD_S)
        keys = make_keys(4)
        data = [pattern(index, SIZE) for index in range(4)]
        sources = [l1[index * SIZE : (index + 1) * SIZE] for index in range(4)]
        for source, payload in zip(sources, data, strict=True):
            source[:] = payload
        assert client.store(keys, sources) == [True] * 4

        server.kill()
        errors_before = adapter.stats().get("backend_errors", 0)
        assert client.lookup_and_lock(keys).found == [False] * 4
        assert client.store(make_keys(2, start=50), sources[:2]) == [False, False]
        assert adapter.delete(keys[:1]) == [False]
        assert adapter.stats()["backend_errors"] >= errors_before + 3

        server.start()
        deadline = time.monotonic() + HANG_GUARD_S
        while (found := client.lookup_and_lock(keys)).found != [True] * 4:
            adapter.unlock([key for key, hit in zip(keys, found.found, strict=True) if hit])
            assert time.monotonic() < deadline, "the adapter never found its objects after the restart"
            time.sleep(0.2)
        targets = [l1[(4 + index) * SIZE : (5 + index) * SIZE] for index in range(4)]
        assert client.load(keys, targets) == [True] * 4
        assert [bytes(target) for target in targets] == data
        adapter.unlock(keys)
        assert client.store(make_keys(2, start=50), sources[:2]) == [True, True], "stores resume too"
    finally:
        adapter.close()
