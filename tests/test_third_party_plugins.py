"""A plugin from outside the repository plugs in through its entry point alone.

``acme-tiers`` is installed with pip into a directory of its own, like a user's
``pip install``; nothing in the repository imports it.  Its ``acme_dir`` adapter is a real
backend written against ``lmcache_tiers.plugin`` alone: each object is a file (the key,
then the bytes) in a directory, listed again at start-up.  The server is started with the
``lmcache-tiers serve`` command and a client stores, looks up and retrieves through it,
with the bytes coming back from the plugin's files.
"""

import json
import signal
from pathlib import Path

import numpy as np
import pytest
from thirdparty import pip_install_to, run_cli, serve_cli, wait_for, write_package

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey

ACME = '''
import msgspec
from typing import Annotated
from lmcache_tiers.plugin import ComponentConfig, L2AdapterConfig, hookimpl

class AcmeConfig(L2AdapterConfig):
    """Acme directory store: one file per object."""
    directory: Annotated[str, msgspec.Meta(description="Where the object files live.")] = "/tmp/acme"
    slots: Annotated[int, msgspec.Meta(gt=0, description="Most objects held at once.")] = 4

class AcmePolicyConfig(ComponentConfig):
    """Acme policy."""

@hookimpl
def tiers_register_l2_adapters(registry):
    registry.add("acme_dir", "acme_tiers.impl:AcmeDirBackend", AcmeConfig)

@hookimpl
def tiers_register_eviction_policies(registry):
    registry.add("acme_fifo", "acme_tiers.impl:Fifo", AcmePolicyConfig)

@hookimpl
def tiers_register_store_policies(registry):
    registry.add("acme_store", "acme_tiers.impl:Store", AcmePolicyConfig)

@hookimpl
def tiers_register_prefetch_policies(registry):
    registry.add("acme_prefetch", "acme_tiers.impl:Prefetch", AcmePolicyConfig)
'''

ACME_IMPL = '''
"""The acme_dir backend: each object is <directory>/<name>.obj = 4-byte key length, the
msgpack-encoded key, then the payload; written to a temporary file and renamed."""
import hashlib
import logging
import os
import threading

import msgspec

from lmcache_tiers.plugin import Capacity, ObjectKey

log = logging.getLogger("acme_tiers.impl")
_encode_key = msgspec.msgpack.Encoder().encode
_decode_key = msgspec.msgpack.Decoder(ObjectKey).decode


class AcmeDirBackend:
    def __init__(self, config, context):
        self.directory = config.directory
        self.slots = config.slots
        os.makedirs(self.directory, exist_ok=True)
        self._lock = threading.Lock()
        self._index = {}  # key -> (path, header bytes, payload bytes)
        for name in os.listdir(self.directory):
            if name.endswith(".obj"):
                path = os.path.join(self.directory, name)
                with open(path, "rb") as handle:
                    header = 4 + int.from_bytes(handle.read(4), "big")
                    handle.seek(4)
                    key = _decode_key(handle.read(header - 4))
                self._index[key] = (path, header, os.path.getsize(path) - header)
        log.info("acme_dir: %d objects found in %s", len(self._index), self.directory)

    def _path(self, key):
        return os.path.join(self.directory, hashlib.sha256(_encode_key(key)).hexdigest() + ".obj")

    def put_many(self, keys, payloads):
        for key, payload in zip(keys, payloads):
            encoded = _encode_key(key)
            path = self._path(key)
            with open(path + ".tmp", "wb") as handle:
                handle.write(len(encoded).to_bytes(4, "big") + encoded)
                handle.write(payload)
            os.replace(path + ".tmp", path)
            with self._lock:
                self._index[key] = (path, 4 + len(encoded), payload.nbytes)
        return [True] * len(keys)

    def contains_many(self, keys):
        with self._lock:
            return [self._index[key][2] if key in self._index else None for key in keys]

    def get_many_into(self, keys, buffers):
        done = []
        for key, buffer in zip(keys, buffers):
            with self._lock:
                found = self._index.get(key)
            if found is None or found[2] != buffer.nbytes:
                done.append(False)
                continue
            with open(found[0], "rb") as handle:
                handle.seek(found[1])
                done.append(handle.readinto(buffer) == buffer.nbytes)
        return done

    def delete_many(self, keys):
        done = []
        for key in keys:
            with self._lock:
                found = self._index.pop(key, None)
            if found is not None:
                os.unlink(found[0])
            done.append(found is not None)
        return done

    def list_keys(self):
        with self._lock:
            return [(key, size) for key, (_path, _header, size) in self._index.items()]

    def capacity(self):
        return Capacity(objects=self.slots)
'''

