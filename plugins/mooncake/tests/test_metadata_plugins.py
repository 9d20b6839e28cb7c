"""A metadata service of a kind the installed Mooncake client was built without (the
non-CUDA 0.3.13 wheel has no redis plugin) fails the start in one line naming
``metadata_server``, in the adapters' pre-flight (before L1 is allocated), where Mooncake
aborted the whole server process."""

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


def refused_start(adapter: dict[str, object], env: dict[str, str]) -> tuple[int, str]:
    """(exit code, the one ``error:`` line) of a ``serve`` with ``adapter`` as its L2,
    asked for an L1 no machine has room for: the L1 check, which comes after the adapters'
    pre-flight, would refuse it -- and L1 is allocated after both."""
    port, metrics_port = free_ports(2)
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
            "100000",
            "--l2-adapter",
            json.dumps(adapter),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "COLUMNS": "300"},
    )
    errors = [line for line in server.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, server.stderr[-2000:]
    return server.returncode, errors[0]


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


def test_a_metadata_kind_the_client_lacks_fails_the_start_by_name_before_l1_exists(
    mooncake_unavailable: str | None,
) -> None:
    if mooncake_unavailable is not None:
        pytest.skip(mooncake_unavailable)
    import mooncake.store

    if b"RedisStoragePlugin" in Path(mooncake.store.__file__ or "").read_bytes():
        pytest.skip("the installed Mooncake client has a redis metadata plugin")
    redis_port, master_port = free_ports(2)
    # Refused before any connection: nothing needs to listen on these ports.
    adapter = {
        "type": "mooncake_store",
        "metadata_server": f"redis://127.0.0.1:{redis_port}",
        "master_server_address": f"127.0.0.1:{master_port}",
        "global_segment_size": 0,
    }
    code, line = refused_start(adapter, {**os.environ, **LocalCluster.environment()})
    assert code == 2, line
    assert "without its redis metadata plugin" in line, line
    assert line.endswith(" - at `$.l2_adapters[0].metadata_server`"), line


def test_a_client_that_cannot_be_imported_fails_the_start_before_l1_exists(tmp_path: Path) -> None:
    # A ``mooncake`` package whose client library fails to load, as without libibverbs.
    package = tmp_path / "mooncake"
    package.mkdir()
    (package / "__init__.py").write_text("")
    failing = 'raise ImportError("libibverbs.so.1: cannot open shared object file")\n'
    (package / "store.py").write_text(failing)
    metadata_port, master_port = free_ports(2)
    adapter = {
        "type": "mooncake_store",
        "metadata_server": f"http://127.0.0.1:{metadata_port}/metadata",
        "master_server_address": f"127.0.0.1:{master_port}",
        "global_segment_size": 0,
    }
    code, line = refused_start(adapter, {**os.environ, "PYTHONPATH": str(tmp_path)})
    assert code == 1, line
    assert "the Mooncake client cannot be imported (libibverbs.so.1" in line, line
    assert "pip install 'lmcache-plugin-mooncake[non-cuda]'" in line, line
