"""Records a buggy writer could make, changed behind a real server's back: every field
consistent and the header crc valid, yet impossible (sizes, serde chain, format version,
checksum algorithm), or re-signed around payloads a serde chain did not write -- for
every adapter whose stored objects a test can reach (fs, nixl POSIX files, redis, s3,
mooncake).  Each such read is a miss, counted, and the key is storable again: never bytes
other than those stored for the key.  Damaged and misplaced records are in
test_hostile_l2.py."""

from __future__ import annotations

import importlib.util
import struct
import zlib
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import pytest
from hostile_stores import (  # noqa: F401 - store_service: the fixture store depends on
    CHUNK,
    STORES,
    WAYS_OUT_OF_L1,
    Store,
    backend_stats,
    flip,
    header_end,
    out_of_l1_both_ways,
    store,
    store_service,
)
from hostile_support import read_each, wait_stored
from tiers_e2e import ServerProcess, digest, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.record import decode_header, encode_header

# -- records a buggy writer could make: every field consistent, the header crc valid --------

_CRC_AT = -4  # the header crc ends the header (lmcache_tiers.l2.record)


def _forge(own: bytes, *, payload_len: int | None = None, sign: int | None = None, **fields: Any) -> bytes:
    """``own`` (a record) with its header written again: ``fields`` for
    ``encode_header``'s (``l1_size``, ``serde``, ``layout``), ``payload_len`` patched in,
    the checksum taken over the first ``sign`` payload bytes; the header crc made valid."""
    header = decode_header(own)
    payload = own[header.header_len : header.header_len + header.payload_len]
    options: dict[str, Any] = {"l1_size": header.l1_size, "serde": header.serde, "layout": header.layout}
    options.update(fields)
    new = bytearray(
        encode_header(header.key, payload[: sign if sign is not None else len(payload)], **options)
    )
    if len(new) < header.header_len:  # keep the header's length: some stores fix it
        new[-4:-4] = bytes(header.header_len - len(new))
        struct.pack_into("<I", new, 8, len(new))
    if payload_len is not None:
        struct.pack_into("<Q", new, 12, payload_len)
    struct.pack_into("<I", new, len(new) + _CRC_AT, zlib.crc32(bytes(new[:_CRC_AT])))
    return bytes(new) + payload


def _patched(record: bytes, offset: int, fmt: str, value: int) -> bytes:
    """``record`` with one fixed header field set and its header crc made valid again."""
    new = bytearray(record)
    struct.pack_into(fmt, new, offset, value)
    header_len = header_end(record)
    struct.pack_into("<I", new, header_len - 4, zlib.crc32(bytes(new[: header_len - 4])))
    return bytes(new)


def _unpadded(own: bytes) -> bytes:
    """The record with its header written without padding: intact by the record format,
    but of another header length than the store's records have."""
    header = decode_header(own)
    payload = _payload_of(own)
    return (
        encode_header(header.key, payload, l1_size=header.l1_size, serde=header.serde, layout=header.layout)
        + payload
    )


def _blake3_signed(own: bytes) -> bytes:
    """The record as a writer of checksum algorithm 1 (blake3) made it: intact."""
    header_len = header_end(own)
    digest_ = blake3.blake3(own[header_len:]).digest(16)
    new = bytearray(own)
    new[28] = 1
    new[32:48] = digest_
    struct.pack_into("<I", new, header_len - 4, zlib.crc32(bytes(new[: header_len - 4])))
    return bytes(new)