BROKEN = """
raise ImportError("acme-broken needs libtape.so")
"""

POLICY_FLAGS = [
    "--eviction-policy",
    "acme_fifo",
    "--l2-store-policy",
    "acme_store",
    "--l2-prefetch-policy",
    "acme_prefetch",
]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pkgs")
    target = root / "site"
    pip_install_to(
        target,
        write_package(root, "acme-tiers", "acme_tiers", ACME, {"impl": ACME_IMPL}),
        write_package(root, "acme-broken", "acme_broken", BROKEN),
    )
    return target


def _by_name(output: str) -> dict[str, dict[str, object]]:
    return {row["plugin"]: row for row in json.loads(output)}


def test_installed_plugin_is_listed(site: Path) -> None:
    result = run_cli(["plugins", "list", "--json"], site)
    assert result.returncode == 0, result.stderr
    rows = _by_name(result.stdout)
    acme = rows["acme-tiers"]
    assert acme["status"] == "ok" and acme["version"] == "1.2.3"
    assert "l2_adapter:acme_dir" in acme["components"]  # type: ignore[operator]


def test_plugin_that_raises_on_import_is_reported_and_others_load(site: Path) -> None:
    rows = _by_name(run_cli(["plugins", "list", "--json"], site).stdout)
    assert rows["acme-broken"]["status"] == "error: ImportError: acme-broken needs libtape.so"
    assert rows["acme-tiers"]["status"] == "ok"
    table = run_cli(["plugins", "list"], site, COLUMNS="200")
    assert table.returncode == 0 and "acme-broken" in table.stdout and "libtape.so" in table.stdout


