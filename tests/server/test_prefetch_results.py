"""Prefetch results live until their client collects them (or their TTL gives them back)."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from tiers_e2e import digest, make_keys, make_payloads, start_server
from trust_jobs import failures_in_metrics, job_lookups, wait_for_l2_stores

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.wire.protocol import ErrorCode

SPAWN = multiprocessing.get_context("spawn")
SIZE = 16 << 10


def l1_locks(client: Client) -> int:
    return int(client.status()["l1"]["read_locks"])


def test_a_query_after_the_sweep_still_gets_the_result(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", adapters=[{"type": "mock", "max_size_gb": 0.1}])
    try:
        keys, data = make_keys("late", 8), make_payloads("late", 8, SIZE)
        with Client(server.url, timeout=30) as client:
            client.store(keys, data)
            wait_for_l2_stores(client)
            assert client.clear() == 8
            for pause in (0.5, 1.5):  # past two and seven housekeeping sweeps
                handle, hits = client.start_lookup(keys)
                assert hits is None
                time.sleep(pause)
                assert client.query_prefetch(handle) == 8
                with pytest.raises(ServerError) as again:
                    client.query_prefetch(handle)
                assert again.value.code is ErrorCode.NOT_FOUND  # delivered once
                with client.retrieve(keys) as views:
                    assert digest(views) == digest(data)
                assert l1_locks(client) == 0
            # wait_prefetch after a pause, and a lookup nobody asks about that is released
            handle, _ = client.start_lookup(keys)
            time.sleep(0.5)
            assert client.wait_prefetch(handle, 10) == 8
            assert client.release(keys) == 8
            handle, _ = client.start_lookup(keys)
            time.sleep(0.5)
            assert client.release(keys) == 8, "RELEASE drops the locks of an uncollected result"
            assert l1_locks(client) == 0
            assert client.query_prefetch(handle) == 8
            assert l1_locks(client) == 0
    finally:
        assert server.stop() == 0, server.output()


def test_a_result_nobody_collects_gives_its_locks_back_and_is_counted(tmp_path: Path) -> None:
    # A 4 s lock TTL: results wait 2 s for their client.
    server = start_server(
        tmp_path / "server", adapters=[{"type": "mock", "max_size_gb": 0.1}], l1_lock_ttl_s=4.0
    )
    try:
        keys = make_keys("forgotten", 8)
        with Client(server.url, timeout=30) as client:
            client.store(keys, make_payloads("forgotten", 8, SIZE))
            wait_for_l2_stores(client)
            assert client.clear() == 8
            handle, _ = client.start_lookup(keys)
            deadline = time.monotonic() + 1.0
            while l1_locks(client) != 8:
                assert time.monotonic() < deadline, "the prefetch did not finish"
                time.sleep(0.02)
            held_until = time.monotonic()
            while l1_locks(client) != 0:
                assert time.monotonic() < held_until + 10, "the locks of the result were never given back"
                time.sleep(0.05)
            assert time.monotonic() - held_until > 1.0, "given back before the result TTL"
            assert failures_in_metrics(server.http_url)["prefetch_result_expired"] == 1
            with pytest.raises(ServerError) as gone:
                client.query_prefetch(handle)
            assert gone.value.code is ErrorCode.NOT_FOUND
            assert "not collected within 2s" in str(gone.value)
            assert client.status()["l1"]["objects"] == 0, "temporary objects freed with their locks"
        assert "prefetch_result_expired" in server.output()
    finally:
        assert server.stop() == 0, server.output()


def test_five_thousand_lookups_against_a_faulty_l2(tmp_path: Path) -> None:
    """No lookup fails with NOT_FOUND, every hit has its bytes, and locks return to zero."""
    prompts, chunks = 40, 4
    faulty = {
        "type": "fault_inject",
        "inner": {"type": "mock", "max_size_gb": 0.1},
        "seed": 8,
        "lookup_fail_rate": 0.05,
        "load_fail_rate": 0.1,
        "corrupt_rate": 0.05,
        "corrupt_detected": True,
        "delay_s": 0.002,
        "delay_rate": 0.2,
        "delay_ops": ["load"],
    }
    # L1 too small for every prompt at once, so lookups keep going to L2.
    server = start_server(tmp_path / "server", adapters=[faulty], l1_size_gb=1 / 1024)
    try:
        with Client(server.url, timeout=30) as client:
            for prompt in range(prompts):
                tag = f"lk/{prompt}"
                client.store(make_keys(tag, chunks), make_payloads(tag, chunks, SIZE))
                wait_for_l2_stores(client)  # one prompt at a time: the small L1 never fills up
            client.clear()
        with ProcessPoolExecutor(2, mp_context=SPAWN) as pool:
            futures = [
                pool.submit(job_lookups, server.url, worker, prompts, chunks, SIZE, 2500) for worker in (0, 1)
            ]
            counts = [future.result(timeout=600) for future in futures]
        assert sum(count["lookups"] for count in counts) == 5000
        with Client(server.url, timeout=30) as client:
            status = client.status()
        print(
            f"\n5000 lookups: {status['requests']['l2_hit_chunks']} chunks from L2, "
            f"{sum(c['misses'] for c in counts)} short prefixes, failures {status['failures']}"
        )
        assert status["requests"]["l2_hit_chunks"] > 1000, "the lookups did not exercise L2"
        assert status["failures"].get("l2_load_failed", 0) > 0, "no load failed: the faults did not bite"
        assert status["l1"]["read_locks"] == 0
        assert status["l1"]["write_locked"] == 0
        assert status["server"]["locked_keys"] == 0
        assert "prefetch_result_expired" not in failures_in_metrics(server.http_url)
    finally:
        assert server.stop() == 0, server.output()
