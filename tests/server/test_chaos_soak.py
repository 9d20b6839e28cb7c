"""Chaos through a running server: a small L1 under eviction pressure, prefetches from a
real Redis as L2, three native clients storing prompts whose bytes derive from their keys
and checking every byte they read.  Meanwhile Redis is killed (SIGKILL), restarted on the
same port without its data, then frozen (SIGSTOP) and resumed.  Afterwards: no wrong bytes
ever; the circuit closed by itself and hits from L2 resumed; every acknowledged chunk
stored from the kill on that L2 does not hold is counted as a lost write-back; the server
stops cleanly."""

from __future__ import annotations

import importlib.util
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from chaos_jobs import job_chaos_client
from tiers_e2e import (
    ServerProcess,
    digest,
    fetch,
    make_keys,
    make_payloads,
    metric,
    start_server,
    stop_cleanly,
)
from trust_jobs import failures_in_metrics, wait_for_l2_stores

from lmcache_tiers.client import Client
from lmcache_tiers.testing.ports import free_port

if importlib.util.find_spec("lmcache_plugin_redis") is None:
    pytest.skip("lmcache-plugin-redis is not installed", allow_module_level=True)

from lmcache_plugin_redis.testing import RedisServer, missing_reason

SPAWN = multiprocessing.get_context("spawn")
WORKERS = 3
CHUNKS = 4
CHUNK = 256 << 10
L1_MIB = 24  # a dozen 1 MiB prompts per worker fill it: eviction all along
ADAPTER = "0:redis"
WAIT_S = 60.0  # guards against hangs only
HOLD_S = 2.0  # how long each fault lasts while the clients go on
ROUNDS_PER_PHASE = 3  # every client gets through this many rounds in each phase
#: failure reasons that count an acknowledged write L2 does not hold
LOST_WRITE_BACK = (
    "l2_store_failed",
    "l2_store_submit_error",
    "evicted_before_l2_store",
    "l1_cleared_before_l2_store",
    "l2_store_abandoned",
    "l2_store_dropped_at_shutdown",
)
#: failure reasons that mean bytes were damaged
NEVER = ("corrupt", "checksum")


def metrics_of(server: ServerProcess) -> str:
    assert server.http_url is not None
    status, _, body = fetch(server.http_url + "/metrics")
    assert status == 200
    return body


def circuit_open(server: ServerProcess) -> float:
    return metric(metrics_of(server), "lmcache_tiers_adapter_circuit_open", f'adapter="{ADAPTER}"')


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


class Chaos:
    """The phase file the clients read, and waiting for them to get through a phase."""

    def __init__(self, control: Path) -> None:
        self.control = control
        (control / "progress").mkdir(parents=True)
        self.enter("before")

    def enter(self, phase: str) -> None:
        (self.control / "phase.tmp").write_text(phase)
        (self.control / "phase.tmp").replace(self.control / "phase")

    def hold(self, phase: str, futures: list[Any]) -> None:
        """Keep ``phase`` until every client finished ROUNDS_PER_PHASE rounds in it (and
        HOLD_S went by); a client that failed ends the wait with its error."""
        time.sleep(HOLD_S)
        deadline = time.monotonic() + WAIT_S
        while not all(self._rounds_in(worker, phase) >= ROUNDS_PER_PHASE for worker in range(WORKERS)):
            for future in futures:
                if future.done():
                    future.result()  # raises the client's error
                    raise AssertionError("a client stopped before the chaos was over")
            assert time.monotonic() < deadline, f"the clients never got through phase {phase}"
            time.sleep(0.05)

    def _rounds_in(self, worker: int, phase: str) -> int:
        path = self.control / "progress" / str(worker)
        if not path.exists():
            return 0
        seen, rounds = path.read_text().split()
        return int(rounds) if seen == phase else 0

    def stop(self) -> None:
        (self.control / "stop").touch()


