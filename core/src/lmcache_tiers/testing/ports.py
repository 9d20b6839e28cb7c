"""Loopback ports for servers that tests and benchmarks start.

A port found free by binding port 0 and closing the probe is a port of the kernel's
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), and closed it is free for
anyone: the kernel may make it the local port of a connection any process opens (every
client connect picks one), or hand it to another process's probe, before the server meant
for it binds it -- which then fails with "Address already in use".

A port handed out here cannot be taken that way:

* it lies outside the ephemeral range, read when first needed: the kernel picks local
  ports of connections and of sockets bound to port 0 only inside that range;
* it is leased, in a table every process on the machine shares (a file under ``/tmp``,
  read and written under an exclusive ``flock``), to the process it was handed to for
  ``LEASE_S`` seconds: no caller here, in this process or another, hands it out again
  meanwhile -- a test's server may stop and start again on its port;
* nothing is bound to it when it is handed out, on any address, IPv4 or IPv6: a bind
  without ``SO_REUSEADDR`` fails on a port with a listener or a connection on it (one in
  TIME_WAIT included), where servers, binding with ``SO_REUSEADDR``, would succeed.

Each process hands out ports in turn from its own starting point (a pytest-xdist worker
from its share of the range, any other process from one derived from its process id), so
that workers rarely look at the same ports and a port comes round again only after the
whole range has.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["LEASE_S", "PortLeases", "candidate_ports", "ephemeral_range", "free_port", "free_ports"]

#: how long a port handed out stays out of every other hand-out: longer than any test may
#: run (pytest's timeout), so a server that a test stops and starts again keeps its port
LEASE_S = 600
#: below this, fixed ports of common services (databases, web servers, SeaweedFS's and
#: Mooncake's defaults) live; ports are handed out from here up when the machine allows
PORT_FLOOR = 20000
#: the fewest ports worth handing out above PORT_FLOOR; with fewer, from 1024 up
MIN_PORTS = 1000
#: the lease table every process shares: one record per port number
LEASE_TABLE = Path("/tmp/lmcache-tiers-port-leases")
#: the record: the process it was handed to, and when its lease ends (Unix seconds)
_RECORD = struct.Struct("<II")
_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: when the range cannot be read: Linux's default and IANA's dynamic ports together
_ASSUMED_EPHEMERAL = (32768, 65535)


def ephemeral_range(path: Path = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's range of ports for local ends of connections (inclusive)."""
    try:
        low, high = (int(field) for field in path.read_text().split())
    except (OSError, ValueError):
        return _ASSUMED_EPHEMERAL
    return low, high


def candidate_ports(ephemeral: tuple[int, int]) -> list[int]:
    """The ports to hand out: those from PORT_FLOOR up outside ``ephemeral``, or from
    1024 up if the range leaves too few there.  A range covering every port leaves none
    outside it: then its own ports are handed out, guarded from other callers here by the
    leases, no longer from the kernel's choice."""
    low, high = ephemeral
    for floor in (PORT_FLOOR, 1024):
        outside = [port for port in range(floor, 65536) if not low <= port <= high]
        if len(outside) >= MIN_PORTS:
            return outside
    return outside or list(range(PORT_FLOOR, 65536))


