"""Helpers of the end-to-end server tests: server subprocesses and client jobs.

Client jobs are module-level functions so that ``spawn`` child processes can import and
run them: every test client runs in a process of its own, like an engine would.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Collection
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lmcache_tiers.client import Client, ClientError, RequestTimeoutError, ServerError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.ports import free_port as free_port  # re-exported for the tests
from lmcache_tiers.testing.ports import free_ports
from lmcache_tiers.wire.protocol import StoreReserve, StoreReserveReply

HERE = Path(__file__).parent
LAUNCHER = HERE / "serve_for_tests.py"
START_TIMEOUT_S = 60.0


def stop_signals_at_default(ignored: Collection[int] = ()) -> Callable[[], None]:
    """A ``preexec_fn`` giving a server process SIGINT, SIGHUP and SIGQUIT at their default
    action but those in ``ignored``.  serve keeps each ignored when it inherits it so: a
    test run under ``nohup``, or as a script's background job, would otherwise start
    servers that the tests' SIGINT, SIGHUP or SIGQUIT cannot stop."""

    def reset() -> None:
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)

    return reset


@dataclass
class ServerProcess:
    url: str
    http_url: str | None
    shm_name: str
    proc: subprocess.Popen[bytes]
    log_dir: Path
    returncode: int | None = field(default=None)
    shm_dir: str = "/dev/shm"

    @property
    def shm_path(self) -> Path:
        return Path(self.shm_dir) / self.shm_name

    def output(self) -> str:
        out = (self.log_dir / "stdout.txt").read_text(errors="replace")
        err = (self.log_dir / "stderr.txt").read_text(errors="replace")
        return f"--- stdout ---\n{out}\n--- stderr ---\n{err}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self._remove_segment()
                raise AssertionError(f"server did not stop within {timeout}s\n{self.output()}") from None
            if sig == signal.SIGKILL:
                self._remove_segment()
        self.returncode = self.proc.returncode
        return self.returncode

    def _remove_segment(self) -> None:
        # A killed server cannot unlink its segment; do not leave 256 MiB of /dev/shm behind.
        self.shm_path.unlink(missing_ok=True)


#: start-ups tried on new free ports when a port found free was taken before the server bound it
_PORT_RACE_TRIES = 3


def start_server(
    log_dir: Path,
    *,
    adapters: list[dict[str, Any]] | None = None,
    frontends: list[dict[str, Any]] | None = None,
    metrics: bool = True,
    env: dict[str, str] | None = None,
    ignored_signals: Collection[int] = (),
    **config: Any,
) -> ServerProcess:
    """Start a server subprocess on free loopback ports and wait until it listens; ``url``
    is the address of the front ends that give no port of their own (``--port``).  It
    starts with ``ignored_signals`` ignored, as under ``nohup`` (see
    :func:`stop_signals_at_default`).

    A port found free can be taken by another process (another test's server, a store's
    own listener) before the server binds it; the server then refuses to start ("is
    already in use", exit 2), and it is started again on new ports -- unless the test gave
    the ports itself."""
    for attempt in range(1, _PORT_RACE_TRIES + 1):
        try:
            return _start_server(log_dir, adapters, frontends, metrics, env, ignored_signals, config)
        except _PortTaken:
            if attempt == _PORT_RACE_TRIES or "port" in config or "metrics_port" in config:
                raise
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


class _PortTaken(AssertionError):
    """The server refused to start: a port it was given was in use by then."""


