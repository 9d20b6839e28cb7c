"""Graceful shutdown: SIGTERM in the middle of a store storm."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tiers_e2e import job_store_storm, start_server

from lmcache_tiers.client import Client

SPAWN = multiprocessing.get_context("spawn")


def test_sigterm_during_store_storm_exits_cleanly(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", adapters=[{"type": "mock", "max_size_gb": 0.5}])
    try:
        with ProcessPoolExecutor(4, mp_context=SPAWN) as pool:
            marks = tmp_path / "marks"
            marks.mkdir()
            futures = [
                pool.submit(job_store_storm, server.url, worker, 128 << 10, 60.0, str(marks))
                for worker in range(4)
            ]
            # Let the storm get going: every client storing, and a good number of chunks stored.
            with Client(server.url) as probe:
                deadline = time.monotonic() + 60
                while len(list(marks.iterdir())) < 4 or probe.status()["server"]["store_chunks"] < 200:
                    assert time.monotonic() < deadline, "the store storm never got going"
                    time.sleep(0.05)
            server.proc.send_signal(signal.SIGTERM)
            code = server.proc.wait(60)
            results = [future.result(timeout=60) for future in futures]
    finally:
        server.stop(signal.SIGKILL)
    output = server.output()
    assert code == 0, output
    assert "lmcache-tiers stopped" in output
    # every storming client saw a clean end (a refusal or a timeout), never a crash
    assert all(r["ended_by"] in ("SHUTTING_DOWN", "timeout") for r in results), results
    assert all(r["stored"] > 0 for r in results), results
    # nothing left in /dev/shm: neither its named segment nor a default-named one
    assert not server.shm_path.exists()
    ours = f"lmcache_tiers_{server.proc.pid}_"
    assert [name for name in os.listdir("/dev/shm") if name.startswith(ours)] == []


def test_second_signal_stops_at_once(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", metrics=False)
    with Client(server.url) as client:
        client.ping()
    server.proc.send_signal(signal.SIGINT)
    server.proc.send_signal(signal.SIGINT)
    assert server.proc.wait(60) == 0, server.output()
    assert not server.shm_path.exists()
