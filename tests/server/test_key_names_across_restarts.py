"""The same tokens under many model names and cache salts (tenants) -- names differing in
case only, holding escapes, a leading dot, unicode, long enough for a digest name --
stored through a real server on a persistent L2, half of them, then read after a restart:
each stored key comes back with its own bytes, every other key is a miss.  A key never
reads another model's or tenant's object, whatever its name becomes on the store."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tiers_e2e import digest, make_keys, make_payloads, start_server, stop_cleanly

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey

for _module in ("lmcache_plugin_fs", "lmcache_plugin_raw_block", "lmcache_plugin_dax"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_module} is not installed", allow_module_level=True)

CHUNK = 16 << 10
SLOTS = 96
MODELS = ["m", "M", "m/..", ".hidden", "a%41", "é" * 120, "x" * 250, "ü" * 200 + "z"]
SALTS = ["", "t1", "T1", "t1" * 60, "%", ".", "ß"]


@pytest.fixture
def storage() -> Iterator[Path]:
    """A directory in /dev/shm (dax maps its file shared; raw_block's file takes O_DIRECT there)."""
    directory = Path(tempfile.mkdtemp(prefix="lmcache-key-names-", dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def adapter_spec(kind: str, directory: Path) -> dict[str, Any]:
    if kind.startswith("fs"):
        return {"type": "fs", "path": str(directory / "fs"), "shard_dirs": kind == "fs_sharded"}
    slot = CHUNK + 4096
    if kind == "raw_block":
        return {
            "type": "raw_block",
            "device_path": str(directory / "raw_block.img"),
            "slot_bytes": slot,
            "capacity_bytes": (SLOTS + 8) * slot,
        }
    return {
        "type": "dax",
        "device_path": str(directory / "dax.img"),
        "max_dax_size_gb": (SLOTS * (slot + 4096) + (1 << 20)) / (1 << 30),
        "slot_bytes": CHUNK,
    }


def _key(model: str, salt: str) -> ObjectKey:
    return make_keys("the same tokens", 1, model=model, salt=salt)[0]


def _tag(model: str, salt: str) -> str:
    return f"{model}|{salt}"


@pytest.mark.parametrize("kind", ["fs_flat", "fs_sharded", "raw_block", "dax"])
def test_each_model_and_salt_reads_only_its_own_object_after_a_restart(
    tmp_path: Path, storage: Path, kind: str
) -> None:
    names = [(model, salt) for model in MODELS for salt in SALTS]
    stored = names[::2]
    assert len(stored) < SLOTS
    spec = adapter_spec(kind, storage)
    first = start_server(tmp_path / "first", adapters=[spec])
    try:
        with Client(first.url) as client:
            for model, salt in stored:
                assert client.store([_key(model, salt)], make_payloads(_tag(model, salt), 1, CHUNK)) == 1
            deadline = time.monotonic() + 60
            while client.status()["adapters"][0]["keys_stored"] < len(stored):
                assert time.monotonic() < deadline, "the store controller never wrote the chunks to L2"
                time.sleep(0.05)
    finally:
        stop_cleanly(first)
    second = start_server(tmp_path / "second", adapters=[spec])
    try:
        with Client(second.url) as client:
            found: list[tuple[str, str]] = []
            for model, salt in names:
                key = _key(model, salt)
                hits = client.lookup([key])
                with client.retrieve([key][:hits]) as views:
                    got = digest(views)
                if got:
                    found.append((model, salt))
                    expected = digest(make_payloads(_tag(model, salt), 1, CHUNK))
                    assert got == expected, f"{model[:20]!r}/{salt[:20]!r} read another key's object"
        assert found == stored
    finally:
        stop_cleanly(second)
