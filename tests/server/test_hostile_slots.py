"""Slot stores that lie: a real server's raw_block or dax image damaged behind its back --
a payload bit, a slot header, a payload or a whole slot zeroed, a torn write (half the
slot's own payload, half another key's).  Each read of a damaged slot is a miss, counted,
and the key can be stored again; an intact slot beside them still hits."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from block_stores import block_adapter_spec, image_directory, skip_without_block_plugins
from hostile_support import damaged_served, exported, read_each, wait_stored, warned_about
from tiers_e2e import digest, fetch, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey

skip_without_block_plugins()

CHUNK = 128 << 10
SLOTS = 64
#: the adapter stats a refused slot is counted under
REFUSAL_COUNTERS = ("corrupt_records_removed", "recovery_dropped_slots")
#: damages that leave a dax index entry all zeros: read at a start-up, that is a free slot
#: (what a slot never written holds), nothing to count
ZEROED_ENTRIES = 2


@pytest.fixture
def storage() -> Iterator[Path]:
    yield from image_directory("lmcache-hostile-slots-")


def adapter_spec(kind: str, directory: Path) -> dict[str, Any]:
    return block_adapter_spec(kind, directory, chunk=CHUNK, slots=SLOTS)


class Image:
    """The device image, read and written directly (through the page cache: the servers
    open raw_block's file with O_DIRECT, which on tmpfs is that same cache)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def data(self) -> bytes:
        return self.path.read_bytes()

    def write(self, offset: int, data: bytes) -> None:
        fd = os.open(self.path, os.O_RDWR)
        try:
            assert os.pwrite(fd, data, offset) == len(data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def payload_at(self, payload: bytes) -> int:
        """Where ``payload`` (stored with no serde) lies in the image; it must be there once."""
        image = self.data()
        at = image.find(payload)
        assert at >= 0, "the payload is not in the image"
        assert image.find(payload, at + 1) < 0, "the payload is in the image twice"
        return at

    def header_block(self, key: ObjectKey, payload: bytes) -> int:
        """Where the page holding the slot header of the slot whose payload is ``payload``
        starts: the page before the payload on raw_block, the slot's index entry on dax
        (the page of the image's one copy of its key before the data)."""
        at = self.payload_at(payload)
        if self.path.name == "raw_block.img":
            return at - 4096
        image = self.data()
        header = image.find(key.chunk_hash, 0, at)
        assert header >= 0
        return header - header % 4096

    def headers_of(self, key: ObjectKey, payload: bytes) -> list[int]:
        """Offsets of the key's chunk hash in its slot header block (in the slot header,
        then in the record header)."""
        start = self.header_block(key, payload)
        block = self.data()[start : start + 4096]
        found, index = [], 0
        while (index := block.find(key.chunk_hash, index)) >= 0:
            found.append(start + index)
            index += 1
        assert len(found) == 2, f"the key is in its slot header block {len(found)} times"
        return found


def _flip(image: Image, offset: int) -> None:
    byte = image.data()[offset]
    image.write(offset, bytes([byte ^ 0x10]))


#: each damage: (name, what it does to the image, given the key, its payload and another
#: key's payload)
Damage = Callable[[Image, ObjectKey, bytes, bytes], None]
DAMAGE: list[tuple[str, Damage]] = [
    ("payload bit", lambda img, key, own, other: _flip(img, img.payload_at(own) + len(own) // 2)),
    ("last payload bit", lambda img, key, own, other: _flip(img, img.payload_at(own) + len(own) - 1)),
    ("payload zeroed", lambda img, key, own, other: img.write(img.payload_at(own), bytes(len(own)))),
    (
        "torn: second half another key's",
        lambda img, key, own, other: img.write(img.payload_at(own) + len(own) // 2, other[len(own) // 2 :]),
    ),
    ("slot header key bit", lambda img, key, own, other: _flip(img, img.headers_of(key, own)[0])),
    ("record header key bit", lambda img, key, own, other: _flip(img, img.headers_of(key, own)[1])),
    ("record header end bit", lambda img, key, own, other: _flip(img, img.headers_of(key, own)[1] + 40)),
    ("slot header zeroed", lambda img, key, own, other: img.write(img.header_block(key, own), bytes(4096))),
    (
        "slot zeroed, header and payload",
        lambda img, key, own, other: (
            img.write(img.header_block(key, own), bytes(4096))
            or img.write(img.payload_at(own), bytes(len(own)))
        ),
    ),
]


@pytest.mark.parametrize("restart", [False, True], ids=["l1-cleared", "restarted"])
@pytest.mark.parametrize("kind", ["raw_block", "dax"])
def test_every_damaged_slot_is_a_counted_miss(
    tmp_path: Path, storage: Path, kind: str, restart: bool
) -> None:
    spec = adapter_spec(kind, storage)
    image = Image(Path(spec["device_path"]))
    count = len(DAMAGE) + 2
    keys = make_keys(f"hostile-{kind}", count)
    arrays = make_payloads(f"hostile-{kind}", count + 1, CHUNK)
    payloads = [bytes(array) for array in arrays]
    expected = digest(payloads[:count])
    server = start_server(tmp_path / "first", adapters=[spec])
    try:
        with Client(server.url, timeout=60) as client:
            assert client.store(keys, arrays[:count]) == count
            wait_stored(client, count)
            if restart:
                assert server.stop() == 0, server.output()
            for (_, damage), key, own in zip(DAMAGE, keys[1:], payloads[1:], strict=False):
                damage(image, key, own, payloads[count])
            if restart:
                server = start_server(tmp_path / "second", adapters=[spec])
            else:
                client.clear(force=True)
        with Client(server.url, timeout=60) as client:
            served = damaged_served(client, keys, expected, [label for label, _ in DAMAGE], "slot")
            assert served == [], f"damaged slots served: {served}"
            assert read_each(client, keys[1:-1], expected[1:-1]) == [False] * len(DAMAGE)
            backend = client.status()["adapters"][0]["backend"]
            client.clear(force=True)
            stored_before = client.status()["adapters"][0]["keys_stored"]
            assert client.store(keys[1:-1], arrays[1 : count - 1]) == len(DAMAGE)
            wait_stored(client, stored_before + len(DAMAGE))
            client.clear(force=True)
            assert read_each(client, keys[1:-1], expected[1:-1]) == [True] * len(DAMAGE)
        refused = sum(backend.get(name, 0) for name in REFUSAL_COUNTERS)
        uncounted = ZEROED_ENTRIES if kind == "dax" and restart else 0
        assert refused >= len(DAMAGE) - uncounted, backend
        assert server.http_url is not None
        status, _, text = fetch(server.http_url + "/metrics")
        assert status == 200 and exported(text, REFUSAL_COUNTERS) >= refused
        log = (server.log_dir / "stderr.txt").read_text(errors="replace")
        assert warned_about(log, keys[1:-1]) and f"{kind}:" in log, log[-4000:]
    finally:
        server.stop()
