"""Endpoint rules shared by the CLI and the server: what counts as loopback, what to bind."""

from __future__ import annotations

import ipaddress
import socket

from lmcache_tiers.errors import ConfigError


def is_loopback(host: str) -> bool:
    """True for ipc:// endpoints and loopback names/addresses (never for a wildcard)."""
    if host.startswith("ipc://") or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def rpc_endpoint(host: str, port: int) -> str:
    """The ZeroMQ endpoint to bind: ``host`` may itself be an ``ipc://`` path; port 0 picks
    a free port."""
    if host.startswith("ipc://"):
        return host
    if "://" in host:
        raise ConfigError(f"host {host!r}: give an address or name, or an ipc:// endpoint")
    if host == "localhost":
        host = "127.0.0.1"  # libzmq binds interfaces and addresses, not host names
    bracketed = f"[{host.strip('[]')}]" if ":" in host else host
    return f"tcp://{bracketed}:{port if port else '*'}"
