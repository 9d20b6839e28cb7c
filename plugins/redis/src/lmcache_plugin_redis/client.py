"""redis-py's client for a :class:`RedisConfig`: standalone or cluster, writes without copies.

redis-py packs commands with hiredis when hiredis is installed, and that packer turns every
``memoryview`` argument into ``bytes`` and then joins the whole command into one more
buffer: a 1 MiB payload is copied twice before it reaches the socket.  Its pure-Python
packer sends a ``memoryview`` as a buffer of its own, untouched; the connections built
here use it for every command (on 256 x 1 MiB stores it was ~1.5-2x faster on this
project's 2-core machine).  Replies are parsed by hiredis, except those of a standalone
store's lookups, loads and stores, which go over connections of their own (direct.py;
loads are read straight into their buffers, replies.py); connections speak RESP2 for that.

Retries: a command is retried once at once on a connection error (a pooled connection
that died with a restarted server), so a dead store fails a call within about twice the
connect/request timeouts; the circuit breaker then stops calling it.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import urllib.parse
from typing import Any, ClassVar

from redis import BlockingConnectionPool, Redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.connection import Connection, PythonRespSerializer, SSLConnection, UnixDomainSocketConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from lmcache_plugin_redis.config import RedisConfig

#: arguments longer than this are sent as buffers of their own (redis-py's own cutoff)
BUFFER_CUTOFF = 6000
USERNAME_ENV = "LMCACHE_RESP_USERNAME"
PASSWORD_ENV = "LMCACHE_RESP_PASSWORD"


def encode_argument(value: Any) -> bytes | bytearray | memoryview:
    """A command argument as bytes; buffers pass through (never copied)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value).encode()
    raise TypeError(f"cannot send a {type(value).__name__} to Redis")


class _SendsBuffers:
    """Connections that pack commands with redis-py's buffer-keeping packer, and connect
    no more once their adapter set ``closing`` (see :func:`build_client`): redis-py
    retries a command whose socket ``close`` shut by connecting again, and the call would
    wait on a store that stopped answering for another ``request_timeout``."""

    closing: ClassVar[threading.Event | None] = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("command_packer", PythonRespSerializer(BUFFER_CUTOFF, encode_argument))
        super().__init__(*args, **kwargs)

    def _connect(self) -> Any:
        if self.closing is not None and self.closing.is_set():
            raise RedisConnectionError("the adapter is closing")
        return super()._connect()  # type: ignore[misc]


class BufferConnection(_SendsBuffers, Connection):
    pass


class BufferSSLConnection(_SendsBuffers, SSLConnection):
    pass


class BufferUnixConnection(_SendsBuffers, UnixDomainSocketConnection):
    pass


def pool_size(config: RedisConfig) -> int:
    """Connections per node: every worker of the three kinds, deletes, probes, listings."""
    return config.pool_size or 3 * config.num_workers + 8


def _credentials(config: RedisConfig) -> dict[str, str]:
    found = {
        "username": config.username or os.environ.get(USERNAME_ENV, ""),
        "password": config.password or os.environ.get(PASSWORD_ENV, ""),
    }
    return {name: value for name, value in found.items() if value}


def _uses_tls(config: RedisConfig) -> bool:
    return config.tls_enable or (config.url or "").startswith("rediss:")


def describe(config: RedisConfig) -> str:
    """Where the adapter connects, for logs: never with credentials."""
    if config.url is not None and config.url.startswith("unix:"):
        return f"unix:{urllib.parse.urlsplit(config.url).path}"
    seeds = config.seed_nodes() if config.cluster_mode else config.seed_nodes()[:1]
    nodes = ",".join(f"{host}:{port}" for host, port in seeds)
    scheme = "rediss" if _uses_tls(config) else "redis"
    return f"{scheme}://{nodes}" + (" (cluster)" if config.cluster_mode else "")


#: longest the plain-text check of a TLS store waits for a connection and for its answer
_PLAIN_CHECK_S = 2.0


def plain_text_node(config: RedisConfig) -> str | None:
    """``host:port`` of a node the config reaches over TLS (``rediss://``, ``tls_enable``)
    that answers a plain-text ``PING`` with a RESP reply, i.e. speaks no TLS; None when
    none does, or the config uses no TLS.  Such a node takes the connection and then
    waits for a command while the client waits for the TLS handshake: every connection
    ends in a timeout, which would read as a store that does not answer."""
    if not _uses_tls(config) or (config.url or "").startswith("unix:"):
        return None
    seeds = config.seed_nodes() if config.cluster_mode else config.seed_nodes()[:1]
    for host, port in seeds:
        try:
            with socket.create_connection((host, port), timeout=_PLAIN_CHECK_S) as probe:
                probe.sendall(b"PING\r\n")
                answer = probe.recv(64)
        except OSError:
            continue
        # A TLS server answers a plain-text line with an alert record (0x15) or closes.
        if answer[:1] in (b"+", b"-"):
            return f"{host}:{port}"
    return None


