"""Graceful shutdown: SIGTERM in the middle of a store storm."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tiers_e2e import ServerProcess, job_store_storm, make_keys, make_payloads, slow_l2_server, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.server.app import EXIT_ACKNOWLEDGED_WRITES_LOST

SPAWN = multiprocessing.get_context("spawn")


def test_sigterm_during_store_storm_exits_cleanly(tmp_path: Path) -> None:
    # The flush after the drain stores every write the storm had acknowledged: a loaded
    # two-core machine takes longer than the default 10 s for it, and the exit then says
    # writes were lost (a code of its own) instead of 0.
    server = start_server(
        tmp_path / "server", adapters=[{"type": "mock", "max_size_gb": 0.5}], shutdown_timeout_s=60.0
    )
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
            code = server.proc.wait(180)
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


def _exited_having_lost_writes(server: ServerProcess, guard_s: float) -> str:
    """Wait (up to the guard) for the server to exit with the status of a stop that gave
    up acknowledged writes (not 0: scripts and supervisors must tell); returns its output."""
    code = server.proc.wait(guard_s)
    output = server.output()
    assert code == EXIT_ACKNOWLEDGED_WRITES_LOST == 3, output
    return output


def _flush_logged(server: ServerProcess) -> bool:
    return "flushing 3 L2 stores (up to 10s; Ctrl-C again to abandon)" in server.output()


def test_a_second_signal_abandons_the_flush_of_a_slow_l2(tmp_path: Path) -> None:
    server = slow_l2_server(tmp_path / "server")
    try:
        server.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while not _flush_logged(server):
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGINT)
        # Well under the 30 s an L2 call takes, or the 10 s flush deadline: the second
        # signal ends the wait (a generous guard, not a measured time).
        output = _exited_having_lost_writes(server, 8)
    finally:
        server.stop(signal.SIGKILL)
    assert "flush abandoned on a second signal: 3 L2 stores not waited for" in output
    assert "12 objects acknowledged to clients were not stored in L2 before the stop" in output
    summary = " ".join(output.split())
    assert "3 pending at stop, abandoned on a second signal, 12 objects not stored in L2" in summary
    assert "still alive" not in output
    assert not server.shm_path.exists()


def test_one_signal_flushes_up_to_the_deadline_and_says_so(tmp_path: Path) -> None:
    server = slow_l2_server(tmp_path / "server", shutdown_timeout_s=2.0)
    try:
        server.proc.send_signal(signal.SIGTERM)
        output = _exited_having_lost_writes(server, 45)
    finally:
        server.stop(signal.SIGKILL)
    assert "flushing 3 L2 stores (up to 2s; Ctrl-C again to abandon)" in output
    assert "flush timed out after 2s: 3 L2 stores not waited for" in output
    assert "flush timed out, 12 objects not stored in L2" in " ".join(output.split())


def test_no_live_views_at_the_stop_after_corrupt_records_were_removed(tmp_path: Path) -> None:
    from lmcache_tiers.plugin import FileLayout

    root = tmp_path / "l2"
    server = start_server(tmp_path / "server", adapters=[{"type": "fs", "path": str(root)}], metrics=False)
    keys = make_keys("corrupt-then-stop", 4)
    try:
        with Client(server.url) as client:
            assert client.store(keys, make_payloads("corrupt-then-stop", 4, 64 << 10)) == 4
            deadline = time.monotonic() + 30
            while client.status()["adapters"][0]["keys_stored"] < 4:
                assert time.monotonic() < deadline, server.output()
                time.sleep(0.05)
            client.clear(force=True)
            layout = FileLayout(str(root), shard_dirs=False)
            for key, offset in ((keys[0], -100), (keys[1], 20)):  # a payload byte, a header byte
                path = Path(layout.path_for(key))
                damaged = bytearray(path.read_bytes())
                damaged[offset] ^= 0x01
                path.write_bytes(bytes(damaged))
                assert client.lookup([key]) == 0
            assert client.status()["adapters"][0]["backend"]["corrupt_records_removed"] == 2
            assert client.lookup(keys[2:]) == 2
            with client.retrieve(keys[2:]) as views:
                assert len(views) == 2
    finally:
        code = server.stop(signal.SIGINT)
    output = server.output()
    assert code == 0, output
    assert "removed" in output and "still alive" not in output and "still exported" not in output
    assert not server.shm_path.exists()
