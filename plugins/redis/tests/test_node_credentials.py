"""``startup_nodes`` entries are ``host:port``: one holding user information
(``user:password@host:port``, or a whole ``redis://`` URL) was read as a host named
``user:password@host``, printed by ``--print-config`` and named by every connection error.
It is refused, without being quoted."""

from __future__ import annotations

import json

import pytest
from cli_config import print_config

SECRET = "n0de-s3cret"


@pytest.mark.parametrize(
    "nodes",
    [
        [f"user:{SECRET}@10.0.0.1:6379"],
        ["10.0.0.2:6379", f":{SECRET}@10.0.0.1:6379"],
        f"10.0.0.2:6379,user:{SECRET}@10.0.0.1:6379",
        [f"redis://user:{SECRET}@10.0.0.1:6379"],
        [f"user:{SECRET}@10.0.0.1:bad"],
    ],
    ids=["userinfo", "second-entry", "lmcache-string", "url", "bad-port"],
)
def test_a_node_with_credentials_is_refused_unquoted(nodes: object) -> None:
    result = print_config({"type": "redis", "startup_nodes": nodes, "cluster_mode": True})
    assert result.returncode != 0
    assert SECRET not in result.stdout + result.stderr
    assert "credentials are not accepted in startup_nodes" in result.stderr


def test_plain_nodes_are_still_accepted() -> None:
    result = print_config(
        {"type": "redis", "startup_nodes": ["10.0.0.1:6379", "[::1]:6380"], "cluster_mode": True}
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["l2_adapters"][0]["startup_nodes"] == ["10.0.0.1:6379", "[::1]:6380"]


@pytest.mark.parametrize("kind", ["redis", "resp"])
def test_a_host_with_credentials_is_refused_unquoted(kind: str) -> None:
    result = print_config({"type": kind, "host": f"user:{SECRET}@10.0.0.1", "port": 6379})
    assert result.returncode != 0
    assert SECRET not in result.stdout + result.stderr
    assert "credentials are not accepted in host" in result.stderr
