"""lmcache-tiers servers whose L2 is the ``s3`` adapter, on a real S3 server (SeaweedFS):
a restart of lmcache-tiers finds its chunks again, two servers share one bucket, and an
S3 outage mid-run is survived -- L1 keeps serving, failures and the circuit breaker's
state are in /metrics, and once the bucket is back the circuit closes by itself and hits
resume, without restarting lmcache-tiers.

Credentials reach the servers the way operators give them: the AWS environment variables.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import (
    ServerProcess,
    digest,
    fetch,
    make_keys,
    make_payloads,
    metric,
    start_server,
    wait_stored_in_l2,
)

from lmcache_tiers.client import Client
from lmcache_tiers.testing.seaweedfs import SeaweedS3, serving

if importlib.util.find_spec("lmcache_plugin_s3") is None:
    pytest.skip("lmcache-plugin-s3 is not installed", allow_module_level=True)

BUCKET = "tiers-e2e"
CHUNK = 256 << 10
#: the adapter's bound on one S3 request during the outage test
REQUEST_TIMEOUT_S = 3.0
#: far above every configured bound: only a hang exceeds it (timings are for bench/)
HANG_GUARD_S = 60.0


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """One SeaweedFS for the tests that leave it running (starting one takes seconds); each
    works under a prefix of its own."""
    with serving(tmp_path_factory.mktemp("seaweedfs"), buckets=[BUCKET]) as server:
        yield server


@pytest.fixture
def own_seaweed(tmp_path: Path) -> Iterator[SeaweedS3]:
    """A SeaweedFS for one test alone: it kills and restarts it."""
    with serving(tmp_path / "seaweedfs", buckets=[BUCKET]) as server:
        yield server


def s3_adapter(seaweed: SeaweedS3, prefix: str, **fields: Any) -> dict[str, Any]:
    return {"type": "s3", "bucket": BUCKET, "prefix": prefix, "endpoint_url": seaweed.endpoint, **fields}


def start(seaweed: SeaweedS3, log_dir: Path, adapter: dict[str, Any]) -> ServerProcess:
    return start_server(log_dir, adapters=[adapter], env=seaweed.env)


def stop(server: ServerProcess) -> None:
    assert server.stop() == 0, server.output()


def store_in_l2(server: ServerProcess, tag: str, count: int) -> None:
    """Store chunks, wait until the L2 holds them, then drop them from L1."""
    with Client(server.url, timeout=30) as client:
        before = client.status()["adapters"][0]["keys_stored"]
        assert client.store(make_keys(tag, count), make_payloads(tag, count, CHUNK)) == count
        wait_stored_in_l2(client, before + count, HANG_GUARD_S)
        client.clear()


def hits_and_bytes(server: ServerProcess, tag: str, count: int) -> tuple[int, bool]:
    """Look up and retrieve; (hits, whether every retrieved byte is what was stored)."""
    keys = make_keys(tag, count)
    with Client(server.url, timeout=HANG_GUARD_S) as client:
        hits = client.lookup(keys)
        with client.retrieve(keys[:hits]) as views:
            equal = digest(views) == digest(make_payloads(tag, count, CHUNK))[:hits]
    return hits, equal


def metrics(server: ServerProcess) -> str:
    assert server.http_url is not None
    status, _, text = fetch(server.http_url + "/metrics")
    assert status == 200
    return text


def failures(server: ServerProcess) -> dict[str, float]:
    return {
        match.group(1): float(match.group(2))
        for match in re.finditer(
            r'^lmcache_tiers_failures_total\{reason="([^"]+)"\} (\S+)$', metrics(server), re.M
        )
    }


def circuit_open(server: ServerProcess) -> float:
    return metric(metrics(server), "lmcache_tiers_adapter_circuit_open", 'adapter="0:s3"')


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + HANG_GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.1)


def test_a_restarted_server_finds_its_chunks_in_the_bucket(seaweed: SeaweedS3, tmp_path: Path) -> None:
    adapter = s3_adapter(seaweed, f"restart-{uuid.uuid4().hex[:8]}")
    first = start(seaweed, tmp_path / "first", adapter)
    try:
        store_in_l2(first, "persist", 6)
    finally:
        stop(first)
    second = start(seaweed, tmp_path / "second", adapter)
    try:
        assert hits_and_bytes(second, "persist", 6) == (6, True)
        with Client(second.url) as client:
            backend = client.status()["adapters"][0]["backend"]
        assert backend["scan_keys"] == 6, "the start-up listing accounted what the bucket holds"
    finally:
        stop(second)


def test_two_servers_share_one_bucket(seaweed: SeaweedS3, tmp_path: Path) -> None:
    adapter = s3_adapter(seaweed, f"shared-{uuid.uuid4().hex[:8]}")
    one = start(seaweed, tmp_path / "one", adapter)
    two = start(seaweed, tmp_path / "two", adapter)
    try:
        store_in_l2(one, "from-one", 5)
        assert hits_and_bytes(two, "from-one", 5) == (5, True), "stored through one, a hit through two"
        store_in_l2(two, "from-two", 3)
        assert hits_and_bytes(one, "from-two", 3) == (3, True)
    finally:
        stop(one)
        stop(two)


def test_an_s3_outage_mid_run_is_survived_and_healed(own_seaweed: SeaweedS3, tmp_path: Path) -> None:
    seaweed = own_seaweed
    adapter = s3_adapter(
        seaweed,
        "outage",
        connect_timeout_s=1.0,
        read_timeout_s=2.0,
        request_timeout_s=REQUEST_TIMEOUT_S,
        retries=1,
        circuit={"failure_threshold": 2, "probe_interval_s": 0.2},
    )
    server = start(seaweed, tmp_path / "server", adapter)
    try:
        store_in_l2(server, "before", 8)
        assert circuit_open(server) == 0
        seaweed.kill()

        started = time.monotonic()
        assert hits_and_bytes(server, "before", 8) == (0, True), "L2 is down: misses, not errors"
        assert time.monotonic() - started < HANG_GUARD_S
        with Client(server.url, timeout=30) as client:  # L1 keeps serving meanwhile
            assert client.store(make_keys("during", 4), make_payloads("during", 4, CHUNK)) == 4
        assert hits_and_bytes(server, "during", 4) == (4, True)
        wait_for(lambda: failures(server).get("l2_store_failed", 0) >= 4, "failed L2 stores in /metrics")
        wait_for(lambda: circuit_open(server) == 1, "the circuit opened, in /metrics")
        assert hits_and_bytes(server, "before", 8) == (0, True), "open: misses at once"
        text = metrics(server)
        assert metric(text, "lmcache_tiers_adapter_backend_errors_total", 'adapter="0:s3"') >= 2
        assert (
            metric(text, "lmcache_tiers_adapter_stat", 'adapter="0:s3",stat="circuit_missed_lookup_keys"') > 0
        )

        seaweed.start()
        wait_for(lambda: circuit_open(server) == 0, "the circuit closed by itself")
        assert hits_and_bytes(server, "before", 8) == (8, True), "hits resume, lmcache-tiers never restarted"
        store_in_l2(server, "after", 2)  # stores to the bucket resume too
        assert hits_and_bytes(server, "after", 2) == (2, True)
        with Client(server.url) as client:
            backend = client.status()["adapters"][0]["backend"]
        assert backend["circuit_opened"] == 1 and backend["circuit_closed"] == 1
    finally:
        stop(server)


def test_serve_with_a_missing_bucket_exits_2_with_one_line(seaweed: SeaweedS3) -> None:
    adapter = s3_adapter(seaweed, "p", bucket="absent-bucket")
    command = [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--port", "0", "--metrics-port", "0"]
    done = subprocess.run(
        [*command, "--l1-size-gb", "0.05", "--l2-adapter", json.dumps(adapter)],
        capture_output=True,
        text=True,
        env={**os.environ, **seaweed.env},
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: 0:s3: bucket 'absent-bucket' does not exist at {seaweed.endpoint}"]
    assert seaweed.secret_key not in done.stdout + done.stderr
