"""Round trips, restarts and a SIGKILL through a real server whose L2 is raw_block or dax."""

from __future__ import annotations

import multiprocessing
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from block_stores import block_adapter_spec, image_directory, skip_without_block_plugins
from tiers_e2e import (
    digest,
    job_lookup_retrieve,
    job_store,
    job_store_storm,
    make_keys,
    make_payloads,
    run_in_process,
    start_server,
    stop_cleanly,
    wait_stored_in_l2,
)

from lmcache_tiers.client import Client

skip_without_block_plugins()

SPAWN = multiprocessing.get_context("spawn")
CHUNK = 128 << 10
SLOTS = 1024
EVICTION = {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}


@pytest.fixture
def storage() -> Iterator[Path]:
    yield from image_directory("lmcache-block-e2e-")


def adapter_spec(kind: str, directory: Path) -> dict[str, Any]:
    return block_adapter_spec(kind, directory, chunk=CHUNK, slots=SLOTS, eviction=EVICTION)


@pytest.mark.parametrize("kind", ["raw_block", "dax"])
def test_chunks_come_back_from_l2_and_after_a_server_restart(
    tmp_path: Path, storage: Path, kind: str
) -> None:
    spec = adapter_spec(kind, storage)
    first = start_server(tmp_path / "first", adapters=[spec])
    try:
        assert run_in_process(job_store, first.url, kind, 8, CHUNK, True) == (8, True)
        with Client(first.url) as client:
            wait_stored_in_l2(client, 8)
            assert client.clear() == 8  # only L2 holds the chunks now
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, first.url, kind, 8, CHUNK, True)
        assert (hits, retrieved, equal) == (8, 8, True)
    finally:
        stop_cleanly(first)
    second = start_server(tmp_path / "second", adapters=[spec])
    try:
        with Client(second.url) as client:
            status = client.status()["adapters"][0]
            assert status["used_bytes"] == 8 * CHUNK, "usage after the restart counts what is on the device"
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, second.url, kind, 8, CHUNK, False)
        assert (hits, retrieved, equal) == (8, 8, True)
    finally:
        stop_cleanly(second)


def verify_storm(url: str, results: list[dict[str, Any]]) -> tuple[int, int]:
    """Look up every chunk the storm sent; every hit must hold its bytes.
    Returns (chunks checked, chunks found)."""
    checked = found = 0
    with Client(url, timeout=60) as client:
        for worker, result in enumerate(results):
            for batch in range(result["batches"] + 1):
                tag = f"storm{worker}/{batch}"
                keys = make_keys(tag, 8)
                hits = client.lookup(keys, timeout=30)
                checked += len(keys)
                if not hits:
                    continue
                expected = digest(make_payloads(tag, 8, CHUNK))[:hits]
                with client.retrieve(keys[:hits]) as views:
                    assert digest(views) == expected, f"{tag}: wrong bytes after the restart"
                found += hits
    return checked, found


@pytest.mark.parametrize("kind", ["raw_block", "dax"])
def test_sigkill_of_the_server_during_a_store_storm(tmp_path: Path, storage: Path, kind: str) -> None:
    spec = adapter_spec(kind, storage)
    server = start_server(tmp_path / "killed", adapters=[spec])
    marks = tmp_path / "marks"
    marks.mkdir()
    try:
        with ProcessPoolExecutor(3, mp_context=SPAWN) as pool:
            futures = [
                pool.submit(job_store_storm, server.url, worker, CHUNK, 60.0, str(marks))
                for worker in range(3)
            ]
            with Client(server.url) as probe:
                deadline = time.monotonic() + 60
                while probe.status()["adapters"][0]["keys_stored"] < 600:
                    assert time.monotonic() < deadline, "the storm never reached L2"
                    time.sleep(0.02)
            server.stop(signal.SIGKILL)
            results = [future.result(timeout=120) for future in futures]
    finally:
        server.stop(signal.SIGKILL)
    restarted = start_server(tmp_path / "restarted", adapters=[spec])
    try:
        with Client(restarted.url) as client:
            backend = client.status()["adapters"][0]["backend"]
        assert backend.get("corrupt_records_removed", 0) == 0, backend
        checked, found = verify_storm(restarted.url, results)
        print(f"{kind}: {found} of {checked} storm chunks found after the kill, all with their bytes")
        assert found > 0
    finally:
        stop_cleanly(restarted)