def tls_only_node(config: RedisConfig) -> str | None:
    """``host:port`` of a node the config reaches without TLS that completes a TLS
    handshake, i.e. speaks TLS only; None when none does, or the config uses TLS.  Such a
    node resets a plain-text connection, which would read as a store that does not answer."""
    if _uses_tls(config) or (config.url or "").startswith("unix:"):
        return None
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # only whether it speaks TLS at all is asked
    seeds = config.seed_nodes() if config.cluster_mode else config.seed_nodes()[:1]
    for host, port in seeds:
        try:
            with (
                socket.create_connection((host, port), timeout=_PLAIN_CHECK_S) as probe,
                context.wrap_socket(probe, server_hostname=host),
            ):
                return f"{host}:{port}"
        except (OSError, ValueError):
            continue
    return None


def certificate_refusal(error: BaseException) -> str | None:
    """Why the store's TLS certificate was not accepted, when that is what ``error`` (or
    an error it came from) says; None otherwise.  The store answered: every connection
    would fail the same check until the CA given or the certificate changes."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, ssl.SSLCertVerificationError):
            return current.verify_message or str(current)
        if "CERTIFICATE_VERIFY_FAILED" in str(current):  # redis-py keeps only the text
            return str(current).partition("certificate verify failed: ")[2].split(" (_ssl")[0] or str(current)
        current = current.__cause__ or current.__context__
    return None


def ignored_nodes(config: RedisConfig) -> list[str]:
    """The ``startup_nodes`` a standalone client never talks to: it connects to the first
    alone (no failover to the others, no sharding over them); none in cluster mode."""
    if config.cluster_mode or config.startup_nodes is None:
        return []
    return [f"{host}:{port}" for host, port in config.seed_nodes()[1:]]


def _url(config: RedisConfig) -> str:
    """The configured url, ``rediss://`` when ``tls_enable`` asks for TLS."""
    url = config.url or ""
    if urllib.parse.urlsplit(url).scheme == "redis" and config.tls_enable:
        return "rediss" + url[len("redis") :]
    return url


def _closable(base: type[Any], closing: threading.Event | None) -> type[Any]:
    """``base`` for one adapter: its connections refuse to connect once ``closing`` is set."""
    return base if closing is None else type(base.__name__, (base,), {"closing": closing})


def build_client(config: RedisConfig, closing: threading.Event | None = None) -> Redis | RedisCluster:
    """A client for the store.  A standalone client connects on first use; a cluster
    client asks the seed nodes for the slot map here, so it raises when none answers.
    Once ``closing`` is set, no connection of it connects again."""
    common: dict[str, Any] = {
        "socket_timeout": config.request_timeout,
        "socket_connect_timeout": config.connection_timeout,
        "retry": Retry(NoBackoff(), 1),
        # RESP2, which backend loads parse themselves (replies.py): no push messages can
        # arrive between replies, and every server version speaks it.
        "protocol": 2,
        **_credentials(config),
    }
    tls = _uses_tls(config)
    if config.cluster_mode:
        # Only the url form lets redis-py's cluster client take a connection class.  A
        # configured url is passed as it is: its credentials and options (ssl_ca_certs, ...)
        # reach every node's connections.
        seeds = config.seed_nodes()
        host, port = seeds[0]
        return RedisCluster.from_url(
            _url(config) if config.url is not None else f"{'rediss' if tls else 'redis'}://{host}:{port}",
            startup_nodes=[ClusterNode(node, number) for node, number in seeds],
            connection_class=_closable(BufferSSLConnection if tls else BufferConnection, closing),
            max_connections=pool_size(config),
            **common,
        )
    pool_options = {"max_connections": pool_size(config), "timeout": config.connection_timeout, **common}
    if config.database_id is not None:
        pool_options["db"] = config.database_id
    if config.url is not None:
        url = _url(config)
        scheme = urllib.parse.urlsplit(url).scheme
        connection_class = {"rediss": BufferSSLConnection, "unix": BufferUnixConnection}.get(
            scheme, BufferConnection
        )
        connection_class = _closable(connection_class, closing)
        pool = BlockingConnectionPool.from_url(url, connection_class=connection_class, **pool_options)
    else:
        host, port = config.seed_nodes()[0]
        pool = BlockingConnectionPool(
            connection_class=_closable(BufferSSLConnection if tls else BufferConnection, closing),
            host=host,
            port=port,
            **pool_options,
        )
    return Redis(connection_pool=pool)
