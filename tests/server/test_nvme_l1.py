"""A server whose L1 is a file on disk (--gds-l1-path): clients get bytes inline, L2
round trips work, and an adapter that needs L1 memory is refused at start-up."""

from __future__ import annotations

import ctypes.util
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiers_e2e import ServerProcess, digest, free_port, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client

CHUNK = (256 << 10) + 3  # not a block multiple: every copy ends in a partial block
BLOCK_FILE_GLOB = "lmcache_tiers_l1_*.blocks"


def wait_stored_in_l2(client: Client, count: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while client.status()["adapters"][0]["keys_stored"] < count:
        assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
        time.sleep(0.05)


def start_nvme_server(tmp_path: Path, **config: object) -> tuple[ServerProcess, Path]:
    blocks = tmp_path / "l1"
    blocks.mkdir()
    server = start_server(
        tmp_path / "server",
        adapters=[{"type": "mock", "max_size_gb": 0.5}],
        gds_l1_path=str(blocks),
        **config,
    )
    return server, blocks


def stop_and_check(server: ServerProcess, blocks: Path) -> None:
    code = server.stop()
    assert code == 0, server.output()
    assert list(blocks.iterdir()) == [], "the NVMe L1 file outlived the server"
    assert not server.shm_path.exists(), "an NVMe L1 server created a shared-memory segment"


@pytest.fixture
def nvme_server(tmp_path: Path) -> Iterator[tuple[ServerProcess, Path]]:
    server, blocks = start_nvme_server(tmp_path)
    yield server, blocks
    stop_and_check(server, blocks)


def test_store_lookup_retrieve_inline_and_through_l2(nvme_server: tuple[ServerProcess, Path]) -> None:
    server, blocks = nvme_server
    [block_file] = blocks.glob(BLOCK_FILE_GLOB)
    assert block_file.stat().st_size == 256 << 20
    keys, data = make_keys("nvme", 6), make_payloads("nvme", 6, CHUNK)
    # The server offers no shared memory, so even a client that asks for it sends bytes.
    with Client(server.url, shm=True, timeout=30) as client:
        assert not client.uses_shm
        assert client.store(keys, data) == 6
        assert client.lookup(keys, timeout=30) == 6
        with client.retrieve(keys) as views:
            assert digest(views) == digest(data)
        client.release(keys)

        wait_stored_in_l2(client, 6)
        assert client.clear() == 6  # only L2 has the chunks now
        # Stored again under other keys, so the freed blocks hold other bytes.
        others = make_keys("other", 6)
        assert client.store(others, make_payloads("other", 6, CHUNK)) == 6
        client.clear()

        assert client.lookup(keys, timeout=30) == 6
        with client.retrieve(keys) as views:
            assert digest(views) == digest(data)
        client.release(keys)
        status = client.status()
    assert status["requests"]["l2_hit_chunks"] >= 6
    assert (status["l1"]["read_locks"], status["l1"]["write_locked"]) == (0, 0)


def test_start_up_reports_the_io_path(nvme_server: tuple[ServerProcess, Path]) -> None:
    server, blocks = nvme_server
    [block_file] = blocks.glob(BLOCK_FILE_GLOB)
    with Client(server.url, timeout=30) as client:
        client.ping()
    if ctypes.util.find_library("cufile") is None:
        expected = f"NVMe L1: cuFile not available, using O_DIRECT file I/O on {block_file}"
    else:
        expected = f"using O_DIRECT file I/O on {block_file}"
    assert expected in server.output()


def test_buffered_io_when_direct_io_is_off(tmp_path: Path) -> None:
    server, blocks = start_nvme_server(tmp_path, gds_l1_use_direct_io=False)
    try:
        keys, data = make_keys("buffered", 3), make_payloads("buffered", 3, CHUNK)
        with Client(server.url, shm=False, timeout=30) as client:
            assert client.store(keys, data) == 3
            assert client.lookup(keys, timeout=30) == 3
            with client.retrieve(keys) as views:
                assert digest(views) == digest(data)
            client.release(keys)
        assert "using buffered file I/O on" in server.output()
    finally:
        stop_and_check(server, blocks)


def test_serve_flag_with_a_missing_directory_is_a_config_error(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmcache_tiers.cli.main",
            "serve",
            "--gds-l1-path",
            str(missing),
            "--no-gds-l1-use-direct-io",
            "--no-default-l2",
            "--l1-size-gb",
            "0.01",
            "--port",
            str(free_port()),
            "--metrics-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"--gds-l1-path {missing}: not an existing directory" in result.stderr


# A server process whose registry holds an adapter class that addresses L1 memory.
REFUSAL_SCRIPT = textwrap.dedent(
    """
    import sys, types
    from lmcache_tiers.config import build_config
    from lmcache_tiers.plugin import L2AdapterConfig, hookimpl
    from lmcache_tiers.plugins import discover
    from lmcache_tiers.server.app import run_server

    class OffsetConfig(L2AdapterConfig):
        pass

    class OffsetBackend:
        needs_l1_buffers = True  # registers the arena and addresses objects by offset

    @hookimpl
    def tiers_register_l2_adapters(registry):
        registry.add("offset_store", OffsetBackend, OffsetConfig)

    plugin = types.ModuleType("offset_plugin")
    plugin.tiers_register_l2_adapters = tiers_register_l2_adapters
    registry = discover(extra_plugins={"offset-plugin": plugin}).registry
    settings = {"l1_size_gb": 0.01, "port": int(sys.argv[2]), "metrics_port": 0, "gds_l1_path": sys.argv[1]}
    adapters = ['{"type": "mock"}', '{"type": "offset_store"}']
    config = build_config(registry, overrides=settings, adapter_json=adapters)
    sys.exit(run_server(config, registry=registry, banner=False))
    """
)


def test_an_adapter_needing_l1_memory_is_refused_at_start_up(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", REFUSAL_SCRIPT, str(tmp_path), str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "l2 adapter 1:offset_store needs byte access to L1 memory and cannot be used with --gds-l1-path"
        in result.stderr
    )
    assert list(tmp_path.iterdir()) == []  # refused before the L1 file was created
