"""An L2 store that lies: records damaged, emptied, zeroed, torn or copied under another
key behind a real server's back, for every adapter whose stored objects a test can reach
(fs, nixl POSIX files, redis, s3, mooncake), and keys stored again by another server
sharing the store.  Each damaged read must be a miss, counted and logged, and the key must
be storable again -- never bytes other than those stored for the key.  Records forged with
a valid header crc are in test_hostile_l2_forged.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from hostile_stores import (  # noqa: F401 - store_service: the fixture store depends on
    CHUNK,
    NAMESPACE,
    WAYS_OUT_OF_L1,
    Store,
    backend_stats,
    flip,
    header_end,
    metrics_of,
    out_of_l1_both_ways,
    store,
    store_service,
)
from hostile_support import damaged_served, exported, read_each, wait_stored, warned_about
from shared_stores import STARTERS, SharedStore
from tiers_e2e import ServerProcess, digest, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.record import PREFIX_SIZE

#: the adapter stats a refused record is counted under
REFUSAL_COUNTERS = ("corrupt_records_removed", "truncated_records_removed", "foreign_records")


#: each damage: (name, how it turns the key's record and another key's record into what the
#: store holds under the key's name)
DAMAGE: list[tuple[str, Callable[[bytes, bytes], bytes]]] = [
    ("payload bit", lambda own, other: flip(own, header_end(own) + (len(own) - header_end(own)) // 2)),
    ("last payload bit", lambda own, other: flip(own, len(own) - 1)),
    ("header checksum bit", lambda own, other: flip(own, 40)),
    ("header magic bit", lambda own, other: flip(own, 1)),
    ("payload length", lambda own, other: flip(own, 13)),
    ("header length", lambda own, other: flip(own, 9)),
    ("header crc bit", lambda own, other: flip(own, header_end(own) - 2)),
    ("truncated", lambda own, other: own[:-100]),
    ("truncated to the header", lambda own, other: own[: header_end(own)]),
    ("truncated in the prefix", lambda own, other: own[: PREFIX_SIZE // 2]),
    ("extended", lambda own, other: own + bytes(100)),
    ("extended by a chunk", lambda own, other: own + own[header_end(own) :]),
    ("emptied", lambda own, other: b""),
    ("zeroed", lambda own, other: bytes(len(own))),
    (
        "torn: header and half the payload of its own, the rest another key's",
        lambda own, other: (
            own[: (len(own) + header_end(own)) // 2] + other[(len(other) + header_end(other)) // 2 :]
        ),
    ),
    ("another key's record", lambda own, other: other),
    (
        "another key's header, its own payload",
        lambda own, other: other[: header_end(other)] + own[header_end(own) :],
    ),
]


#: damages that append bytes behind an intact record
EXTENDED = {"extended", "extended by a chunk"}


def test_every_damaged_or_misplaced_record_is_a_counted_miss(
    tmp_path: Path,
    store: Store,  # noqa: F811 - the fixture imported above
) -> None:
    """Every damage is made to a key of each of two sets: one read back by the server that
    stored it, its L1 cleared, the other by a server started again on the store."""
    store_name, adapter, env, objects = store
    count = len(DAMAGE) + 2  # one intact key first and last
    keys = {way: make_keys(f"hostile/{way}", count) for way in WAYS_OUT_OF_L1}
    payloads = {way: make_payloads(f"hostile/{way}", count, CHUNK) for way in WAYS_OUT_OF_L1}
    spares = make_keys("hostile-other", 1)
    spare_payload = make_payloads("hostile-other", 1, CHUNK)
    every_key = [key for way in WAYS_OUT_OF_L1 for key in keys[way]] + spares
    every_payload = [payload for way in WAYS_OUT_OF_L1 for payload in payloads[way]] + spare_payload
    first = server = start_server(tmp_path / "first", adapters=[adapter], env=env)
    try:
        with Client(server.url, timeout=60) as client:
            assert client.store(every_key, every_payload) == len(every_key)
            wait_stored(client, len(every_key))
        names = dict(zip(every_key, objects.locate(every_key), strict=True))
        other = objects.read(names[spares[0]])
        for way in WAYS_OUT_OF_L1:
            for (_, damage), key in zip(DAMAGE, keys[way][1:], strict=False):
                objects.write(names[key], damage(objects.read(names[key]), other))
        for way, server in out_of_l1_both_ways(first, tmp_path / "second", adapter, env):
            _damaged_read_back(server, store_name, adapter["type"], way, keys[way], payloads[way])
    finally:
        server.stop()


def _damaged_read_back(
    server: ServerProcess,
    store_name: str,
    adapter_type: str,
    way: str,
    keys: list[ObjectKey],
    payloads: list[Any],
) -> None:
    """Read back the keys whose records between the first and the last were damaged, out of
    L1 ``way``: misses, counted and logged, and each key stored again hits."""
    expected = digest(payloads)
    with Client(server.url, timeout=60) as client:
        assert client.status()["l1"]["objects"] == 0
        served = damaged_served(client, keys, expected, [label for label, _ in DAMAGE], "record")
        # A load of a key mooncake knows reads the ranges of the record it stored
        # (docs/adapters/mooncake.md): bytes appended behind that record are not read,
        # and the payload handed out is the stored one, verified (checked above).
        allowed = EXTENDED if store_name == "mooncake" and way == "l1-cleared" else set()
        assert set(served) <= allowed, f"{way}: damaged records served: {served}"
        backend = backend_stats(client)
        # Read again: still misses (the bad object is gone or known to be bad).
        again = read_each(client, keys[1:-1], expected[1:-1])
        assert [label for (label, _), hit in zip(DAMAGE, again, strict=True) if hit] == served, way
        # Stored again, each key hits with its bytes.
        client.clear(force=True)
        before = client.status()["adapters"][0]["keys_stored"]
        assert client.store(keys[1:-1], payloads[1:-1]) == len(DAMAGE)
        wait_stored(client, before + len(DAMAGE))
        client.clear(force=True)
        assert read_each(client, keys[1:-1], expected[1:-1]) == [True] * len(DAMAGE), way
    refused = sum(backend.get(name, 0) for name in REFUSAL_COUNTERS)
    # Mooncake holds no empty object: "emptied" removed it, a plain miss
    # (objects_vanished), no record to refuse.
    removed = 1 if store_name == "mooncake" else 0
    assert refused >= len(DAMAGE) - len(served) - removed, (way, backend)
    assert exported(metrics_of(server), REFUSAL_COUNTERS) >= refused, way
    # Repeated warnings are rate-limited: some damaged key is named, with its adapter.
    log = (server.log_dir / "stderr.txt").read_text(errors="replace")
    assert warned_about(log, keys[1:-1]), log[-4000:]
    assert f"0:{adapter_type}" in log or adapter_type in log


# -- stale objects: a key stored again by another server sharing the store ------------------


@pytest.fixture(scope="module", params=sorted(STARTERS))
def shared_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, SharedStore]]:
    """One store of each kind for the module's tests (starting one takes seconds)."""
    with ExitStack() as stack:
        yield request.param, STARTERS[request.param](tmp_path_factory.mktemp(request.param), stack)


