"""Everything at once against one server: both front ends, a small L1 under eviction
pressure, two L2 adapters, prefetches from L2, three native clients (shared memory and
inline) checking every byte they read, LMCache's own ``lmcache bench server`` on the
lmcache_mp port, and a forced clear midway.  Afterwards every acknowledged chunk is
readable from L2 with its bytes, or counted as lost; nothing is counted as corrupt; the
server stops cleanly."""

from __future__ import annotations

import multiprocessing
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from soak_jobs import job_soak_client
from test_lmcache_reference import REF_VENV, assert_every_checksum_passed, run_bench
from tiers_e2e import digest, make_keys, make_payloads, start_server, stop_cleanly
from trust_jobs import failures_in_metrics, wait_for_l2_stores

from lmcache_tiers.client import Client
from lmcache_tiers.testing.ports import free_ports

SPAWN = multiprocessing.get_context("spawn")
L1_MIB = 48
CHUNKS = 8
CHUNK = 256 << 10
WORKERS = 3
ROUNDS = 16  # 3 workers x 16 prompts x 2 MiB = 2x L1
LOST = "evicted_before_l2_store"
CLEARED = "l1_cleared_before_l2_store"
#: failure reasons that mean bytes were damaged or a store was committed without its reservation
NEVER = ("corrupt", "checksum", "mp_commit_without_reservation")
#: LMCache's bench shape: 4 chunks of 512 KiB per 1024-token request
BENCH_SHAPE = "(2,256,16,2,64):bfloat16:8"


def start_soak_server(tmp_path: Path) -> tuple[Any, str]:
    port, metrics_port, native_port = free_ports(3)
    adapters = [
        {"type": "fs", "path": str(tmp_path / "fs-l2")},
        {"type": "mock", "max_size_gb": 0.5, "bandwidth_bytes_per_s": 400_000_000},
    ]
    server = start_server(
        tmp_path / "server",
        port=port,
        metrics_port=metrics_port,
        l1_size_gb=L1_MIB / 1024,
        adapters=adapters,
        frontends=[{"type": "lmcache_mp"}, {"type": "native", "port": native_port}],
    )
    return server, f"tcp://127.0.0.1:{native_port}"


def run_reference_bench(url: str, output: Path, results: dict[str, Any]) -> None:
    try:
        results["metrics"] = run_bench(url, output, shape=BENCH_SHAPE)
    except BaseException as exc:  # reported by the test thread
        results["error"] = exc


def clear_midway(url: str, marks: Path) -> int:
    """Once every worker is half-way through, clear L1 by force."""
    deadline = time.monotonic() + 120
    while len(list(marks.iterdir())) < WORKERS:
        assert time.monotonic() < deadline, "the workers never got half-way"
        time.sleep(0.02)
    with Client(url, timeout=30) as client:
        return client.clear(force=True)


def readable_from_l2(client: Client, tags: list[str]) -> int:
    """Ask for every chunk of ``tags`` on its own (L1 was cleared: a hit comes from L2) and
    check its bytes; returns how many were found."""
    readable = 0
    for tag in tags:
        keys, expected = make_keys(tag, CHUNKS), digest(make_payloads(tag, CHUNKS, CHUNK))
        for key, want in zip(keys, expected, strict=True):
            if client.lookup([key], timeout=60) == 1:
                with client.retrieve([key]) as views:
                    assert digest(views) == [want], f"{tag}: L2 returned other bytes"
                readable += 1
    return readable


def test_mixed_clients_never_see_wrong_bytes_nor_lose_acknowledged_stores(tmp_path: Path) -> None:
    server, native = start_soak_server(tmp_path)
    marks = tmp_path / "marks"
    marks.mkdir()
    bench: dict[str, Any] = {}
    bench_thread = None
    try:
        if (REF_VENV / "bin" / "lmcache").exists():
            bench_thread = threading.Thread(
                target=run_reference_bench, args=(server.url, tmp_path / "bench.json", bench)
            )
            bench_thread.start()
        else:
            print(f"\nno LMCache reference venv at {REF_VENV}: the soak runs without LMCache's bench")
        with ProcessPoolExecutor(WORKERS, mp_context=SPAWN) as pool:
            futures = [
                pool.submit(job_soak_client, native, worker, ROUNDS, CHUNKS, CHUNK, str(marks))
                for worker in range(WORKERS)
            ]
            cleared = clear_midway(native, marks)
            results = [future.result(timeout=300) for future in futures]
        if bench_thread is not None:
            bench_thread.join(timeout=300)
            assert not bench_thread.is_alive(), "LMCache's bench did not finish"
            assert "error" not in bench, bench.get("error")
            assert_every_checksum_passed(bench["metrics"])
        tags = [tag for result in results for tag in result["acknowledged"]]
        with Client(native, timeout=60) as client:
            wait_for_l2_stores(client)
            status = client.status()
            assert [adapter["keys_store_failed"] for adapter in status["adapters"]] == [0, 0]
            client.clear()
            readable = readable_from_l2(client, tags)
        failures = failures_in_metrics(server.http_url)
        acknowledged = len(tags) * CHUNKS
        print(
            f"\nsoak: {readable}/{acknowledged} acknowledged native chunks readable from L2; "
            f"cleared {cleared} midway; failures {failures}; clients {results}"
        )
        assert not [reason for reason in failures if any(word in reason for word in NEVER)], failures
        lost = failures.get(LOST, 0.0) + failures.get(CLEARED, 0.0)
        assert acknowledged - readable <= lost, "an acknowledged store was lost uncounted"
        assert sum(result["partial"] for result in results) == 0
    finally:
        if bench_thread is not None:
            bench_thread.join(timeout=300)
        stop_cleanly(server)


def test_forced_clear_during_l2_stores_counts_only_what_l2_never_got(tmp_path: Path) -> None:
    """A forced clear while every L2 store is in flight: the stores still finish (their
    extents are kept until they report), so nothing is lost -- and nothing is counted lost."""
    server = start_server(
        tmp_path / "server", adapters=[{"type": "mock", "max_size_gb": 0.25, "latency_s": 0.5}]
    )
    tag = "in-flight"
    try:
        with Client(server.url, timeout=60) as client:
            assert client.store(make_keys(tag, CHUNKS), make_payloads(tag, CHUNKS, CHUNK)) == CHUNKS
            deadline = time.monotonic() + 30
            while (
                client.status()["store"]["pending_batches"],
                client.status()["store"]["in_flight_tasks"],
            ) != (0, 1):
                assert time.monotonic() < deadline, client.status()["store"]
                time.sleep(0.005)
            assert client.clear(force=True) == CHUNKS
            wait_for_l2_stores(client)
            readable = readable_from_l2(client, [tag])
        lost = failures_in_metrics(server.http_url).get("l1_cleared_before_l2_store", 0.0)
        assert (readable, lost) == (CHUNKS, 0.0)
    finally:
        stop_cleanly(server)
