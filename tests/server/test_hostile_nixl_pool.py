"""A ``nixl_store`` pool (POSIX slot files) that lies: a real server's slot files changed
behind its back -- a bit flipped, zeroed, truncated, emptied, torn (half another key's
bytes), another slot's bytes copied in.  Each load of such a slot is a miss, counted
(``corrupt_slots_dropped``), and the key can be stored again; intact slots still hit."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile_support import read_each, wait_stored
from tiers_e2e import digest, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client

if importlib.util.find_spec("lmcache_plugin_nixl") is None:
    pytest.skip("lmcache-plugin-nixl is not installed", allow_module_level=True)

CHUNK = 64 << 10


def _flipped(data: bytes, at: int) -> bytes:
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


#: each damage: (name, what the slot file holds instead of ``own``, given another key's bytes)
DAMAGE: list[tuple[str, Callable[[bytes, bytes], bytes]]] = [
    ("payload bit", lambda own, other: _flipped(own, CHUNK // 2)),
    ("first bit", lambda own, other: _flipped(own, 0)),
    ("last bit", lambda own, other: _flipped(own, CHUNK - 1)),
    ("zeroed", lambda own, other: bytes(len(own))),
    ("truncated", lambda own, other: own[: CHUNK // 2]),
    ("emptied", lambda own, other: b""),
    ("torn: second half another key's", lambda own, other: own[: CHUNK // 2] + other[CHUNK // 2 : CHUNK]),
    ("another key's bytes", lambda own, other: other),
]


def _slot_of(directory: Path, payload: bytes) -> Path:
    """The slot file whose bytes start with ``payload``."""
    found = [path for path in directory.iterdir() if path.is_file() and path.read_bytes()[:CHUNK] == payload]
    assert len(found) == 1, f"{len(found)} slot files hold the payload"
    return found[0]


def test_every_changed_slot_file_is_a_counted_miss(tmp_path: Path) -> None:
    directory = tmp_path / "pool"
    adapter = {
        "type": "nixl_store",
        "backend": "POSIX",
        "backend_params": {"file_path": str(directory), "use_direct_io": "false"},
        "pool_size": 32,
    }
    count = len(DAMAGE) + 2
    keys = make_keys("hostile-pool", count)
    arrays = make_payloads("hostile-pool", count, CHUNK)
    payloads = [bytes(array) for array in arrays]
    expected = digest(payloads)
    server = start_server(tmp_path / "server", adapters=[adapter])
    try:
        with Client(server.url, timeout=60) as client:
            assert client.store(keys, arrays) == count
            wait_stored(client, count)
            slots = [_slot_of(directory, payload) for payload in payloads]
            for (_, damage), slot, own in zip(DAMAGE, slots[1:], payloads[1:], strict=False):
                slot.write_bytes(damage(own, payloads[-1]))
            client.clear(force=True)
            found = client.lookup(keys)
            assert found == 1
            with client.retrieve(keys[:found]) as views:
                assert digest(views) == expected[:found]
            client.release(keys[:found])
            client.clear(force=True)
            hits = read_each(client, keys, expected)
            assert hits[0] and hits[-1], "an intact slot was lost"
            served = [name for (name, _), hit in zip(DAMAGE, hits[1:-1], strict=True) if hit]
            assert served == [], f"changed slots served: {served}"
            assert read_each(client, keys[1:-1], expected[1:-1]) == [False] * len(DAMAGE)
            backend = client.status()["adapters"][0]["backend"]
            assert backend.get("corrupt_slots_dropped", 0) >= len(DAMAGE), backend
            client.clear(force=True)
            before = client.status()["adapters"][0]["keys_stored"]
            assert client.store(keys[1:-1], arrays[1:-1]) == len(DAMAGE)
            wait_stored(client, before + len(DAMAGE))
            client.clear(force=True)
            assert read_each(client, keys[1:-1], expected[1:-1]) == [True] * len(DAMAGE)
        log = (server.log_dir / "stderr.txt").read_text(errors="replace")
        named = [key.file_stem() for key in keys[1:-1] if key.file_stem() in log]
        assert named, log[-4000:]
    finally:
        assert server.stop() == 0, server.output()
