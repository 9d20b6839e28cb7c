"""Servers whose L2 is ``fs``: SIGKILL during a store storm, and the embedded default L2
(capacity held across restarts, the banner, a second default server refused with a hint)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from tiers_e2e import START_TIMEOUT_S, digest, free_port, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client, ClientError

if importlib.util.find_spec("lmcache_plugin_fs") is None:
    pytest.skip("lmcache-plugin-fs is not installed", allow_module_level=True)

CHUNK = 256 << 10
HEADER = 4096
DEFAULT_TRIGGER_WATERMARK = 0.8  # the embedded default L2's, as its banner says


def _l2_counts(client: Client) -> tuple[int, int]:
    adapter = client.status()["adapters"][0]
    return adapter.get("keys_stored", 0), adapter.get("keys_store_failed", 0)


def _wait_settled(client: Client, count: int, timeout: float = 60.0) -> None:
    """Until the store controller has settled ``count`` chunks (stored or failed)."""
    deadline = time.monotonic() + timeout
    while sum(_l2_counts(client)) < count:
        assert time.monotonic() < deadline, f"L2 stores never settled: {_l2_counts(client)} of {count}"
        time.sleep(0.05)


def _wait_below_watermark(client: Client, timeout: float = 60.0) -> None:
    """Until the eviction controller, woken by each store, has brought the default L2's
    usage under its 80% trigger: what it does after every store, in one cycle or several."""
    deadline = time.monotonic() + timeout
    while (usage := client.status()["adapters"][0]["usage"]) >= DEFAULT_TRIGGER_WATERMARK:
        assert time.monotonic() < deadline, f"eviction never brought the default L2 under 80%: {usage}"
        time.sleep(0.05)


def _payload_on_disk(root: Path) -> int:
    return sum(path.stat().st_size - HEADER for path in root.rglob("*.bin"))


def test_sigkill_during_a_store_storm_then_restart(tmp_path: Path) -> None:
    adapter = {"type": "fs", "path": str(tmp_path / "l2"), "shard_dirs": True}
    server = start_server(tmp_path / "first", adapters=[adapter])
    stored_batches: list[int] = []
    stop = threading.Event()

    def storm() -> None:
        with Client(server.url, timeout=5) as client:
            batch = 0
            while not stop.is_set():
                try:
                    client.store(make_keys(f"storm{batch}", 8), make_payloads(f"storm{batch}", 8, CHUNK))
                except ClientError:
                    return  # the server is gone
                stored_batches.append(batch)
                batch += 1

    writer = threading.Thread(target=storm, daemon=True)
    writer.start()
    try:
        with Client(server.url, timeout=30) as client:
            deadline = time.monotonic() + 60
            while _l2_counts(client)[0] < 200:
                assert time.monotonic() < deadline, "the storm never reached L2"
                time.sleep(0.02)
        server.stop(signal.SIGKILL)
    finally:
        stop.set()
        server.stop(signal.SIGKILL)
        writer.join(30)
    batches = list(stored_batches)
    records = len(list((tmp_path / "l2").rglob("*.bin")))
    print(f"killed after {len(batches)} acknowledged batches, {records} records")

    restarted = start_server(tmp_path / "second", adapters=[adapter])
    try:
        hits = checked = 0
        with Client(restarted.url, timeout=60) as client:
            for batch in batches:
                keys = make_keys(f"storm{batch}", 8)
                found = client.lookup(keys, timeout=60)
                if not found:
                    continue
                with client.retrieve(keys[:found]) as views:
                    got = digest(views)
                assert got == digest(make_payloads(f"storm{batch}", 8, CHUNK))[:found], (
                    f"batch {batch} wrong bytes"
                )
                hits += found
                checked += 1
            status = client.status()
        assert hits >= 200, "the records the first server had stored must survive"
        backend = status["adapters"][0]["backend"]
        assert backend.get("corrupt_records_removed", 0) == 0
        assert backend["scan_keys"] >= hits, "the start-up scan counted what was on disk"
        print(f"after the restart: {hits} chunks hit in {checked} batches, every one with the bytes stored")
    finally:
        assert restarted.stop() == 0, restarted.output()


# -- the embedded default ------------------------------------------------------------------


def _serve_default(log_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "lmcache_tiers.cli.main",
        "serve",
        "--l1-size-gb",
        "0.0625",
        "--port",
        str(port),
        "--metrics-port",
        "0",
        "--shm-name",
        f"tiers_default_{os.getpid()}_{port}",
    ]
    proc = subprocess.Popen(
        command,
        stdout=(log_dir / "stdout.txt").open("wb"),
        stderr=(log_dir / "stderr.txt").open("wb"),
        env={**os.environ, "COLUMNS": "250", **env},
    )
    proc.url = f"tcp://127.0.0.1:{port}"  # type: ignore[attr-defined]
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, (log_dir / "stderr.txt").read_text()
        try:
            with Client(proc.url, timeout=1) as client:  # type: ignore[attr-defined]
                client.ping()
            return proc
        except ClientError:
            assert time.monotonic() < deadline, "the default server never answered"
            time.sleep(0.1)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_default_l2_stays_under_its_capacity_across_restarts(tmp_path: Path) -> None:
    capacity = 4 << 20
    env = {
        "LMCACHE_TIERS_CACHE_DIR": str(tmp_path / "cache"),
        "LMCACHE_TIERS_CACHE_GB": repr(capacity / (1 << 30)),
        "LMCACHE_TIERS_LOCK_DIR": str(tmp_path / "locks"),
    }
    root = tmp_path / "cache" / "l2"
    on_disk = []
    for run in range(3):
        proc = _serve_default(tmp_path / f"run{run}", env)
        try:
            with Client(proc.url, timeout=30) as client:  # type: ignore[attr-defined]
                start = client.status()["adapters"][0]
                # Usage after a restart counts what is on disk (the start-up scan).
                assert start["used_bytes"] == (on_disk[-1] if on_disk else 0), start
                for batch in range(8):  # 8 x 4 x 256 KiB = 2 capacities per run
                    tag = f"run{run}/{batch}"
                    client.store(make_keys(tag, 4), make_payloads(tag, 4, CHUNK))
                    _wait_settled(client, (batch + 1) * 4)
                    _wait_below_watermark(client)
                stats = client.status()["adapters"][0]
            if run == 0:
                second = subprocess.run(
                    [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--port", str(free_port())],
                    capture_output=True,
                    text=True,
                    env={**os.environ, "COLUMNS": "250", **env},
                    timeout=60,
                )
                assert second.returncode == 2
                message = second.stderr.strip()
                assert len(message.splitlines()) == 1, message
                assert "LMCACHE_TIERS_CACHE_DIR" in message and "--no-default-l2" in message
                assert ".lock" not in message and "already uses the default L2 cache" in message
        finally:
            _stop(proc)
        banner = (tmp_path / f"run{run}" / "stdout.txt").read_text()
        assert "the embedded default" in " ".join(banner.split())
        assert "LRU eviction at 80% frees 20%" in " ".join(banner.split())
        on_disk.append(_payload_on_disk(root))
        assert stats["keys_stored"] > 0, f"run {run} stored nothing: {stats}"
    print(f"default L2 payload on disk after each run: {on_disk} (capacity {capacity})")
    assert all(size <= capacity for size in on_disk), on_disk
    assert on_disk[-1] >= capacity // 2, "eviction frees a fraction, not everything"
