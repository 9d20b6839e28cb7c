"""One fs L2 directory, two server configurations one after the other: a chunk written
through one serde chain (or one AES key) is a counted miss for a server configured with
another, never the encoded bytes handed out as the chunk."""

from __future__ import annotations

import json
import os
import re
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
DOC = Path(__file__).resolve().parents[3] / "docs" / "serde.md"


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


def _read(root: Path, serde: list[dict[str, Any]]) -> tuple[list[torch.Tensor], dict[str, int]]:
    """(the chunks a fresh server on ``root`` hands out, its adapter's counters)."""
    harness = ServerHarness()
    try:
        server = harness.make(adapters=[_adapter(root, serde)])
        with Client(server.endpoint) as client:
            hits = client.lookup(KEYS, timeout=10)
            targets = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(hits)]
            if hits:
                assert client.retrieve_into(KEYS[:hits], targets) == hits
            else:
                client.release(KEYS)
            counters: dict[str, int] = client.status()["adapters"][0]["backend"]
        return targets, counters
    finally:
        harness.close()


def _files(root: Path) -> list[str]:
    return sorted(path.name for path in root.rglob("*") if path.is_file())


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
    tensors = _write(root, CHAINS[written])
    files = _files(root)
    chunks, counters = _read(root, CHAINS[read])
    assert chunks == []
    assert counters.get("serde_chain_mismatch", 0) >= 1
    assert _files(root) == files  # kept
    chunks, _ = _read(root, CHAINS[written])  # the chain it was written with reads it
    assert len(chunks) == CHUNKS
    if written != "fp8":  # fp8 gives back approximations by design
        assert all(torch.equal(got, want) for got, want in zip(chunks, tensors, strict=True))


def test_a_record_encrypted_under_another_key_is_a_counted_miss(tmp_path: Path) -> None:
    root = tmp_path / "l2"
    first = _key_file(tmp_path, "a.key", bytes(range(32)))
    second = _key_file(tmp_path, "b.key", bytes(range(100, 132)))
    tensors = _write(root, [{"type": "aesgcm", "key_file": first}])
    files = _files(root)
    chunks, counters = _read(root, [{"type": "aesgcm", "key_file": second}])
    assert chunks == []
    assert counters.get("serde_decode_failures", 0) >= 1
    assert counters.get("serde_aesgcm_wrong_key", 0) >= 1  # told apart from tampering
    # A server given the wrong key keeps the records: the servers holding the right one
    # still read every chunk, with its own bytes.
    assert _files(root) == files
    chunks, _ = _read(root, [{"type": "aesgcm", "key_file": first}])
    assert len(chunks) == CHUNKS
    assert all(torch.equal(got, want) for got, want in zip(chunks, tensors, strict=True))


def test_the_serde_doc_names_the_counter_and_the_fate_of_a_record_of_another_chain() -> None:
    """An operator who changed a chain looks for the counter the test above checks, and
    must learn the records stay (the old chain reads them again)."""
    text = " ".join(DOC.read_text().split())
    section = text.split("### Changing a chain when data is already stored", 1)[1].split(
        "Options *within*", 1
    )[0]
    assert re.search(r"a miss, counted as `serde_chain_mismatch`", section)
    assert "the record is kept" in section
