"""The HTTP endpoint: loopback unless told otherwise, /status behind the token beyond it, and
nothing that identifies the process or its files in /metrics or /healthz."""

from __future__ import annotations

import fcntl
import ipaddress
import json
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from tiers_e2e import LAUNCHER, ServerProcess, fetch, make_keys, make_payloads, metric, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.testing.ports import free_ports

TOKEN = "http-test-token"
_SIOCGIFADDR = 0x8915


def non_loopback_address() -> str | None:
    """An IPv4 address of this host outside 127/8, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on this interface
            address = socket.inet_ntoa(packed[20:24])
            if not ipaddress.ip_address(address).is_loopback:
                return address
    return None


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_http_stays_on_loopback_when_the_rpc_host_is_not(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", host="0.0.0.0", auth_token=TOKEN)
    try:
        assert server.http_url is not None
        port = int(server.http_url.rsplit(":", 1)[1])
        status, _, body = fetch(f"{server.http_url}/status")
        assert status == 200  # loopback only: no token needed
        assert json.loads(body)["server"]["http"] == f"http://127.0.0.1:{port}"
        outside = non_loopback_address()
        if outside is None:
            print("no non-loopback IPv4 address on this host: reachability from outside not checked")
        else:
            assert not reachable(outside, port), f"HTTP answers on {outside}"
            with Client(f"tcp://{outside}:{server.url.rsplit(':', 1)[1]}", auth_token=TOKEN) as client:
                assert client.ping() > 0  # while the RPC endpoint does serve there
    finally:
        assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def public_http(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """One server for the tests that read its HTTP routes (none depends on what another
    did to it: refused requests, four keys stored)."""
    server = start_server(
        tmp_path_factory.mktemp("public-http") / "server",
        adapters=[{"type": "mock", "max_size_gb": 0.1}],
        metrics_host="0.0.0.0",
        auth_token=TOKEN,
    )
    yield server
    assert server.stop() == 0, server.output()


def test_off_loopback_status_needs_the_token(public_http: ServerProcess) -> None:
    url = f"{public_http.http_url}/status"
    assert fetch(url)[0] == 401
    assert fetch(url, {"Authorization": "Bearer wrong"})[0] == 401
    assert fetch(url, {"Authorization": TOKEN})[0] == 401  # the scheme is part of it
    status, content_type, body = fetch(url, {"Authorization": f"Bearer {TOKEN}"})
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body)["server"]["auth_required"] is True
    assert fetch(f"{public_http.http_url}/metrics")[0] == 200
    assert fetch(f"{public_http.http_url}/healthz")[0] == 200


def test_metrics_and_health_expose_no_process_or_file_names(public_http: ServerProcess) -> None:
    with Client(public_http.url, auth_token=TOKEN) as client:
        keys = make_keys("anonymous", 4)
        client.store(keys, make_payloads("anonymous", 4, 8192))
        assert client.lookup(keys) == 4
        client.release(keys)
    pid = str(public_http.proc.pid)
    secrets = [public_http.shm_name, str(public_http.log_dir), "/dev/shm", TOKEN]
    for route in ("/metrics", "/healthz"):
        status, _, text = fetch(f"{public_http.http_url}{route}")
        assert status == 200
        for secret in secrets:
            assert secret not in text, f"{route} shows {secret!r}"
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            assert "pid" not in name and "path" not in name, line
            assert "/" not in labels and pid not in labels, line
            assert value != pid, line


def test_off_loopback_http_without_a_token_is_refused(tmp_path: Path) -> None:
    port, metrics_port = free_ports(2)
    config = {"port": port, "metrics_port": metrics_port, "metrics_host": "0.0.0.0", "l1_size_gb": 0.01}
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_TIERS_AUTH_TOKEN"}
    result = subprocess.run(
        [sys.executable, str(LAUNCHER), json.dumps({"config": config}), str(tmp_path / "ready")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert "requires --auth-token" in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_the_metrics_host_flag_reaches_the_configuration() -> None:
    command = [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--no-default-l2", "--print-config"]
    shown = subprocess.run([*command, "--metrics-host", "::1"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["metrics_host"] == "::1"
    default = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert json.loads(default.stdout)["metrics_host"] == "127.0.0.1"


def send_raw(port: int, request: bytes) -> bytes:
    """``request`` as bytes on a connection of its own; what the server answered before it closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(request)
        answer = b""
        while chunk := connection.recv(1 << 16):
            answer += chunk
    return answer


def test_requests_the_endpoint_refuses_are_counted_and_logged(tmp_path: Path) -> None:
    """A request it cannot parse, with header lines too long or too many, in an HTTP version
    or with a method it does not speak, or with a method the routes do not allow: each is
    answered, then counted in /metrics and logged, as any other refusal."""
    server = start_server(tmp_path / "server")
    try:
        assert server.http_url is not None
        port = int(server.http_url.rsplit(":", 1)[1])
        malformed = [
            b"\x00\x01\x02\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70000 + b"\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\n" + b"".join(b"X%d: a\r\n" % i for i in range(200)) + b"\r\n",
            b"GET /metrics HTTP/2.0\r\n\r\n",
            b"BREW /metrics HTTP/1.1\r\n\r\n",
        ]
        for request in malformed:
            assert send_raw(port, request), request[:40]
        assert b" 405 " in send_raw(port, b"DELETE /metrics HTTP/1.1\r\n\r\n")
        _, _, text = fetch(f"{server.http_url}/metrics")
        assert metric(text, "lmcache_tiers_failures_total", 'reason="http_request_malformed"') == 5
        assert metric(text, "lmcache_tiers_failures_total", 'reason="http_method_not_allowed"') == 1
    finally:
        assert server.stop() == 0, server.output()
    log = server.output()
    assert "refused with 400" in log and "DELETE '/metrics'" in log, log
