"""Endpoint rules shared by the CLI, the client and the server: what counts as loopback,
what to bind, what a client can connect to."""

from __future__ import annotations

import ipaddress
import re
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
        # UnicodeError: a label the IDNA codec refuses (empty, over 63 characters);
        # TypeError: a NUL.  Either way no address: not loopback.
        except (OSError, UnicodeError, TypeError):
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


_PORT = re.compile(r"[0-9]{1,5}")


def check_server_url(url: str) -> str:
    """``url`` when a client can connect to it: ``tcp://host:port`` (an IPv6 address in
    brackets, a port of 1-65535) or ``ipc://path``; ConfigError saying what is wrong otherwise."""
    scheme, separator, rest = url.partition("://")
    if not separator or scheme not in ("tcp", "ipc"):
        raise ConfigError(f"{url!r} is not a server endpoint: give tcp://host:port or ipc://path")
    if scheme == "ipc":
        if not rest:
            raise ConfigError(f"{url!r} names no socket: give ipc://path")
        return url
    host, colon, port = rest.rpartition(":")
    if not colon or not host or any(char.isspace() or char == "/" for char in rest):
        raise ConfigError(f"{url!r} is not a server endpoint: give tcp://host:port")
    if not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise ConfigError(f"{url!r}: the port must be a number from 1 to 65535, got {port!r}")
    if host.startswith("[") or host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1] if host.startswith("[") and host.endswith("]") else "")
        except ValueError:
            raise ConfigError(f"{url!r}: {host} is not an IPv6 address in brackets") from None
    elif ":" in host:
        raise ConfigError(f"{url!r}: write an IPv6 address in brackets: tcp://[{host}]:{port}")
    return url