@pytest.fixture
def shared(shared_service: tuple[str, SharedStore]) -> SharedStore:
    """The store both servers of a test use, under a namespace of the test's own: no test
    sees another's records."""
    kind, (adapter, env) = shared_service
    field, end = NAMESPACE[kind]
    return {**adapter, field: f"stale-{uuid.uuid4().hex[:8]}{end}"}, env


@pytest.mark.parametrize("size", [CHUNK, CHUNK // 2, 2 * CHUNK], ids=["same-size", "smaller", "larger"])
def test_a_key_another_server_stored_again_with_other_bytes_is_never_a_mix(
    tmp_path: Path, shared: tuple[dict[str, Any], dict[str, str]], size: int
) -> None:
    """The first server accounts its records (sizes, in memory); the second stores the same
    keys again with other bytes, of ``size``.  Every hit of the first server is then one
    whole record -- its own bytes or the second's -- and its lookup promises no more
    chunks than its retrieve delivers."""
    adapter, env = shared
    count = 6
    keys = make_keys("stale", count)
    mine = make_payloads("stale/first", count, CHUNK)
    theirs = make_payloads("stale/second", count, size)
    either = [set(pair) for pair in zip(digest(mine), digest(theirs), strict=True)]
    first = start_server(tmp_path / "first", adapters=[adapter], env=env)
    second = None
    try:
        with Client(first.url, timeout=60) as client:
            assert client.store(keys, mine) == count
            wait_stored(client, count)
        second = start_server(tmp_path / "second", adapters=[adapter], env=env)
        with Client(second.url, timeout=60) as client:
            client.clear(force=True)
            # Every other key: the first server's records of the rest stay.
            replaced = keys[1::2]
            assert client.store(replaced, theirs[1::2]) == len(replaced)
            wait_stored(client, len(replaced))
        with Client(first.url, timeout=60) as client:
            client.clear(force=True)
            found = client.lookup(keys)
            with client.retrieve(keys[:found]) as views:
                got = digest(views)
            assert len(got) == found, "the lookup promised chunks the retrieve did not deliver"
            for index, value in enumerate(got):
                assert value in either[index], f"chunk {index}: neither record's bytes"
            client.release(keys[:found])
            client.clear(force=True)
            hits = _read_each_of(client, keys, either)
        print(f"first server after the second's stores: lookup {found}, hits {hits}")
        assert hits[0::2] == [True] * len(keys[0::2]), "a record nobody replaced was lost"
    finally:
        for server in (first, second):
            if server is not None:
                assert server.stop() == 0, server.output()


def _read_each_of(client: Client, keys: list[ObjectKey], allowed: list[set[str]]) -> list[bool]:
    hits = []
    for key, choices in zip(keys, allowed, strict=True):
        found = client.lookup([key])
        if found:
            with client.retrieve([key]) as views:
                assert digest(views)[0] in choices, f"{key.file_stem()}: neither record's bytes"
        hits.append(bool(found))
    return hits
