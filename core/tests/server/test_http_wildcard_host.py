"""``--metrics-host '*'`` binds every address, as ``--host '*'`` does for a front end and as
the start-up pre-flight probes it: the pre-flight passed it, L1 was pre-faulted, and then
the real bind failed ("cannot listen on *:9090: Name or service not known"), naming the
port as the setting to change."""

from __future__ import annotations

import http.client

from lmcache_tiers.server.http import HttpEndpoint
from lmcache_tiers.server.preflight import check_listeners
from lmcache_tiers.testing.ports import free_ports


def test_a_wildcard_host_binds_every_address() -> None:
    endpoint = HttpEndpoint(
        "*", 0, metrics=bytes, status=dict, health=lambda: (True, "ok"), status_token="token"
    )
    try:
        endpoint.start()
        port = int(endpoint.url.rsplit(":", 1)[1])
        assert endpoint.url == f"http://0.0.0.0:{port}"
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request("GET", "/healthz")
            reply = connection.getresponse()
            assert (reply.status, reply.read()) == (200, b"ok\n")
        finally:
            connection.close()
    finally:
        endpoint.stop()


def test_the_preflight_and_the_bind_read_the_wildcard_alike() -> None:
    """What the pre-flight lets through binds: the same free port, probed then served."""
    from lmcache_tiers.config import ServerConfig

    (port,) = free_ports(1)
    check_listeners(ServerConfig(metrics_host="*", metrics_port=port, auth_token="token"))
    endpoint = HttpEndpoint("*", port, metrics=bytes, status=dict, health=lambda: (True, "ok"))
    endpoint.stop()
