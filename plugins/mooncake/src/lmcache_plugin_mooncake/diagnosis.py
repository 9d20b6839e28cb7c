"""Which service a failed Mooncake set-up could not use, named by its config field.

Mooncake's set-up answers ``-1`` whether the master does not answer, the metadata server
does not, or ``master_server_address`` is some other service's port; its own log lines
say which, among many others.  After such a failure the adapter asks each service
itself, so that its warning names the field to check.
"""

from __future__ import annotations

import http.client
import re
import socket
import urllib.error
import urllib.parse
import urllib.request

from lmcache_plugin_mooncake.config import MooncakeStoreConfig

__all__ = ["segment_name_holder", "unanswered_services", "unreachable_service"]

#: the key asked of the metadata server (never stored)
_PROBE_KEY = "lmcache-tiers-setup-probe"
#: one endpoint of a metadata service written as ``host:port`` (an IPv6 host in brackets)
_ENDPOINT = re.compile(
    r"(?:(?:etcd|redis)://)?(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._-]+)):(?P<port>\d{1,5})"
)


def unanswered_services(config: MooncakeStoreConfig, timeout_s: float) -> str:
    """What failed set-up's services say when asked, each named by its field: those that
    do not answer as they should, or that both do (then the cause is in Mooncake's log)."""
    problems = [
        problem
        for problem in (
            _master_problem(config.master_server_address, timeout_s),
            _metadata_problem(config, timeout_s),
        )
        if problem is not None
    ]
    if problems:
        return "; ".join(problems)
    return (
        f"master_server_address {config.master_server_address} and metadata_server "
        f"{config.metadata_server} both accept connections (Mooncake's log says more)"
    )


def unreachable_service(config: MooncakeStoreConfig, timeout_s: float) -> str | None:
    """The service a set-up needs that refuses or drops a connection, named by its field;
    None when both take one.  Asked before each set-up: Mooncake's binding holds the GIL
    for the whole set-up, about 4.5 s against a master that is down, which stalls every
    thread of the process."""
    host, port = _split(config.master_server_address)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as exc:
        return f"master_server_address {config.master_server_address} does not answer ({_reason(exc)})"
    return _metadata_problem(config, timeout_s, answered_only=True)


def segment_name_holder(config: MooncakeStoreConfig, timeout_s: float) -> str | None:
    """Why ``local_hostname`` cannot be set up because another Mooncake client holds it,
    or None when it does not or that cannot be told.  Mooncake names a client's segment
    after ``local_hostname``, adding a free port of its own unless the value ends in one;
    a name with a port is used as is, and a second client under it (another server with
    this config, or this one started again within seconds of a crash, before the master
    drops the old one) was refused with -600, the answer to a segment it cannot allocate,
    after removing the holder's entry from the metadata server.  That HTTP server holds
    each live client's name (Mooncake's ``rpc_meta`` key), so it is asked before the
    set-up when the name has a port; other metadata services are not asked."""
    name = config.local_hostname
    if re.fullmatch(r"(?:\[[^\]]*\]|[^:\[\]]*):\d+", name) is None:
        return None
    url = config.metadata_server
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return None
    separator = "&" if "?" in url else "?"
    key = urllib.parse.quote(f"mooncake/rpc_meta/{name}", safe="")
    try:
        with urllib.request.urlopen(f"{url}{separator}key={key}", timeout=timeout_s):
            pass
    except (OSError, http.client.HTTPException):  # 404 (an HTTPError) included: the name is free
        return None
    return (
        f"local_hostname {name!r}: another Mooncake client holds this name (a value ending in a "
        "port is this server's segment name as is, and Mooncake refuses a second client under "
        "it; a run of this server that ended without closing holds it for a few seconds); give "
        "each server its own, or leave the port out and Mooncake picks a free one"
    )


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _master_problem(address: str, timeout_s: float) -> str | None:
    """Why ``address`` is not a master's RPC port, or None if it may be one."""
    host, port = _split(address)
    try:
        connection = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        return f"master_server_address {address} does not answer ({_reason(exc)})"
    connection.close()
    # The RPC port closes a connection that sends it HTTP; an HTTP server (the master's
    # metadata or metrics port, given by mistake) answers it.
    probe = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        probe.request("GET", "/")
        status = probe.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        probe.close()
    return (
        f"master_server_address {address} is an HTTP server (it answered {status}), not "
        "mooncake_master's RPC port (--rpc_port)"
    )