def unbound(port: int) -> bool:
    """Whether no socket of this machine has ``port``: listening, connected or in
    TIME_WAIT, on any IPv4 or IPv6 address."""
    for family, wildcard in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here: nothing can listen there either
        with probe:
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((wildcard, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE or family == socket.AF_INET:
                    return False
                # IPv6 switched off: nothing can listen there either
    return True


def _starting_index(count: int) -> int:
    """Where this process starts handing out ports among ``count`` candidates."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if worker.startswith("gw") and worker[2:].isdigit() and workers.isdigit() and int(workers) > 0:
        return count * (int(worker[2:]) % int(workers)) // int(workers)
    # Knuth's multiplicative hash spreads neighbouring process ids over the range.
    return (os.getpid() * 2654435761) % count


class PortLeases:
    """Hands out ``ports`` in turn, each leased in the table at ``table`` for ``lease_s``
    seconds of ``clock``, and skips those leased or bound (see the module docstring)."""

    def __init__(
        self,
        table: Path,
        ports: Sequence[int],
        *,
        lease_s: float = LEASE_S,
        clock: Callable[[], float] = time.time,
        start: int = 0,
    ) -> None:
        if not ports:
            raise ValueError("no ports to hand out")
        self.table = table
        self.ports = list(ports)
        self.lease_s = lease_s
        self.clock = clock
        self._next = start % len(self.ports)
        self._lock = threading.Lock()

    def take(self, count: int, *, partner_offset: int | None = None) -> list[int]:
        """``count`` different ports, leased to this process; with ``partner_offset``,
        each port ``p`` handed out has ``p + partner_offset`` (a candidate too) leased and
        unbound as well, for a server that also listens there (a Redis cluster node's bus).

        Raises OSError (EADDRNOTAVAIL) when every candidate is leased or bound."""
        with self._lock, _LockedTable(self.table) as fd:
            taken: list[int] = []
            allowed = set(self.ports) if partner_offset is not None else set()
            now = self.clock()
            start = self._next
            for step in range(len(self.ports)):
                if len(taken) == count:
                    break
                index = (start + step) % len(self.ports)
                port = self.ports[index]
                group = [port] if partner_offset is None else [port, port + partner_offset]
                if partner_offset is not None and group[1] not in allowed:
                    continue
                if all(self._free(fd, member, now) for member in group):
                    lease = _RECORD.pack(os.getpid(), int(now + self.lease_s) + 1)
                    for member in group:
                        os.pwrite(fd, lease, member * _RECORD.size)
                    taken.append(port)
                    self._next = (index + 1) % len(self.ports)
            if len(taken) < count:
                raise OSError(
                    errno.EADDRNOTAVAIL,
                    f"no {count} loopback ports free and unleased among {len(self.ports)} "
                    f"(leases in {self.table}, {self.lease_s:g} s each)",
                )
            return taken

    def _free(self, fd: int, port: int, now: float) -> bool:
        record = os.pread(fd, _RECORD.size, port * _RECORD.size)
        if len(record) == _RECORD.size:
            _pid, lease_end = _RECORD.unpack(record)
            if lease_end > now:
                return False
        return unbound(port)

    def after_fork(self) -> None:
        """In a forked child: a lock another thread held at the fork stays held there."""
        self._lock = threading.Lock()


class _LockedTable:
    """The lease table's descriptor, under an exclusive ``flock`` while in the ``with``.
    Opened for each hand-out rather than kept: a test counting this process's open files
    sees none left behind."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> int:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            if os.fstat(self.fd).st_uid == os.geteuid():
                os.fchmod(self.fd, 0o666)  # other users' test runs share it (umask aside)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise
        return self.fd

    def __exit__(self, *_exc: object) -> None:
        os.close(self.fd)  # releases the flock


_leases: PortLeases | None = None
_leases_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _leases_lock
    _leases_lock = threading.Lock()
    if _leases is not None:
        _leases.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _process_leases() -> PortLeases:
    global _leases
    with _leases_lock:
        if _leases is None:
            ports = candidate_ports(ephemeral_range())
            _leases = PortLeases(LEASE_TABLE, ports, start=_starting_index(len(ports)))
        return _leases


def free_port() -> int:
    """A loopback TCP port nothing is bound to, that no other process takes meanwhile
    (see the module docstring)."""
    return free_ports(1)[0]


def free_ports(count: int, *, partner_offset: int | None = None) -> list[int]:
    """``count`` different loopback TCP ports as :func:`free_port` hands them out; with
    ``partner_offset``, each port's ``port + partner_offset`` is free and leased too."""
    return _process_leases().take(count, partner_offset=partner_offset)
