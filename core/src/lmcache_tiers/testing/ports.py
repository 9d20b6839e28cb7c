"""Free loopback ports for servers that tests and benchmarks start."""

from __future__ import annotations

import socket

__all__ = ["free_port", "free_ports"]


def free_port() -> int:
    """A loopback TCP port nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` different loopback TCP ports nothing listens on right now.

    The probes stay bound until every port is taken: ports probed one after the other can
    come out equal, since a closed probe's port may be handed out again (a server given one
    port twice fails to start).
    """
    probes = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()
