"""A Mooncake cluster on loopback, for tests, benchmarks and trying the adapter out.

``LocalCluster`` runs ``mooncake_master`` (with its HTTP metadata server) and, optionally,
``mooncake_client`` lending memory to the pool -- the binaries of the installed
``mooncake`` wheel -- on free ports of 127.0.0.1, and gives the adapter settings that
reach them.  The master can be killed and started again on the same ports (objects do not
survive a master restart; clients reconnect by themselves), and a segment host killed as
a crash would kill it (its objects are lost once the master drops its segment).

``unavailable_reason()`` says why the wheel cannot run here (not installed, a system
library missing), for tests to skip with; ``NotedCalls`` wraps a client to tell which of
its methods a path calls.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_tiers.plugin import free_port, free_ports

__all__ = ["LocalCluster", "NotedCalls", "free_port", "free_ports", "unavailable_reason"]

logger = logging.getLogger(__name__)

#: how long the master and a segment host get to start listening
START_TIMEOUT_S = 30.0


class NotedCalls:
    """A Mooncake client that notes in ``called`` the name of every method called on it."""

    def __init__(self, store: Any, called: list[str]) -> None:
        self.store, self.called = store, called

    def __getattr__(self, attribute: str) -> Any:
        self.called.append(attribute)
        return getattr(self.store, attribute)


def _package_dir() -> Path | None:
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def unavailable_reason() -> str | None:
    """None when the Mooncake client and binaries work here; else what is missing."""
    directory = _package_dir()
    if directory is None:
        return "the mooncake package is not installed (pip install 'lmcache-plugin-mooncake[non-cuda]')"
    for binary in ("mooncake_master", "mooncake_client"):
        if not (directory / binary).is_file():
            return f"{directory / binary} is missing from the mooncake wheel"
    probe = subprocess.run(
        [sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        return f"`python -c 'import mooncake.store'` fails: {last}"
    return None


def _wait_listening(port: int, proc: subprocess.Popen[bytes], what: str, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{what} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not listen on {port} within {START_TIMEOUT_S}s") from None
            time.sleep(0.05)


def _end(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after 10 s, and reap it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class LocalCluster:
    """A master (and segment hosts) on loopback; ``start()`` first, ``stop()`` at the end."""

    log_dir: Path
    #: 0: a free port, different from the other two
    rpc_port: int = 0
    metadata_port: int = 0
    metrics_port: int = 0
    #: extra ``mooncake_master`` flags, e.g. ``["--default_kv_lease_ttl=100"]``
    master_flags: list[str] = field(default_factory=list)
    master: subprocess.Popen[bytes] | None = None
    segment_hosts: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def __post_init__(self) -> None:
        ports = iter(free_ports(3))
        self.rpc_port = self.rpc_port or next(ports)
        self.metadata_port = self.metadata_port or next(ports)
        self.metrics_port = self.metrics_port or next(ports)

    @property
    def master_server_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def adapter(self, **fields: Any) -> dict[str, Any]:
        """A ``--l2-adapter`` object for this cluster (fields override the defaults)."""
        return {
            "type": "mooncake_store",
            "local_hostname": "127.0.0.1",
            "metadata_server": self.metadata_server,
            "master_server_address": self.master_server_address,
            "master_metrics_url": self.metrics_url,
            "global_segment_size": 0,
            **fields,
        }

    @staticmethod
    def environment() -> dict[str, str]:
        """Environment for processes joining the cluster: Mooncake's TCP transport given the
        loopback address (its listening ports are still bound to all interfaces by the
        0.3.13 wheel)."""
        return {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}

    def _binary(self, name: str) -> str:
        directory = _package_dir()
        path = None if directory is None else directory / name
        if path is None or not path.is_file():
            found = shutil.which(name)
            if found is None:
                raise RuntimeError(f"{name} not found: {unavailable_reason()}")
            return found
        return str(path)

    def start(self) -> LocalCluster:
        self.start_master()
        return self

    def start_master(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / "master.log"
        args = [
            self._binary("mooncake_master"),
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            *self.master_flags,
        ]
        with log.open("ab") as out:
            self.master = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=self.environment())
        for port in (self.rpc_port, self.metadata_port, self.metrics_port):
            _wait_listening(port, self.master, "mooncake_master", log)

    def kill_master(self) -> None:
        """SIGKILL the master (no clean shutdown), as a crash would."""
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGKILL)
            self.master.wait(30)
        self.master = None

    def kill_segment_host(self, host: subprocess.Popen[bytes]) -> None:
        """SIGKILL segment host ``host`` (no clean unmount), as a crash would; the master
        drops its segment, and the objects in it, once the host's heartbeats stop."""
        if host.poll() is None:
            host.send_signal(signal.SIGKILL)
            host.wait(30)
        self.segment_hosts.remove(host)

    def add_segment_host(self, size: str = "256MB") -> subprocess.Popen[bytes]:
        """Start a ``mooncake_client`` lending ``size`` of memory to the pool.

        ``mooncake_client`` gives its first call to the master one second and one retry,
        then aborts; a master that has just started (or a loaded machine) may not answer
        that soon although it listens, so a host that ends during its start-up is started
        again until ``START_TIMEOUT_S`` has passed."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for attempt in itertools.count(1):
            port = free_port()
            log = self.log_dir / f"segment-host-{port}.log"
            args = [
                self._binary("mooncake_client"),
                "--host=127.0.0.1",
                f"--port={port}",
                f"--global_segment_size={size}",
                f"--master_server_address={self.master_server_address}",
                f"--metadata_server={self.metadata_server}",
            ]
            with log.open("ab") as out:
                host = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=self.environment())
            try:
                _wait_listening(port, host, "mooncake_client", log)
                break
            except RuntimeError:
                if host.poll() is None or time.monotonic() > deadline:
                    _end(host)
                    raise
                logger.warning(
                    "mooncake_client on port %d ended during start-up (attempt %d); starting another",
                    port,
                    attempt,
                )
                time.sleep(0.2)
        self.segment_hosts.append(host)
        self.wait_for_segments(len(self.segment_hosts))
        return host

    def segments(self) -> list[str]:
        with urllib.request.urlopen(self.metrics_url + "/get_all_segments", timeout=5) as response:
            return [line for line in response.read().decode().split() if line]

    def wait_for_segments(self, count: int, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until the master lists at least ``count`` segments (they mount a moment
        after the client starts listening, and again after a master restart)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if len(self.segments()) >= count:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the master did not list {count} segments within {timeout}s")
            time.sleep(0.1)

    def keys(self) -> list[str]:
        with urllib.request.urlopen(self.metrics_url + "/get_all_keys", timeout=5) as response:
            return [line for line in response.read().decode().split("\n") if line]

    def stop(self) -> None:
        for proc in [*self.segment_hosts, *([self.master] if self.master is not None else [])]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*self.segment_hosts, *([self.master] if self.master is not None else [])]:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.segment_hosts.clear()
        self.master = None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
