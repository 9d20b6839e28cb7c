"""A metadata service of a kind the installed Mooncake client was built without (the
non-CUDA 0.3.13 wheel has no redis plugin) fails the start in one line naming
``metadata_server``, where Mooncake aborted the whole server process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from lmcache_plugin_mooncake.cluster import LocalCluster
from lmcache_plugin_mooncake.metadata_plugins import metadata_kind

from lmcache_tiers.plugin import free_ports


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("http://10.0.0.1:8080/metadata", "http"),
        ("https://meta.example/metadata", "https"),
        ("etcd://10.0.0.1:2379", "etcd"),
        ("10.0.0.1:2379,10.0.0.2:2379", "etcd"),
        ("redis://10.0.0.1:6379", "redis"),
        ("P2PHANDSHAKE", None),
    ],
)
def test_the_plugin_kind_mooncake_picks_for_each_form(value: str, kind: str | None) -> None:
    assert metadata_kind(value) == kind


def test_a_metadata_kind_the_client_lacks_fails_the_start_by_name(mooncake_pool: LocalCluster) -> None:
    import mooncake.store

    if b"RedisStoragePlugin" in Path(mooncake.store.__file__ or "").read_bytes():
        pytest.skip("the installed Mooncake client has a redis metadata plugin")
    port, metrics_port = free_ports(2)
    adapter = mooncake_pool.adapter(
        metadata_server=f"redis://127.0.0.1:{mooncake_pool.metadata_port}", global_segment_size=0
    )
    server = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_tiers.cli.main",
            "serve",
            "--port",
            str(port),
            "--metrics-port",
            str(metrics_port),
            "--l1-size-gb",
            "0.05",
            "--l2-adapter",
            json.dumps(adapter),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **mooncake_pool.environment(), "COLUMNS": "300"},
    )
    assert server.returncode == 2, server.stderr[-2000:]
    (line,) = [line for line in server.stderr.splitlines() if line.startswith("error:")]
    assert "metadata_server" in line and "without its redis metadata plugin" in line