def readable_from_l2(client: Client, tags: list[str]) -> int:
    """Ask for every chunk of ``tags`` on its own (L1 was cleared: a hit comes from L2),
    check its bytes, and give it back; returns how many were found."""
    readable = 0
    for tag in tags:
        keys, expected = make_keys(tag, CHUNKS), digest(make_payloads(tag, CHUNKS, CHUNK))
        for key, want in zip(keys, expected, strict=True):
            if client.lookup([key], timeout=WAIT_S) == 1:
                with client.retrieve([key]) as views:
                    assert digest(views) == [want], f"{tag}: L2 returned other bytes"
                readable += 1
                client.evict([key])  # keeps L1 from filling with what was checked
    return readable


def counts_of(result: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in result.items() if name != "acknowledged"}


def start_chaos_server(tmp_path: Path, redis: RedisServer) -> tuple[ServerProcess, str]:
    native_port = free_port()
    adapter = {
        "type": "redis",
        "url": redis.url,
        "key_prefix": "chaos:",
        "request_timeout": 1.0,
        "connection_timeout": 1.0,
        "circuit": {"failure_threshold": 2, "probe_interval_s": 0.2},
    }
    server = start_server(
        tmp_path / "server",
        l1_size_gb=L1_MIB / 1024,
        adapters=[adapter],
        frontends=[{"type": "native", "port": native_port}],
    )
    return server, f"tcp://127.0.0.1:{native_port}"


def test_redis_killed_restarted_empty_and_frozen_under_load(tmp_path: Path) -> None:
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    redis = RedisServer(tmp_path / "redis").start()
    server, native = start_chaos_server(tmp_path, redis)
    chaos = Chaos(tmp_path / "control")
    try:
        with ProcessPoolExecutor(WORKERS, mp_context=SPAWN) as pool:
            futures = [
                pool.submit(job_chaos_client, native, worker, CHUNKS, CHUNK, str(chaos.control))
                for worker in range(WORKERS)
            ]
            try:
                chaos.hold("before", futures)
                redis.stop()  # SIGKILL: everything Redis held is gone
                chaos.enter("down")
                wait_until(lambda: circuit_open(server) == 1, "the circuit to open")
                chaos.hold("down", futures)
                redis.start()  # the same port, empty
                chaos.enter("restarted")
                wait_until(lambda: circuit_open(server) == 0, "the circuit to close")
                chaos.hold("restarted", futures)
                redis.pause()
                chaos.enter("frozen")
                chaos.hold("frozen", futures)
                redis.resume()
                chaos.enter("resumed")
                chaos.hold("resumed", futures)
            finally:
                chaos.stop()
            results = [future.result(timeout=WAIT_S) for future in futures]
        acknowledged = [pair for result in results for pair in result["acknowledged"]]
        # From the kill on, whatever L2 does not hold was never written to it: a lost write-back.
        since_kill = [tag for tag, phase in acknowledged if phase != "before"]
        resumed = [tag for tag, phase in acknowledged if phase == "resumed"]
        with Client(native, timeout=WAIT_S) as client:
            wait_for_l2_stores(client)
            wait_until(lambda: circuit_open(server) == 0, "the circuit to close after the freeze")
            client.clear()
            readable = readable_from_l2(client, since_kill)
            readable_resumed = readable_from_l2(client, resumed)
        body = metrics_of(server)
        failures = failures_in_metrics(server.http_url or "")
        lost = sum(failures.get(reason, 0.0) for reason in LOST_WRITE_BACK)
        unreadable = len(since_kill) * CHUNKS - readable
        print(
            f"\nchaos: {readable}/{len(since_kill) * CHUNKS} chunks stored since the kill readable "
            f"from L2, {readable_resumed}/{len(resumed) * CHUNKS} of those after the freeze; "
            f"failures {failures}; clients {[counts_of(result) for result in results]}"
        )
        assert not [reason for reason in failures if any(word in reason for word in NEVER)], failures
        assert sum(result["partial"] for result in results) == 0
        assert metric(body, "lmcache_tiers_adapter_stat", f'adapter="{ADAPTER}",stat="circuit_opened"') >= 1
        assert readable_resumed > 0, "hits from L2 never resumed after Redis came back"
        assert unreadable <= lost, f"{unreadable} acknowledged chunks are not in L2, {lost} counted lost"
        log = server.output()
        for explained in ("circuit opened after", "circuit closed:", "were not stored in"):
            assert explained in log, f"no log line says {explained!r}"
    finally:
        stop_cleanly(server)
        redis.stop()