def _metadata_problem(
    config: MooncakeStoreConfig, timeout_s: float, answered_only: bool = False
) -> str | None:
    """Why the HTTP metadata server does not serve, or None if it answers; a metadata
    service written as ``host:port`` (etcd's form, or ``etcd://``/``redis://`` with one)
    is asked only whether any of its endpoints takes a connection, and one of another
    form (``P2PHANDSHAKE``) not at all.  ``answered_only``: None for any answer, HTTP or
    not."""
    url = config.metadata_server
    if urllib.parse.urlsplit(url).scheme not in ("http", "https"):
        return _endpoints_problem(url, timeout_s)
    separator = "&" if "?" in url else "?"
    try:
        with urllib.request.urlopen(f"{url}{separator}key={_PROBE_KEY}", timeout=timeout_s):
            return None
    except urllib.error.HTTPError as exc:
        if answered_only:
            return None  # it answered: the set-up may be tried
        # Mooncake's metadata servers (the master's and its Python one) answer an unknown
        # key with 404 "metadata not found"; any other answer is another server's (the
        # master's metrics port, a wrong path), where Mooncake's set-up fails with -1.
        try:
            body = exc.read(256)
        except (OSError, http.client.HTTPException):
            body = b""
        if exc.code == 404 and body.strip() == b"metadata not found":
            return None
        answer = body.decode("utf-8", "replace").strip()[:60]
        return (
            f"metadata_server {url} answers HTTP but is not Mooncake's metadata server (a key query "
            f"was answered {exc.code} {answer!r}, where Mooncake's says 'metadata not found'): check "
            "its port (mooncake_master --http_metadata_server_port) and path (/metadata)"
        )
    except urllib.error.URLError as exc:
        reason = exc.reason if isinstance(exc.reason, BaseException) else OSError(str(exc.reason))
        return f"metadata_server {url} does not answer ({_reason(reason)})"
    except TimeoutError as exc:  # a hung server: neither answered nor refused
        return f"metadata_server {url} does not answer ({_reason(exc)})"
    except (OSError, http.client.HTTPException) as exc:
        if answered_only:
            return None
        return f"metadata_server {url} does not answer as an HTTP metadata server ({_reason(exc)})"


def _endpoints(service: str) -> list[tuple[str, int]]:
    """The ``host:port`` endpoints a metadata service string names (several separated by
    ``,`` or ``;``, each perhaps behind ``etcd://`` or ``redis://``); none when any part
    is of another form, whose connections only Mooncake knows how to make."""
    found = []
    for part in re.split(r"[,;]", service):
        match = _ENDPOINT.fullmatch(part.strip())
        if match is None or not 0 < int(match["port"]) < 65536:
            return []
        found.append((match["v6"] or match["name"], int(match["port"])))
    return found


def _endpoints_problem(service: str, timeout_s: float) -> str | None:
    """Why no endpoint of a ``host:port`` metadata service takes a connection, or None
    when one does (or the service is of another form).  Mooncake's set-up against an etcd
    that does not answer holds the GIL for ~10 s: asked first, like the master."""
    endpoints = _endpoints(service)
    failures = []
    for host, port in endpoints:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
        except OSError as exc:
            failures.append(_reason(exc))
            continue
        return None
    if not failures:
        return None
    return f"metadata_server {service} does not answer ({'; '.join(sorted(set(failures)))})"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "no answer in time"
    if isinstance(exc, socket.gaierror):
        return f"unknown host: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
