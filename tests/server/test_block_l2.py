"""Round trips, restarts and a SIGKILL through a real server whose L2 is raw_block or dax."""

from __future__ import annotations

import importlib.util
import multiprocessing
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
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

for _module in ("lmcache_plugin_raw_block", "lmcache_plugin_dax"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_module} is not installed", allow_module_level=True)

SPAWN = multiprocessing.get_context("spawn")
CHUNK = 128 << 10
SLOTS = 1024
EVICTION = {"eviction_policy": "LRU", "trigger_watermark": 0.8, "eviction_ratio": 0.2}


@pytest.fixture
def storage() -> Iterator[Path]:
    """A directory in /dev/shm (dax maps its file shared; raw_block's file takes O_DIRECT there)."""
    directory = Path(tempfile.mkdtemp(prefix="lmcache-block-e2e-", dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def adapter_spec(kind: str, directory: Path) -> dict[str, Any]:
    if kind == "raw_block":
        slot = CHUNK + 4096
        return {
            "type": "raw_block",
            "device_path": str(directory / "raw_block.img"),
            "slot_bytes": slot,
            "capacity_bytes": (SLOTS + 8) * slot,
            "meta_checkpoint_interval_sec": 1,
            "eviction": EVICTION,
        }
    return {
        "type": "dax",
        "device_path": str(directory / "dax.img"),
        "max_dax_size_gb": (SLOTS * (CHUNK + 4096) + (1 << 20)) / (1 << 30),
        "slot_bytes": CHUNK,
        "eviction": EVICTION,
    }


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
