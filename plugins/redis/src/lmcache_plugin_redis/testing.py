"""Real ``redis-server`` processes on loopback, for tests and benchmarks.

``redis-server`` comes from the Debian package of the same name (``apt-get install -y
redis-server``); :func:`missing_reason` says why tests must skip when it is absent.
Servers run without persistence (``--save '' --appendonly no``) on free ports, in a
directory of their own, and are killed when stopped.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from lmcache_tiers.plugin import free_port as any_free_port
from lmcache_tiers.plugin import free_ports as any_free_ports

START_TIMEOUT_S = 30.0


def missing_reason() -> str | None:
    """Why a real Redis cannot be started here, or None when it can."""
    for binary in ("redis-server", "redis-cli"):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (apt-get install -y redis-server)"
    return None


#: how long a cluster node may not answer before the others declare it failed.  The
#: test clusters have no replicas, so a primary declared failed is never replaced: every
#: node then answers CLUSTERDOWN to every command, its keys or not, for seconds after it
#: answers again.  Tests pause a node (SIGSTOP) to see its keys alone fail; on a loaded
#: machine such a pause outlasted a short timeout, and the other nodes' keys failed too.
CLUSTER_NODE_TIMEOUT_MS = 120_000
#: a cluster node also listens on its port + this, for the cluster bus
BUS_PORT_OFFSET = 10000
#: the hash slots of a Redis Cluster
CLUSTER_SLOTS = 16384


def free_port(*, cluster: bool = False) -> int:
    """A free loopback port; for a cluster node one whose bus port is free too."""
    return cluster_ports(1)[0] if cluster else any_free_port()


def cluster_ports(count: int) -> list[int]:
    """``count`` different free ports for cluster nodes, each with its bus port free and
    handed out too (so no node's port is another's bus port)."""
    return any_free_ports(count, partner_offset=BUS_PORT_OFFSET)


class RedisServer:
    """One ``redis-server`` on 127.0.0.1; ``stop`` and ``start`` again keep its port."""

    def __init__(
        self,
        directory: Path,
        *,
        port: int | None = None,
        cluster: bool = False,
        password: str | None = None,
        extra: list[str] | None = None,
    ) -> None:
        self.directory = directory
        self.port = port or free_port(cluster=cluster)
        self.cluster = cluster
        self.password = password
        self.extra = list(extra or [])
        self.proc: subprocess.Popen[bytes] | None = None
        directory.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        args = [
            "redis-server",
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--dir", str(self.directory), "--logfile", str(self.directory / "redis.log")]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.directory / "nodes.conf")]
            args += ["--cluster-node-timeout", str(CLUSTER_NODE_TIMEOUT_MS)]
        if self.password is not None:
            args += ["--requirepass", self.password]
        return args + self.extra

    def start(self) -> RedisServer:
        self.spawn()
        self.wait_answers()
        return self

    def spawn(self) -> None:
        """Start the process without waiting for it (see :meth:`wait_answers`)."""
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def wait_answers(self) -> None:
        """Return once the spawned server answers PING; stopped and raising if it exits or
        does not answer in time."""
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer within {START_TIMEOUT_S} s: {self.log()}")
            time.sleep(0.02)

    def answers(self) -> bool:
        result = self.cli("PING", check=False, timeout=5.0)
        return result.returncode == 0 and result.stdout.strip() == "PONG"

    def cli(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port), "--no-auth-warning", *args],
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            # the password travels in the environment, never on a command line others can read
            env={**os.environ, "REDISCLI_AUTH": self.password} if self.password else None,
        )

    def log(self) -> str:
        path = self.directory / "redis.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def stop(self, sig: int = signal.SIGKILL) -> None:
        """Kill the server (SIGKILL by default: what a crash looks like to clients)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a paused server cannot act on SIGTERM
            proc.send_signal(sig)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung store)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


class RedisClusterNodes:
    """A Redis Cluster of ``count`` primaries (no replicas) on loopback."""

    def __init__(self, directory: Path, count: int = 3, *, password: str | None = None) -> None:
        self.nodes = [
            RedisServer(directory / f"node-{index}", port=port, cluster=True, password=password)
            for index, port in enumerate(cluster_ports(count))
        ]

    @property
    def startup_nodes(self) -> str:
        return ",".join(node.address for node in self.nodes)

    def start(self) -> RedisClusterNodes:
        """Start the nodes, split the slots evenly among them, and return once every node
        serves the whole slot map.

        The nodes are started together and joined by hand: ``--cluster create`` polls
        the join once a second.  A new primary reports ``cluster_state:ok`` no sooner than
        2 s after it started (Redis's writable delay), which the join overlaps."""
        try:
            for node in self.nodes:
                node.spawn()
            for node in self.nodes:
                node.wait_answers()
            self._join()
            deadline = time.monotonic() + START_TIMEOUT_S
            while not all(self._serves_everything(node) for node in self.nodes):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster never reported cluster_state:ok")
                time.sleep(0.05)
        except BaseException:
            self.stop()
            raise
        return self

    def _join(self) -> None:
        count = len(self.nodes)
        for index, node in enumerate(self.nodes):
            first, last = index * CLUSTER_SLOTS // count, (index + 1) * CLUSTER_SLOTS // count - 1
            # ADDSLOTS, not ADDSLOTSRANGE: that one is Redis 7's only
            node.cli("CLUSTER", "ADDSLOTS", *(str(slot) for slot in range(first, last + 1)))
            # distinct epochs (as --cluster create sets them): no collision left to settle
            node.cli("CLUSTER", "SET-CONFIG-EPOCH", str(index + 1))
        # Every pair meets directly: one node introduced to another by gossip alone can
        # take seconds to be known (and the cluster to be whole).
        for index, node in enumerate(self.nodes):
            for other in self.nodes[index + 1 :]:
                node.cli("CLUSTER", "MEET", "127.0.0.1", str(other.port))

    def _serves_everything(self, node: RedisServer) -> bool:
        info = node.cli("CLUSTER", "INFO").stdout
        return all(
            fact in info
            for fact in (
                "cluster_state:ok",
                f"cluster_slots_ok:{CLUSTER_SLOTS}",
                f"cluster_known_nodes:{len(self.nodes)}",
            )
        )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