#: each forgery: (name, what it makes of the key's record, whether it may be served)
FORGED: list[tuple[str, Callable[[bytes], bytes], bool]] = [
    ("checksum algorithm 1 (blake3), intact", _blake3_signed, True),
    ("l1_size one page larger", lambda own: _forge(own, l1_size=CHUNK + 4096), False),
    ("l1_size one byte smaller", lambda own: _forge(own, l1_size=CHUNK - 1), False),
    ("l1_size zero", lambda own: _forge(own, l1_size=0), False),
    ("l1_size past every L1", lambda own: _forge(own, l1_size=1 << 40), False),
    ("another serde chain named", lambda own: _forge(own, serde=("zstd",)), False),
    ("payload_len past the payload", lambda own: _forge(own, payload_len=CHUNK + 4096), False),
    (
        "signed for the first half only",
        lambda own: _forge(own, payload_len=CHUNK // 2, sign=CHUNK // 2),
        False,
    ),
    (
        "signed for the first half, l1_size too",
        lambda own: _forge(own, payload_len=CHUNK // 2, sign=CHUNK // 2, l1_size=CHUNK // 2),
        False,
    ),
    ("format version 2", lambda own: _patched(own, 4, "<H", 2), False),
    ("checksum algorithm 9", lambda own: _patched(own, 28, "<B", 9), False),
    ("flags set", lambda own: _patched(own, 6, "<H", 0xFFFF), True),
    # intact by the record format: redis keeps every header unpadded, s3 reads a header's
    # own length; the file stores and mooncake fix theirs (a miss there)
    ("header unpadded", lambda own: _unpadded(own), True),
]


def store_both_ways(
    server: ServerProcess, keys: dict[str, list[ObjectKey]], payloads: dict[str, list[Any]], objects: Any
) -> dict[str, list[str]]:
    """Store each way's keys through ``server``, wait until L2 holds them all, and return
    each way's object names (in key order) to forge."""
    count = len(next(iter(keys.values())))
    with Client(server.url, timeout=60) as client:
        for way in WAYS_OUT_OF_L1:
            assert client.store(keys[way], payloads[way]) == count
        wait_stored(client, count * len(WAYS_OUT_OF_L1))
    return {way: objects.locate(keys[way]) for way in WAYS_OUT_OF_L1}


def test_records_with_a_valid_header_crc_and_impossible_fields_are_misses(
    tmp_path: Path,
    store: Store,  # noqa: F811 - the fixture imported above
) -> None:
    """Every forgery is made to a key of each of two sets: one read back by the server that
    stored it, its L1 cleared, the other by a server started again on the store."""
    _, adapter, env, objects = store
    count = len(FORGED) + 1
    keys = {way: make_keys(f"forged/{way}", count) for way in WAYS_OUT_OF_L1}
    payloads = {way: make_payloads(f"forged/{way}", count, CHUNK) for way in WAYS_OUT_OF_L1}
    first = server = start_server(tmp_path / "first", adapters=[adapter], env=env)
    try:
        names = store_both_ways(server, keys, payloads, objects)
        for way in WAYS_OUT_OF_L1:
            for (_, forge, _), name in zip(FORGED, names[way][1:], strict=True):
                objects.write(name, forge(objects.read(name)))
        for way, server in out_of_l1_both_ways(first, tmp_path / "second", adapter, env):
            _forged_read_back(server, way, keys[way], payloads[way])
    finally:
        server.stop()


def _forged_read_back(server: ServerProcess, way: str, keys: list[ObjectKey], payloads: list[Any]) -> None:
    """Read back the keys whose records after the first were forged, out of L1 ``way``:
    misses but for the forgeries that may be served (with the stored bytes), and each key
    stored again hits."""
    expected = digest(payloads)
    with Client(server.url, timeout=60) as client:
        found = client.lookup(keys)
        with client.retrieve(keys[:found]) as views:
            assert digest(views) == expected[:found], way
        client.release(keys[:found])
        client.clear(force=True)
        hits = read_each(client, keys, expected)
        assert hits[0], f"{way}: an intact record was lost"
        served = {name for (name, _, _), hit in zip(FORGED, hits[1:], strict=True) if hit}
        allowed = {name for name, _, may in FORGED if may}
        assert served <= allowed, f"{way}: records served: {sorted(served - allowed)}"
        # Stored again, each key hits with its bytes.
        client.clear(force=True)
        before = client.status()["adapters"][0]["keys_stored"]
        assert client.store(keys[1:], payloads[1:]) == len(FORGED)
        wait_stored(client, before + len(FORGED) - len(served))
        client.clear(force=True)
        assert read_each(client, keys[1:], expected[1:]) == [True] * len(FORGED), way


# -- serde chains: records re-signed around payloads no chain wrote --------------------------


def _resigned(own: bytes, payload: bytes, **fields: Any) -> bytes:
    """``own``'s header around ``payload``, its checksum and crc made valid (``fields``
    override ``encode_header``'s), the header's length kept."""
    header = decode_header(own)
    options: dict[str, Any] = {"l1_size": header.l1_size, "serde": header.serde, "layout": header.layout}
    options.update(fields)
    new = bytearray(encode_header(header.key, payload, **options))
    new[-4:-4] = bytes(max(0, header.header_len - len(new)))
    struct.pack_into("<I", new, 8, len(new))
    struct.pack_into("<I", new, len(new) - 4, zlib.crc32(bytes(new[:-4])))
    return bytes(new) + payload


def _random_like(data: bytes) -> bytes:
    return np.random.default_rng(len(data)).integers(0, 256, len(data), dtype=np.uint8).tobytes()


def _payload_of(record: bytes) -> bytes:
    header = decode_header(record)
    return record[header.header_len : header.header_len + header.payload_len]


#: each forgery of a record written with a serde chain: (name, what it makes of the key's
#: record given another key's, whether only a chain with aesgcm refuses it, whether it
#: must be refused -- the others decode to the stored bytes, and a store that reads them
#: (an L1 size its header no longer gives, a header of another length) may serve them)
CHAIN_FORGED: list[tuple[str, Callable[[bytes, bytes], bytes], bool, bool]] = [
    ("random payload", lambda own, other: _resigned(own, _random_like(_payload_of(own))), False, True),
    (
        "payload bit",
        lambda own, other: _resigned(own, flip(_payload_of(own), len(_payload_of(own)) // 2)),
        False,
        True,
    ),
    ("payload cut short", lambda own, other: _resigned(own, _payload_of(own)[:-64]), False, True),
    (
        "l1_size one page larger",
        lambda own, other: _resigned(own, _payload_of(own), l1_size=CHUNK + 4096),
        False,
        False,
    ),
    (
        "l1_size one byte smaller",
        lambda own, other: _resigned(own, _payload_of(own), l1_size=CHUNK - 1),
        False,
        False,
    ),
    ("header unpadded", lambda own, other: _unpadded(own), False, False),
    ("another key's payload", lambda own, other: _resigned(own, _payload_of(other)), True, True),
    (
        "another layout",
        lambda own, other: _resigned(own, _payload_of(own), layout="float16[32768]"),
        True,
        True,
    ),
]


#: what a re-signed record's miss is counted under: the chain refused it, the record was
#: judged damaged, or (a record rewritten behind the adapter of a chain that changes sizes,
#: whose backend then reports its stored size only) its L1 size is not known
CHAIN_REFUSALS = ("serde_decode_failures", "corrupt_records_removed", "lookup_size_unknown")


def _compressible(tag: str, count: int) -> list[np.ndarray[Any, Any]]:
    """Chunks of a small vocabulary: zstd changes their size."""
    rng = np.random.default_rng(int.from_bytes(tag.encode()[:8].ljust(8, b"\0"), "little"))
    words = rng.integers(0, 256, (16, 8), dtype=np.uint8)
    return [words[rng.integers(0, 16, CHUNK // 8)].reshape(-1).copy() for _ in range(count)]


# aesgcm alone is left out: in "zstd,aesgcm" it is the outer layer, the first to read a
# forged record, exactly as alone (and each chain costs every store two server runs)
@pytest.mark.parametrize("chain", ["zstd", "zstd,aesgcm"])
def test_records_re_signed_around_payloads_the_chain_did_not_write_are_misses(
    tmp_path: Path,
    store: Store,  # noqa: F811 - the fixture imported above
    chain: str,
) -> None:
    """Every forgery is made to a key of each of two sets: one read back by the server that
    stored it, its L1 cleared, the other by a server started again on the store."""
    for module in ("lmcache_plugin_serde_zstd", "lmcache_plugin_serde_aesgcm"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    _, adapter, env, objects = store
    key_file = tmp_path / "tiers.key"
    key_file.write_bytes(bytes(range(32)).hex().encode())
    key_file.chmod(0o600)
    serde = [
        {"type": name, "key_file": str(key_file)} if name == "aesgcm" else {"type": name}
        for name in chain.split(",")
    ]
    config = {**adapter, "serde": serde}
    keyed = "aesgcm" in chain
    cases = [(name, forge) for name, forge, needs_aesgcm, _ in CHAIN_FORGED if keyed or not needs_aesgcm]
    count = len(cases) + 2
    keys = {way: make_keys(f"chain-{chain}/{way}", count) for way in WAYS_OUT_OF_L1}
    payloads = {way: _compressible(f"chain-{chain}/{way}", count) for way in WAYS_OUT_OF_L1}
    first = server = start_server(tmp_path / "server", adapters=[config], env=env)
    try:
        names = store_both_ways(server, keys, payloads, objects)
        for way in WAYS_OUT_OF_L1:
            other = objects.read(names[way][-1])
            for (_, forge), name in zip(cases, names[way][1:-1], strict=True):
                objects.write(name, forge(objects.read(name), other))
        for way, server in out_of_l1_both_ways(first, tmp_path / "second", config, env):
            _re_signed_read_back(server, way, [name for name, _ in cases], keys[way], payloads[way])
    finally:
        server.stop()


def _re_signed_read_back(
    server: ServerProcess, way: str, cases: list[str], keys: list[ObjectKey], payloads: list[Any]
) -> None:
    """Read back the keys whose records between the first and the last were forged (one
    of ``cases`` each), out of L1 ``way``: misses but for the forgeries that decode to the
    stored bytes, counted, and each key stored again hits."""
    must_refuse = {name for name, _, _, refused in CHAIN_FORGED if refused}
    expected = digest(payloads)
    with Client(server.url, timeout=60) as client:
        hits = read_each(client, keys, expected)
        assert hits[0] and hits[-1], f"{way}: an intact record was lost"
        served = [name for name, hit in zip(cases, hits[1:-1], strict=True) if hit]
        # Every hit had the stored bytes (checked above).  A load of a key the server
        # accounts decodes into a buffer of the size it accounts, reading no L1 size
        # from the header; s3 takes it from the header copy in the object's metadata,
        # redis keeps headers unpadded: such records decode to the stored bytes.
        assert not set(served) & must_refuse, f"{way}: records served: {served}"
        backend = backend_stats(client)
        assert sum(backend.get(name, 0) for name in CHAIN_REFUSALS) > 0, (way, backend)
        client.clear(force=True)
        before = client.status()["adapters"][0]["keys_stored"]
        assert client.store(keys[1:-1], payloads[1:-1]) == len(cases)
        wait_stored(client, before + len(cases))
        client.clear(force=True)
        assert read_each(client, keys[1:-1], expected[1:-1]) == [True] * len(cases), way


@pytest.mark.parametrize("kind", ["fs", "nixl"])
def test_a_record_file_with_an_unpadded_header_is_a_kept_miss_that_does_not_wedge_its_key(
    tmp_path: Path, kind: str
) -> None:
    """A record file whose intact header is not padded to 4096 bytes (its lengths adding up
    to the file's size), under a chain that changes sizes, read after a restart: an intact
    record of another header length, a miss that is kept (core/tests/l2/test_record_loads.py
    pins that) -- never its payload at the wrong offset -- and the key, stored again, hits."""
    if importlib.util.find_spec("lmcache_plugin_serde_zstd") is None:
        pytest.skip("lmcache-plugin-serde-zstd is not installed")
    with ExitStack() as stack:
        adapter, env, objects = STORES[kind](tmp_path, stack)
        config = {**adapter, "serde": [{"type": "zstd"}]}
        keys = make_keys("unpadded", 2)
        payloads = _compressible("unpadded", 2)
        expected = digest(payloads)
        server = start_server(tmp_path / "first", adapters=[config], env=env)
        try:
            with Client(server.url, timeout=60) as client:
                assert client.store(keys, payloads) == 2
                wait_stored(client, 2)
            assert server.stop() == 0, server.output()
            name = objects.find(keys[1])
            objects.write(name, _unpadded(objects.read(name)))
            server = start_server(tmp_path / "second", adapters=[config], env=env)
            with Client(server.url, timeout=60) as client:
                assert read_each(client, keys, expected) == [True, False]
                assert read_each(client, keys, expected) == [True, False]
                backend = backend_stats(client)
                assert backend.get("load_keys_failed", 0) >= 1, backend
                assert backend.get("corrupt_records_removed", 0) == 0, backend
                assert name in objects.names()
                log = (server.log_dir / "stderr.txt").read_text(errors="replace")
                assert keys[1].file_stem() in log, log[-4000:]
                # Stored again, it hits.
                assert client.store(keys[1:], payloads[1:]) == 1
                wait_stored(client, 1)
                client.clear(force=True)
                assert read_each(client, keys, expected) == [True, True]
        finally:
            server.stop()
