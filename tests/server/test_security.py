"""Auth tokens, loopback-only default, ipc:// endpoints and the --no-shm data plane."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tiers_e2e import LAUNCHER, digest, free_port, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.wire.protocol import ErrorCode, StoreReserve, StoreReserveReply


def test_every_request_needs_the_token(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", metrics=False, auth_token="s3cret-token")
    try:
        with pytest.raises(ServerError) as refused:
            Client(server.url, auth_token="", timeout=10)
        assert refused.value.code is ErrorCode.UNAUTHORIZED
        with pytest.raises(ServerError):
            Client(server.url, auth_token="s3cret-tokeN", timeout=10)
        with Client(server.url, auth_token="s3cret-token") as client:
            assert client.store(make_keys("auth", 2), make_payloads("auth", 2, 1000)) == 2
        previous = os.environ.get("LMCACHE_TIERS_AUTH_TOKEN")
        os.environ["LMCACHE_TIERS_AUTH_TOKEN"] = "s3cret-token"
        try:
            with Client(server.url) as client:
                assert client.lookup(make_keys("auth", 2)) == 2
                client.release(make_keys("auth", 2))
        finally:
            if previous is None:
                del os.environ["LMCACHE_TIERS_AUTH_TOKEN"]
            else:
                os.environ["LMCACHE_TIERS_AUTH_TOKEN"] = previous
    finally:
        assert server.stop() == 0, server.output()


def test_binding_off_loopback_without_a_token_is_refused(tmp_path: Path) -> None:
    spec = {"config": {"host": "0.0.0.0", "port": free_port(), "metrics_port": 0, "l1_size_gb": 0.25}}
    env = {k: v for k, v in os.environ.items() if k != "LMCACHE_TIERS_AUTH_TOKEN"}
    result = subprocess.run(
        [sys.executable, str(LAUNCHER), json.dumps(spec), str(tmp_path / "ready")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert "requires --auth-token" in result.stderr
    assert not (tmp_path / "ready").exists()


def test_ipc_endpoint(tmp_path: Path) -> None:
    socket_path = tmp_path / "tiers.sock"
    server = start_server(tmp_path / "server", metrics=False, host=f"ipc://{socket_path}")
    try:
        with Client(server.url) as client:
            assert client.uses_shm
            keys, data = make_keys("ipc", 3), make_payloads("ipc", 3, 10_000)
            assert client.store(keys, data) == 3
            with client.retrieve(keys) as views:
                assert digest(views) == digest(data)
    finally:
        assert server.stop() == 0, server.output()
    assert not socket_path.exists()


def test_an_ipc_socket_only_its_owner_can_connect_to(tmp_path: Path) -> None:
    """Connecting to a Unix socket needs write permission on it: libzmq creates the file
    under the umask (0775 under 002), which would let the group into a server that asks
    no token of ipc:// clients."""
    socket_path = tmp_path / "tiers.sock"
    previous = os.umask(0o002)  # inherited by the server process
    try:
        server = start_server(
            tmp_path / "server",
            metrics=False,
            host=f"ipc://{socket_path}",
            frontends=[{"type": "native"}, {"type": "lmcache_mp", "host": f"ipc://{tmp_path / 'mp.sock'}"}],
        )
    finally:
        os.umask(previous)
    try:
        for path in (socket_path, tmp_path / "mp.sock"):
            info = path.stat()
            assert stat.S_ISSOCK(info.st_mode)
            assert stat.S_IMODE(info.st_mode) == 0o600, (path, oct(info.st_mode))
            assert info.st_uid == os.getuid()
        with Client(server.url) as client:
            assert client.lookup(make_keys("ipc-mode", 1)) == 0
    finally:
        assert server.stop() == 0, server.output()


def test_lmcache_mp_beyond_loopback_warns_that_anyone_reaching_it_is_served(tmp_path: Path) -> None:
    mp = {"type": "lmcache_mp", "host": "0.0.0.0", "port": free_port(), "allow_remote": True}
    server = start_server(tmp_path / "server", metrics=False, frontends=[{"type": "native"}, mp])
    try:
        with Client(server.url) as client:
            assert client.lookup(make_keys("remote-mp", 1)) == 0
    finally:
        assert server.stop() == 0, server.output()
    warnings = [line for line in server.output().splitlines() if "allow_remote" in line]
    assert len(warnings) == 1, server.output()
    assert "WARNING" in warnings[0] and "no credentials" in warnings[0]
    assert f"0.0.0.0:{mp['port']}" in warnings[0]


def test_no_shm_server_serves_inline(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", metrics=False, no_shm=True)
    try:
        with Client(server.url) as client:
            assert not client.uses_shm
            keys, data = make_keys("inline", 3), make_payloads("inline", 3, 300_000)
            assert client.store(keys, data) == 3
            assert client.lookup(keys) == 3
            with client.retrieve(keys) as views:
                assert digest(views) == digest(data)
            assert client.status()["l1"]["read_locks"] == 0
        # a shared-memory request is refused rather than pinning L1 memory nobody can fill
        with Client(server.url) as client, pytest.raises(ServerError) as refused:
            client._call(StoreReserve(0, "", keys, [10, 10, 10]), StoreReserveReply)
        assert refused.value.code is ErrorCode.INVALID_ARGUMENT
    finally:
        assert server.stop() == 0, server.output()


def test_a_token_longer_than_the_protocol_carries_is_refused_at_start_up(tmp_path: Path) -> None:
    token = "t" * 300
    spec = {"config": {"port": free_port(), "metrics_port": 0, "l1_size_gb": 0.01, "auth_token": token}}
    launched = subprocess.run(
        [sys.executable, str(LAUNCHER), json.dumps(spec), str(tmp_path / "ready")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert launched.returncode == 2
    assert "at most 256" in launched.stderr and len(launched.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ready").exists()

    command = [sys.executable, "-m", "lmcache_tiers.cli.main", "serve", "--no-default-l2"]
    served = subprocess.run(
        [*command, "--port", str(free_port()), "--metrics-port", "0", "--l1-size-gb", "0.01"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "LMCACHE_TIERS_AUTH_TOKEN": token, "COLUMNS": "200"},
    )
    assert served.returncode == 2
    assert "at most 256" in served.stderr
    assert len(served.stderr.strip().splitlines()) == 1


def test_an_abstract_ipc_endpoint_starts(tmp_path: Path) -> None:
    """``ipc://@name`` is a Linux abstract socket: no file, so no mode to set (any local user
    may connect, as on loopback TCP); the server starts on it and touches no file."""
    name = f"tiers-abstract-{os.getpid()}"
    decoy = tmp_path / "server" / f"@{name}"  # what a chmod of the name would reach
    server = start_server(tmp_path / "server", metrics=False, host=f"ipc://@{name}")
    try:
        with Client(server.url) as client:
            assert client.lookup(make_keys("abstract", 1)) == 0
        assert not decoy.exists()
    finally:
        assert server.stop() == 0, server.output()
