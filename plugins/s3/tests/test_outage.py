"""The S3 server dies mid-run and comes back: calls fail within their bounds, core's
circuit breaker opens (lookups miss at once, stores are skipped, all counted), its probe
finds the server again and closes it, and the same adapter finds its objects -- no
restart of anything but the S3 server."""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import botocore.auth
import pytest
from s3_helpers import BUCKET, blocking, open_adapter, remove_identity, s3_config, scoped_identity

from lmcache_tiers.plugin import CircuitConfig
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


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


def test_a_killed_server_opens_the_circuit_and_a_restart_closes_it(server: SeaweedS3) -> None:
    l1 = memoryview(bytearray(8 << 20))
    config = s3_config(
        server,
        "outage",
        connect_timeout_s=1.0,
        read_timeout_s=2.0,
        request_timeout_s=REQUEST_TIMEOUT_S,
        retries=1,
        circuit=CircuitConfig(failure_threshold=2, probe_interval_s=0.2),
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
        for _ in range(2):  # two failed calls in a row open the circuit
            assert client.lookup_and_lock(keys).found == [False] * 4
        stats = adapter.stats()
        assert stats["circuit_open"] == 1 and stats["backend_errors"] == 2
        assert client.lookup_and_lock(keys).found == [False] * 4, "open: answered without S3"
        assert client.store(make_keys(2, start=50), sources[:2]) == [False, False]
        stats = adapter.stats()
        assert stats["backend_errors"] == 2, "nothing reached the dead server"
        assert stats["circuit_missed_lookup_keys"] == 4 and stats["circuit_skipped_store_keys"] == 2

        server.start()
        wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the probe closed the circuit")
        assert adapter.stats()["circuit_closed"] == 1
        assert client.lookup_and_lock(keys).found == [True] * 4
        targets = [l1[(4 + index) * SIZE : (5 + index) * SIZE] for index in range(4)]
        assert client.load(keys, targets) == [True] * 4
        assert [bytes(target) for target in targets] == data
        adapter.unlock(keys)
        assert client.store(make_keys(2, start=50), sources[:2]) == [True, True], "stores resume too"
    finally:
        adapter.close()


def test_without_the_breaker_every_call_fails_within_its_bounds_and_heals(server: SeaweedS3) -> None:
    l1 = memoryview(bytearray(4 << 20))
    config = s3_config(
        server,
        "no-breaker",
        connect_timeout_s=1.0,
        request_timeout_s=REQUEST_TIMEOUT_S,
        retries=0,
        circuit=CircuitConfig(enabled=False),
    )
    adapter = open_adapter(config, l1)
    try:
        client = blocking(adapter, timeout=HANG_GUARD_S)
        keys = make_keys(2)
        l1[: 2 * SIZE] = pattern(9, 2 * SIZE)
        assert client.store(keys, [l1[:SIZE], l1[SIZE : 2 * SIZE]]) == [True, True]
        server.kill()
        for _ in range(4):
            assert client.lookup_and_lock(keys).found == [False, False]
        assert adapter.stats()["backend_errors"] == 4, "every call reached the backend and failed"
        assert "circuit_open" not in adapter.stats()
        server.start()
        wait_for(lambda: client.lookup_and_lock(keys).found == [True, True], "hits after the restart")
        adapter.unlock(keys)
    finally:
        adapter.close()


def test_an_identity_scoped_to_its_prefix_heals_after_an_outage(server: SeaweedS3) -> None:
    # Object permissions under the prefix only, as a least-privilege policy grants one
    # server: HeadBucket and listing are refused.  The probe must still find the
    # service answering, so the circuit closes once the server is back.
    scoped_identity(server, "scoped-key", "scoped-secret", "scoped")
    l1 = memoryview(bytearray(4 << 20))
    config = s3_config(
        server,
        "scoped",
        aws_access_key_id="scoped-key",
        aws_secret_access_key="scoped-secret",
        connect_timeout_s=1.0,
        request_timeout_s=REQUEST_TIMEOUT_S,
        retries=0,
        circuit=CircuitConfig(failure_threshold=1, probe_interval_s=0.2),
    )
    adapter = open_adapter(config, l1)  # a listing it may not make does not stop it
    try:
        client = blocking(adapter, timeout=HANG_GUARD_S)
        keys = make_keys(2)
        l1[: 2 * SIZE] = pattern(3, 2 * SIZE)
        assert client.store(keys, [l1[:SIZE], l1[SIZE : 2 * SIZE]]) == [True, True]
        server.kill()
        assert client.lookup_and_lock(keys).found == [False, False]
        assert adapter.stats()["circuit_open"] == 1
        server.start()
        wait_for(lambda: adapter.stats()["circuit_open"] == 0, "the probe closed the circuit")
        assert client.lookup_and_lock(keys).found == [True, True]
        adapter.unlock(keys)
        # Credentials revoked mid-run are not an answer: the circuit stays open.
        remove_identity(server, "scoped-key")
        wait_for(
            lambda: client.lookup_and_lock(keys).found == [False, False] and adapter.stats()["circuit_open"],
            "the revoked identity's calls failing",
        )
        probes = adapter.stats()["circuit_probes"]
        wait_for(lambda: adapter.stats()["circuit_probes"] >= probes + 3, "three more probes")
        stats = adapter.stats()
        assert stats["circuit_open"] == 1 and stats["circuit_closed"] == 1, "a rejected probe closed it"
    finally:
        adapter.close()


def test_a_probe_refused_for_a_skewed_clock_keeps_the_circuit_open(
    seaweed: SeaweedS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store that refuses every signed request (here: the clock is an hour off, so each
    is ``RequestTimeTooSkewed``) is not healthy: the probe must not close the circuit on
    that refusal, or every call reopens it.  The refusal is counted and logged."""
    l1 = memoryview(bytearray(4 << 20))
    config = s3_config(
        seaweed,
        "skewed",
        connect_timeout_s=1.0,
        request_timeout_s=REQUEST_TIMEOUT_S,
        retries=0,
        circuit=CircuitConfig(failure_threshold=1, probe_interval_s=0.2),
    )
    adapter = open_adapter(config, l1)
    try:
        client = blocking(adapter, timeout=HANG_GUARD_S)
        keys = make_keys(2)
        l1[: 2 * SIZE] = pattern(4, 2 * SIZE)
        assert client.store(keys, [l1[:SIZE], l1[SIZE : 2 * SIZE]]) == [True, True]
        skewed = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)
        monkeypatch.setattr(botocore.auth, "get_current_datetime", lambda *args, **kwargs: skewed)
        assert client.lookup_and_lock(keys).found == [False, False]
        assert adapter.stats()["circuit_open"] == 1
        wait_for(lambda: adapter.stats().get("probe_refusals", 0) >= 3, "three refused probes")
        stats = adapter.stats()
        assert stats["circuit_open"] == 1 and stats.get("circuit_closed", 0) == 0, "a refused probe closed it"
    finally:
        adapter.close()
