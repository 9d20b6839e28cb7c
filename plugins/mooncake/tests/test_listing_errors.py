"""A start-up listing that fails names ``master_metrics_url``: the start-up scan's warning
shows its message, and the operator has that field to check."""

from __future__ import annotations

import pytest
from lmcache_plugin_mooncake.cluster import LocalCluster, free_port
from lmcache_plugin_mooncake.listing import iter_pool_names


def test_a_metrics_url_nobody_listens_on_is_named() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(
        ConnectionError, match=rf"^master_metrics_url {url}: GET /get_all_keys failed: URLError: "
    ):
        list(iter_pool_names(url, "p/", 5.0))


def test_a_metrics_url_of_another_http_service_is_named(mooncake_pool: LocalCluster) -> None:
    url = f"http://127.0.0.1:{mooncake_pool.metadata_port}"  # the metadata server: no listing
    with pytest.raises(
        ConnectionError, match=rf"^master_metrics_url {url}: GET /get_all_keys failed: HTTPError: "
    ):
        list(iter_pool_names(url, "p/", 5.0))


def test_a_metrics_url_of_the_masters_rpc_port_is_named(mooncake_pool: LocalCluster) -> None:
    url = f"http://{mooncake_pool.master_server_address}"  # answers no HTTP at all
    with pytest.raises(ConnectionError, match=rf"^master_metrics_url {url}: GET /get_all_keys failed: "):
        list(iter_pool_names(url, "p/", 5.0))
