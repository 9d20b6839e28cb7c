"""The end-to-end tests' server start-up: a port found free but taken before the server
bound it (another test's server, a store's own listener) is a start-up on new ports, not
a failed test; ports a test gave itself are not changed."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiers_e2e
from tiers_e2e import start_server

from lmcache_tiers.testing.ports import free_ports


@pytest.fixture
def taken_port() -> Iterator[int]:
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield int(holder.getsockname()[1])
    holder.close()


def test_a_port_taken_before_the_server_binds_it_is_replaced(
    tmp_path: Path, taken_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    handed: list[list[int]] = []

    def first_one_taken(count: int) -> list[int]:
        ports = free_ports(count)
        if not handed:
            ports[1] = taken_port  # the metrics port
        handed.append(ports)
        return ports

    monkeypatch.setattr(tiers_e2e, "free_ports", first_one_taken)
    server = start_server(tmp_path)
    try:
        assert len(handed) == 2
        assert server.http_url == f"http://127.0.0.1:{handed[1][1]}"
    finally:
        server.stop()


def test_a_port_the_test_gave_is_not_replaced(tmp_path: Path, taken_port: int) -> None:
    with pytest.raises(AssertionError, match="already in use"):
        start_server(tmp_path, metrics_port=taken_port)
