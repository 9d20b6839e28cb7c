"""End to end through ``lmcache-tiers serve``: an installed third-party coroutine backend
whose load raises ``SystemExit`` (a plugin calling ``sys.exit()`` on a bad day) costs the
hits of that load -- counted as a backend error -- and nothing else: the adapter's event
loop keeps serving, and once the plugin behaves the same keys come back byte for byte."""

import json
import signal
from pathlib import Path

import numpy as np
import pytest
from thirdparty import pip_install_to, serve_cli, wait_for, write_package

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey

EXITING = '''
from lmcache_tiers.plugin import L2AdapterConfig, hookimpl


class ExitingConfig(L2AdapterConfig):
    """Objects in memory; loads call sys.exit() while the marker file exists."""

    marker: str = ""


@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("exiting_mem", "exiting_tiers.impl:ExitingBackend", ExitingConfig)
'''

EXITING_IMPL = """
import os
import sys


class ExitingBackend:
    def __init__(self, config, context):
        self.marker = config.marker
        self.objects = {}

    async def put_many(self, keys, payloads):
        for key, payload in zip(keys, payloads):
            self.objects[key] = bytes(payload)
        return [True] * len(keys)

    async def contains_many(self, keys):
        return [len(self.objects[key]) if key in self.objects else None for key in keys]

    async def get_many_into(self, keys, buffers):
        if os.path.exists(self.marker):
            sys.exit("exiting_mem: giving up")
        for key, buffer in zip(keys, buffers):
            buffer[:] = self.objects[key]
        return [True] * len(keys)

    async def delete_many(self, keys):
        return [self.objects.pop(key, None) is not None for key in keys]

    def list_keys(self):
        return [(key, len(value)) for key, value in list(self.objects.items())]

    def capacity(self):
        return None
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pkgs")
    target = root / "site"
    package = write_package(root, "exiting-tiers", "exiting_tiers", EXITING, {"impl": EXITING_IMPL})
    pip_install_to(target, package)
    return target


def _adapter(client: Client) -> dict[str, object]:
    adapters = client.status()["adapters"]
    assert len(adapters) == 1, adapters
    return adapters[0]  # type: ignore[no-any-return]


def test_a_load_calling_sys_exit_is_a_counted_miss_and_the_server_goes_on(site: Path, tmp_path: Path) -> None:
    marker = tmp_path / "exit-on-load"
    adapter = json.dumps({"type": "exiting_mem", "marker": str(marker)})
    server = serve_cli(["--no-default-l2", "--l1-size-gb", "0.0625", "--l2-adapter", adapter], site, tmp_path)
    keys = [ObjectKey("exiting-model", 0, bytes([index]) * 32) for index in range(4)]
    rng = np.random.default_rng(11)
    chunks = [rng.integers(0, 256, 65536, dtype=np.uint8) for _ in keys]
    try:
        with Client(server.url, timeout=30) as client:
            assert client.store(keys, chunks) == len(keys)
            wait_for(server, lambda: _adapter(client)["keys_stored"] == len(keys), "L2 stores")
            assert client.clear() == len(keys)  # L1 empty: every hit below comes from L2
            marker.touch()
            assert client.lookup(keys, timeout=30) == 0, "a load that exited is a miss"
            counters = _adapter(client)["backend"]
            assert counters["backend_errors"] == 1 and counters["load_keys_failed"] == len(keys), counters
            assert counters["pending_tasks"] == 0 and counters["pinned_keys"] == 0, counters
            marker.unlink()
            assert client.lookup(keys, timeout=30) == len(keys), "the adapter's loop goes on"
            targets = [np.zeros_like(chunk) for chunk in chunks]
            assert client.retrieve_into(keys, targets) == len(keys)
            assert all(np.array_equal(a, b) for a, b in zip(chunks, targets, strict=True))
    finally:
        code = server.stop(signal.SIGINT)
    assert code == 0, server.output()
    assert "get_many_into failed: SystemExit: exiting_mem: giving up" in server.output()
