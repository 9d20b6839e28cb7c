"""One fs L2 directory, two server configurations one after the other: a chunk written
through one serde chain (or one AES key) is a counted miss for a server configured with
another, never the encoded bytes handed out as the chunk."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_tiers.client import Client
from lmcache_tiers.keys import prefix_keys
from lmcache_tiers.testing.server import ServerHarness

SHAPE = (2, 4, 256, 64)
CHUNKS = 3
KEYS = prefix_keys(list(range(CHUNKS * 256)), 256, model_name="m", kv_rank=0x01000100)


def _key_file(directory: Path, name: str, key: bytes) -> str:
    path = directory / name
    path.write_bytes(key.hex().encode() + b"\n")
    os.chmod(path, 0o600)
    return str(path)


def _adapter(root: Path, serde: list[dict[str, Any]]) -> str:
    return json.dumps({"type": "fs", "path": str(root), "serde": serde})


def _write(root: Path, serde: list[dict[str, Any]]) -> list[torch.Tensor]:
    tensors = [torch.full(SHAPE, 0.5 + index, dtype=torch.bfloat16) for index in range(CHUNKS)]
    harness = ServerHarness()
    try:
        server = harness.make(adapters=[_adapter(root, serde)])
        with Client(server.endpoint) as client:
            assert client.store(KEYS, tensors) == CHUNKS
        assert server.storage.flush(timeout=30)
    finally:
        harness.close()
    return tensors


def _read(root: Path, serde: list[dict[str, Any]]) -> tuple[int, dict[str, int]]:
    """(hits of a fresh server on ``root``, its adapter's counters)."""
    harness = ServerHarness()
    try:
        server = harness.make(adapters=[_adapter(root, serde)])
        with Client(server.endpoint) as client:
            hits = client.lookup(KEYS, timeout=10)
            if hits:
                targets = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(hits)]
                client.retrieve_into(KEYS[:hits], targets)
            else:
                client.release(KEYS)
            counters: dict[str, int] = client.status()["adapters"][0]["backend"]
        return hits, counters
    finally:
        harness.close()


CHAINS = {
    "none": [],
    "zstd": [{"type": "zstd"}],
    "fp8": [{"type": "fp8"}],
}


@pytest.mark.parametrize(
    ("written", "read"),
    [("zstd", "none"), ("none", "zstd"), ("fp8", "none"), ("fp8", "zstd"), ("zstd", "fp8")],
)
def test_a_record_of_another_serde_chain_is_a_counted_miss_and_kept(
    tmp_path: Path, written: str, read: str
) -> None:
    root = tmp_path / "l2"
    _write(root, CHAINS[written])
    files = sorted(path.name for path in root.rglob("*") if path.is_file())
    hits, counters = _read(root, CHAINS[read])
    assert hits == 0
    assert counters.get("serde_chain_mismatch", 0) >= 1
    assert sorted(path.name for path in root.rglob("*") if path.is_file()) == files  # kept
    hits, _ = _read(root, CHAINS[written])  # the chain it was written with reads it
    assert hits == CHUNKS


def test_a_record_encrypted_under_another_key_is_a_counted_miss(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    first = _key_file(tmp_path, "a.key", bytes(range(32)))
    second = _key_file(tmp_path, "b.key", bytes(range(100, 132)))
    tensors = _write(root, [{"type": "aesgcm", "key_file": first}])
    hits, counters = _read(root, [{"type": "aesgcm", "key_file": second}])
    assert hits == 0
    assert counters.get("serde_decode_failures", 0) >= 1
    harness = ServerHarness()
    try:  # whatever became of the records, nothing else was handed out under the right key
        server = harness.make(adapters=[_adapter(root, [{"type": "aesgcm", "key_file": first}])])
        with Client(server.endpoint) as client:
            hits = client.lookup(KEYS, timeout=10)
            targets = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(hits)]
            assert client.retrieve_into(KEYS[:hits], targets) == hits
        assert all(torch.equal(got, want) for got, want in zip(targets, tensors, strict=False))
    finally:
        harness.close()