def test_third_party_adapter_selected_by_type_without_core_changes(site: Path) -> None:
    result = run_cli(
        [
            "serve",
            "--print-config",
            "--no-default-l2",
            *POLICY_FLAGS,
            "--l2-adapter",
            '{"type": "acme_dir", "slots": 9}',
        ],
        site,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads(result.stdout)
    assert config["l2_adapters"] == [
        {
            "type": "acme_dir",
            "eviction": None,
            "serde": [],
            "circuit": None,
            "directory": "/tmp/acme",
            "slots": 9,
        }
    ]
    # the help lists what is installed, third-party types included
    helped = run_cli(["serve", "--help"], site, COLUMNS="250")
    assert "acme_dir" in helped.stdout and "acme_fifo" in helped.stdout


def test_third_party_field_errors_keep_the_path(site: Path) -> None:
    result = run_cli(
        ["serve", "--print-config", *POLICY_FLAGS, "--l2-adapter", '{"type": "acme_dir", "slots": 0}'], site
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "error: acme_dir: Expected `int` >= 1 - at `$.l2_adapters[0].slots`"


def test_strict_refuses_to_start_with_a_broken_plugin(site: Path) -> None:
    result = run_cli(["serve", "--strict", "--print-config", *POLICY_FLAGS], site)
    assert result.returncode == 2
    assert "--strict: plugins failed to load: acme-broken" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_disabled_plugin_is_not_imported(site: Path) -> None:
    rows = _by_name(
        run_cli(["plugins", "list", "--json"], site, LMCACHE_TIERS_DISABLE_PLUGINS="acme-broken, mock").stdout
    )
    assert rows["acme-broken"]["status"] == "disabled by LMCACHE_TIERS_DISABLE_PLUGINS"
    assert rows["mock"]["status"] == "disabled by LMCACHE_TIERS_DISABLE_PLUGINS"
    result = run_cli(
        ["serve", "--strict", "--print-config", *POLICY_FLAGS],
        site,
        LMCACHE_TIERS_DISABLE_PLUGINS="acme-broken",
    )
    assert result.returncode == 0, result.stderr


def test_plugins_show_prints_fields(site: Path) -> None:
    result = run_cli(["plugins", "show", "acme-tiers"], site, COLUMNS="200")
    assert result.returncode == 0, result.stderr
    for text in ("l2_adapter:acme_dir", "slots", "integer", "> 0", "Most objects held at once.", "eviction"):
        assert text in result.stdout
    assert "eviction_policy:acme_fifo  (plugin acme-tiers)\nno options" in result.stdout
    by_component = run_cli(["plugins", "show", "acme_dir"], site, COLUMNS="200")
    assert "Most objects held at once." in by_component.stdout
    broken = run_cli(["plugins", "show", "acme-broken"], site)
    assert broken.returncode == 1 and "did not load" in broken.stderr
    missing = run_cli(["plugins", "show", "nothing-here"], site)
    assert missing.returncode == 2 and "no plugin or component named 'nothing-here'" in missing.stderr


def test_plugins_show_of_a_disabled_plugin_says_it_is_disabled(site: Path) -> None:
    result = run_cli(["plugins", "show", "acme-tiers"], site, LMCACHE_TIERS_DISABLE_PLUGINS="acme-tiers")
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: plugin 'acme-tiers' is disabled by LMCACHE_TIERS_DISABLE_PLUGINS: "
        "its components are not loaded"
    )
    assert "registers no components" not in result.stdout


def _status_adapter(client: Client) -> dict[str, object]:
    adapters = client.status()["adapters"]
    assert len(adapters) == 1 and adapters[0]["type"] == "acme_dir"
    return adapters[0]  # type: ignore[no-any-return]


def test_server_stores_and_serves_through_the_third_party_adapter(site: Path, tmp_path: Path) -> None:
    directory = tmp_path / "acme-objects"
    adapter = json.dumps({"type": "acme_dir", "directory": str(directory), "slots": 64})
    server = serve_cli(["--no-default-l2", "--l1-size-gb", "0.0625", "--l2-adapter", adapter], site, tmp_path)
    keys = [ObjectKey("acme-model", 0, bytes([index]) * 32) for index in range(8)]
    rng = np.random.default_rng(7)
    chunks = [rng.integers(0, 256, 65536, dtype=np.uint8) for _ in keys]
    try:
        with Client(server.url, timeout=30) as client:
            assert client.store(keys, chunks) == len(keys)
            wait_for(server, lambda: _status_adapter(client)["keys_stored"] == len(keys), "L2 stores")
            assert len(list(directory.glob("*.obj"))) == len(keys)
            assert client.clear() == len(keys)  # L1 empty: every hit below comes from acme_dir
            assert client.lookup(keys, timeout=30) == len(keys)
            targets = [np.zeros_like(chunk) for chunk in chunks]
            assert client.retrieve_into(keys, targets) == len(keys)
            assert all(np.array_equal(a, b) for a, b in zip(chunks, targets, strict=True))
            status = client.status()
            assert status["requests"]["l2_hit_chunks"] == len(keys)
            assert _status_adapter(client)["keys_loaded"] == len(keys)
    finally:
        code = server.stop(signal.SIGINT)
    assert code == 0, server.output()
    # the plugin's own log line went through the server's log format
    assert " INFO acme_tiers.impl: acme_dir: 0 objects found in " in server.output()
