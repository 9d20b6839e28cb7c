"""A set-up that fails names the service it could not use by its config field: Mooncake
answers -1 alike for a master that is down, a metadata server that is down, and a
master address that is another service's port."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from lmcache_plugin_mooncake import client as client_module
from lmcache_plugin_mooncake.cluster import LocalCluster, NotedCalls, free_port
from lmcache_plugin_mooncake.diagnosis import unanswered_services, unreachable_service
from mooncake_helpers import backend_of, config_for, eventually, open_adapter

TIMEOUT_S = 2.0


def test_a_pool_that_answers_is_said_to(mooncake_pool: LocalCluster) -> None:
    found = unanswered_services(config_for(mooncake_pool), TIMEOUT_S)
    assert found.startswith(
        f"master_server_address {mooncake_pool.master_server_address} and metadata_server"
    )
    assert found.endswith("both accept connections (Mooncake's log says more)")


def test_a_master_address_nobody_listens_on_is_named(mooncake_pool: LocalCluster) -> None:
    address = f"127.0.0.1:{free_port()}"
    found = unanswered_services(config_for(mooncake_pool, master_server_address=address), TIMEOUT_S)
    assert found == f"master_server_address {address} does not answer (connection refused)"


@pytest.mark.parametrize("port", ["metadata_port", "metrics_port"])
def test_a_master_address_of_an_http_port_is_named(mooncake_pool: LocalCluster, port: str) -> None:
    address = f"127.0.0.1:{getattr(mooncake_pool, port)}"
    found = unanswered_services(config_for(mooncake_pool, master_server_address=address), TIMEOUT_S)
    assert found.startswith(f"master_server_address {address} is an HTTP server (it answered ")
    assert found.endswith("not mooncake_master's RPC port (--rpc_port)")


def first_failed_setup(pool: LocalCluster, **fields: Any) -> tuple[str, dict[str, Any]]:
    """(the error of the first failed set-up, the adapter's stats then) of an adapter on
    ``pool`` configured with ``fields``."""
    adapter = open_adapter(config_for(pool, operation_timeout_s=1.0, **fields))
    try:
        connection = backend_of(adapter).connection
        eventually(lambda: connection.failures >= 1, what="a failed set-up")
        return connection.last_error, adapter.stats()
    finally:
        adapter.close()


def test_a_metadata_server_on_the_masters_rpc_port_is_named(mooncake_pool: LocalCluster) -> None:
    url = f"http://{mooncake_pool.master_server_address}/metadata"
    found = unanswered_services(config_for(mooncake_pool, metadata_server=url), TIMEOUT_S)
    assert found.startswith(f"metadata_server {url} does not answer as an HTTP metadata server (")


@pytest.mark.parametrize("where", ["metrics port", "wrong path"])
def test_a_metadata_server_that_is_another_http_server_is_named(
    mooncake_pool: LocalCluster, where: str
) -> None:
    url = (
        f"http://127.0.0.1:{mooncake_pool.metrics_port}/metadata"
        if where == "metrics port"
        else f"http://127.0.0.1:{mooncake_pool.metadata_port}/meta"
    )
    error, _ = first_failed_setup(mooncake_pool, metadata_server=url)
    assert error.startswith(
        f"setup returned -1: metadata_server {url} answers HTTP but is not Mooncake's metadata server"
    ), error


def test_an_adapter_whose_metadata_server_is_down_says_so_not_that_the_master_is(
    mooncake_pool: LocalCluster,
) -> None:
    url = f"http://127.0.0.1:{free_port()}/metadata"
    error, stats = first_failed_setup(mooncake_pool, metadata_server=url)
    assert error == f"set-up not tried: metadata_server {url} does not answer (connection refused)"
    assert stats["connected"] == 0


def test_an_adapter_given_an_http_port_for_the_master_says_so(mooncake_pool: LocalCluster) -> None:
    address = f"127.0.0.1:{mooncake_pool.metrics_port}"
    error, _ = first_failed_setup(mooncake_pool, master_server_address=address)
    assert error.startswith(
        f"setup returned -1: master_server_address {address} is an HTTP server (it answered "
    ), error


def test_no_set_up_is_tried_while_the_master_refuses_connections(
    own_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mooncake's set-up holds the GIL throughout: against a master that is down, every
    # attempt would stall the whole server for its ~4.5 s of retries.
    called: list[str] = []
    real = client_module.import_store_module()

    class Noted:
        @staticmethod
        def MooncakeDistributedStore() -> NotedCalls:
            return NotedCalls(real.MooncakeDistributedStore(), called)

    monkeypatch.setattr(client_module, "import_store_module", lambda: Noted)
    own_cluster.kill_master()
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=1.0))
    try:
        connection = backend_of(adapter).connection
        eventually(lambda: connection.failures >= 2, what="two failed attempts")
        assert "setup" not in called
        assert connection.last_error == (
            f"set-up not tried: master_server_address {own_cluster.master_server_address} "
            "does not answer (connection refused)"
        )
        own_cluster.start_master()
        eventually(lambda: adapter.stats()["connected"] == 1, timeout=90, what="the connection")
        assert "setup" in called
    finally:
        adapter.close()


def test_a_hung_metadata_server_keeps_the_set_up_from_being_tried(mooncake_pool: LocalCluster) -> None:
    # Listening, never answering: what a stopped (SIGSTOP) master's metadata server does.
    with socket.create_server(("127.0.0.1", 0)) as hung:
        url = f"http://127.0.0.1:{hung.getsockname()[1]}/metadata"
        found = unreachable_service(config_for(mooncake_pool, metadata_server=url), 0.5)
    assert found == f"metadata_server {url} does not answer (no answer in time)"
    assert unreachable_service(config_for(mooncake_pool), TIMEOUT_S) is None


def test_an_etcd_style_metadata_server_nobody_listens_on_keeps_the_set_up_from_being_tried(
    mooncake_pool: LocalCluster,
) -> None:
    # Mooncake takes host:port for an etcd address: its set-up then holds the GIL ~10 s.
    service = f"127.0.0.1:{free_port()}"
    found = unreachable_service(config_for(mooncake_pool, metadata_server=service), TIMEOUT_S)
    assert found == f"metadata_server {service} does not answer (connection refused)"
    # One endpoint of several that takes a connection is enough to try.
    with socket.create_server(("127.0.0.1", 0)) as listening:
        several = f"etcd://{service};etcd://127.0.0.1:{listening.getsockname()[1]}"
        assert unreachable_service(config_for(mooncake_pool, metadata_server=several), TIMEOUT_S) is None
    # P2PHANDSHAKE names no service to ask (the config refuses every other form).
    handshake = config_for(mooncake_pool, metadata_server="P2PHANDSHAKE")
    assert unreachable_service(handshake, TIMEOUT_S) is None
