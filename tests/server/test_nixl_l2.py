"""Round trips through a real server whose L2 is a NIXL adapter (POSIX backend, on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import (
    job_lookup_retrieve,
    job_store,
    run_in_process,
    start_server,
    stop_cleanly,
    wait_stored_in_l2,
)

from lmcache_tiers.client import Client

if importlib.util.find_spec("lmcache_plugin_nixl") is None:
    pytest.skip("lmcache-plugin-nixl is not installed", allow_module_level=True)

CHUNK = 256 << 10


def _adapter(kind: str, directory: Path) -> dict[str, Any]:
    params = {"file_path": str(directory), "use_direct_io": "false"}
    if kind == "nixl_store":
        return {"type": "nixl_store", "backend": "POSIX", "backend_params": params, "pool_size": 32}
    return {
        "type": "nixl_store_dynamic",
        "backend": "POSIX",
        "backend_params": {**params, "max_capacity_gb": "1", "shard_dirs": "true"},
    }


@pytest.mark.parametrize("kind", ["nixl_store", "nixl_store_dynamic"])
def test_store_evict_from_l1_then_prefetch_from_nixl(tmp_path: Path, kind: str) -> None:
    server = start_server(tmp_path / "server", adapters=[_adapter(kind, tmp_path / "l2")])
    try:
        assert run_in_process(job_store, server.url, "nixl", 8, CHUNK, True) == (8, True)
        wait_stored_in_l2(server, 8)
        with Client(server.url) as client:
            assert client.clear() == 8  # only L2 holds the chunks now
        hits, retrieved, equal, _ = run_in_process(job_lookup_retrieve, server.url, "nixl", 8, CHUNK, True)
        assert (hits, retrieved, equal) == (8, 8, True)
        with Client(server.url) as client:
            status = client.status()
        assert status["requests"]["l2_hit_chunks"] >= 8
        assert status["l1"]["read_locks"] == 0
    finally:
        stop_cleanly(server)


def test_dynamic_store_persists_across_a_server_restart(tmp_path: Path) -> None:
    adapter = _adapter("nixl_store_dynamic", tmp_path / "l2")
    first = start_server(tmp_path / "first", adapters=[adapter])
    try:
        assert run_in_process(job_store, first.url, "persist", 6, CHUNK, True) == (6, True)
        wait_stored_in_l2(first, 6)
    finally:
        stop_cleanly(first)
    assert len(list((tmp_path / "l2").rglob("*.bin"))) == 6

    second = start_server(tmp_path / "second", adapters=[adapter])
    try:
        hits, retrieved, equal, _ = run_in_process(
            job_lookup_retrieve, second.url, "persist", 6, CHUNK, False
        )
        assert (hits, retrieved, equal) == (6, 6, True)
    finally:
        stop_cleanly(second)