def _start_server(
    log_dir: Path,
    adapters: list[dict[str, Any]] | None,
    frontends: list[dict[str, Any]] | None,
    metrics: bool,
    env: dict[str, str] | None,
    ignored_signals: Collection[int],
    config: dict[str, Any],
) -> ServerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    shm_name = f"tiers_test_{uuid.uuid4().hex[:12]}"
    port, metrics_port = free_ports(2)
    settings: dict[str, Any] = {
        "l1_size_gb": 0.25,
        "port": port,
        "metrics_port": metrics_port if metrics else 0,
        "l1_shm_name": shm_name,
        **config,
    }
    host = settings.get("host", "127.0.0.1")
    url = host if str(host).startswith("ipc://") else f"tcp://{host}:{settings['port']}"
    http_url = f"http://127.0.0.1:{settings['metrics_port']}" if settings["metrics_port"] else None
    ready = log_dir / f"ready-{shm_name}"
    spec = json.dumps({"config": settings, "adapters": adapters or [], "frontends": frontends or []})
    proc = subprocess.Popen(
        [sys.executable, str(LAUNCHER), spec, str(ready)],
        stdout=(log_dir / "stdout.txt").open("wb"),
        stderr=(log_dir / "stderr.txt").open("wb"),
        env={**os.environ, "LMCACHE_LOG_LEVEL": "INFO", "COLUMNS": "200", **(env or {})},
        preexec_fn=stop_signals_at_default(ignored_signals),
    )
    server = ServerProcess(
        url, http_url, shm_name, proc, log_dir, shm_dir=settings.get("l1_shm_dir", "/dev/shm")
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready.exists():
        if proc.poll() is not None:
            output = server.output()
            failure = _PortTaken if proc.returncode == 2 and "is already in use" in output else AssertionError
            raise failure(f"server exited with {proc.returncode} during start-up\n{output}")
        if time.monotonic() > deadline:
            server.stop(signal.SIGKILL)
            raise AssertionError(f"server did not start within {START_TIMEOUT_S}s\n{server.output()}")
        time.sleep(0.02)
    return server


def slow_l2_server(log_dir: Path, **config: Any) -> ServerProcess:
    """A server whose only L2 takes 30 s for every call, holding three pending stores
    (12 objects acknowledged to the client and not yet in L2)."""
    server = start_server(
        log_dir,
        adapters=[{"type": "mock", "max_size_gb": 0.1, "latency_s": 30}],
        metrics=False,
        **config,
    )
    with Client(server.url) as client:
        for batch in range(3):
            tag = f"slow-l2/{log_dir.name}/{batch}"
            assert client.store(make_keys(tag, 4), make_payloads(tag, 4, 64 << 10)) == 4
        deadline = time.monotonic() + 30
        while client.status()["store"]["in_flight_tasks"] < 3:
            assert time.monotonic() < deadline, "the stores never reached the slow L2"
            time.sleep(0.05)
    return server


def fetch(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, str]:
    """GET ``url``: (status, content type, body), for error statuses too."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text; fails if it is not there."""
    prefix = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(prefix + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{prefix} not in /metrics:\n{text}")


def run_in_process(function: Any, *args: Any, timeout: float = 180.0) -> Any:
    """``function(*args)`` in a spawned process of its own, as an engine would run it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result(timeout=timeout)


def wait_stored_in_l2(target: ServerProcess | Client, count: int, timeout: float = 60.0) -> None:
    """Wait until the first adapter has stored ``count`` keys in all, asking through
    ``target`` (a client, or a server to open one to)."""
    if isinstance(target, ServerProcess):
        with Client(target.url) as client:
            wait_stored_in_l2(client, count, timeout)
        return
    deadline = time.monotonic() + timeout
    while target.status()["adapters"][0]["keys_stored"] < count:
        assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
        time.sleep(0.05)


def stop_cleanly(server: ServerProcess) -> None:
    """Stop ``server`` and check it exited with 0 and removed its L1 segment."""
    assert server.stop() == 0, server.output()
    assert not server.shm_path.exists(), "the L1 segment outlived the server"


# -- deterministic test data -------------------------------------------------------------


def make_keys(tag: str, count: int, model: str = "test-model", salt: str = "") -> list[ObjectKey]:
    return [
        ObjectKey(model, 0, hashlib.blake2b(f"{tag}/{index}".encode(), digest_size=32).digest(), 0, salt)
        for index in range(count)
    ]


def make_payloads(tag: str, count: int, size: int) -> list[np.ndarray[Any, Any]]:
    seed = int.from_bytes(hashlib.blake2b(tag.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(count)]


def digest(views: list[Any]) -> list[str]:
    return [hashlib.blake2b(bytes(view), digest_size=16).hexdigest() for view in views]


# -- client jobs (run in spawned processes) -----------------------------------------------


def job_store(url: str, tag: str, count: int, size: int, shm: bool) -> tuple[int, bool]:
    """Store ``count`` chunks; returns (newly stored, whether the client used shared memory)."""
    with Client(url, shm=shm, timeout=30) as client:
        return client.store(make_keys(tag, count), make_payloads(tag, count, size)), client.uses_shm


def job_lookup_retrieve(url: str, tag: str, count: int, size: int, shm: bool) -> tuple[int, int, bool, bool]:
    """Look up and retrieve; returns (hits, retrieved, bytes equal, used shared memory)."""
    keys = make_keys(tag, count)
    expected = digest(make_payloads(tag, count, size))
    with Client(url, shm=shm, timeout=30) as client:
        hits = client.lookup(keys, timeout=30)
        with client.retrieve(keys[:hits]) as views:
            got = digest(views)
        return hits, len(got), got == expected[: len(got)], client.uses_shm


def job_mixed(url: str, worker: int, rounds: int, size: int) -> dict[str, int]:
    """A busy engine: stores its own chunks and a shared prefix, looks up, retrieves,
    checks every byte, releases.  Any exception fails the test through the pool."""
    shared_keys, shared_data = make_keys("shared", 4), make_payloads("shared", 4, size)
    counts = {"stored": 0, "hits": 0, "checked": 0}
    with Client(url, shm=worker % 2 == 0, timeout=60) as client:
        for round_index in range(rounds):
            tag = f"worker{worker}/round{round_index}"
            keys = shared_keys + make_keys(tag, 4)
            data = shared_data + make_payloads(tag, 4, size)
            counts["stored"] += client.store(keys, data)
            hits = client.lookup(keys)
            # store() skips keys another worker is still filling (the shared prefix, in the
            # first round): they become readable when that worker commits, not before.
            deadline = time.monotonic() + 30
            while hits != len(keys):
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker {worker}: lookup found {hits} of {len(keys)} just stored")
                time.sleep(0.005)
                hits = client.lookup(keys)
            counts["hits"] += hits
            with client.retrieve(keys) as views:
                if digest(views) != digest(data):
                    raise AssertionError(f"worker {worker}: retrieved bytes differ")
                counts["checked"] += len(views)
            out = [np.empty(size, dtype=np.uint8) for _ in keys]
            if client.retrieve_into(keys, out) != len(keys) or digest(out) != digest(data):
                raise AssertionError(f"worker {worker}: retrieve_into bytes differ")
    return counts


def job_store_storm(url: str, worker: int, size: int, seconds: float, marks: str) -> dict[str, Any]:
    """Store new chunks as fast as possible until the server goes away (or time is up);
    a file in ``marks`` tells the test this worker has stored its first chunks."""
    stored, batches, ended_by = 0, 0, "time"
    deadline = time.monotonic() + seconds
    try:
        with Client(url, shm=worker % 2 == 0, timeout=5) as client:
            while time.monotonic() < deadline:
                tag = f"storm{worker}/{batches}"
                newly = client.store(make_keys(tag, 8), make_payloads(tag, 8, size))
                batches += 1
                if newly and not stored:  # mark once something is really stored
                    Path(marks, str(worker)).touch()
                stored += newly
    except ServerError as exc:
        ended_by = exc.code.name
    except RequestTimeoutError:
        ended_by = "timeout"
    except ClientError as exc:
        ended_by = f"client error: {exc}"
    return {"stored": stored, "batches": batches, "ended_by": ended_by}


def job_vanish_holding_locks(url: str, tag: str, count: int) -> None:
    """Take read locks (LOOKUP) and a write reservation, then die without a word."""
    client = Client(url, timeout=30)
    keys = make_keys(tag, count)
    if client.lookup(keys) != count:
        raise AssertionError("the chunks to lock are not stored")
    client._call(StoreReserve(0, "", make_keys(tag + "/unfinished", 2), [4096, 4096]), StoreReserveReply)
    os._exit(0)


def job_force_clear_and_store(url: str, tag: str, count: int, size: int) -> tuple[int, int]:
    """Another tenant: clear L1 by force, then store new chunks; returns (cleared, stored)."""
    with Client(url, timeout=30) as client:
        cleared = client.clear(force=True)
        return cleared, client.store(make_keys(tag, count), make_payloads(tag, count, size))
