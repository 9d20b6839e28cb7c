"""Do the books of /metrics balance?  A seeded random mix of client work against a real
in-process server (L1 small enough to evict, two L2 adapters: fs behind fault_inject
failing a fraction of its calls, and a small mock refusing for capacity), then idle; the
counters and gauges an operator reads must then add up to what the clients saw.

Each identity is checked once the server is idle (stores settled, TTL sweeps done): the
clients' own tallies (keys newly stored, refusals, clears) against the counters, and the
gauges against L1's objects themselves.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmcache_tiers.client import Client, ServerError
from lmcache_tiers.controllers.prefetch_results import HeldResult, PrefetchResults
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.testing.ports import free_port
from lmcache_tiers.testing.server import ServerHarness
from lmcache_tiers.wire import protocol as p

Factory = Callable[..., TiersServer]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

PREFIX = "lmcache_tiers_"
#: chunk sizes of the mix
SIZES = (40_000, 150_000, 600_000)
#: a chunk over the whole L1 (10 MiB): its store is always refused
OVER_SIZE = 12 << 20
KEY_POOL = 48
ADAPTERS = ("0:fault_inject", "1:mock")


def scrape(server: TiersServer) -> Samples:
    with urllib.request.urlopen(f"{server.http_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((PREFIX + name, tuple(sorted(labels.items()))), 0.0)


def families(found: Samples, family: str) -> dict[str, float]:
    """A counter family's samples by their ``reason`` label."""
    return {
        dict(labels)["reason"]: count for (name, labels), count in found.items() if name == PREFIX + family
    }


def failures(found: Samples) -> dict[str, float]:
    return families(found, "failures_total")


@dataclass
class Tally:
    """What the clients saw."""

    stored: int = 0  # keys newly stored (the STORE replies)
    stored_for_l2: int = 0  # of them, not kept out of L2 (``l1_only``)
    storing_requests: int = 0  # STOREs that stored at least one key
    refused_requests: Counter[str] = field(default_factory=Counter)  # error code -> requests
    store_keys_sent: int = 0  # keys the STOREs named (reserved, or sent inline)
    refused_store_keys: Counter[str] = field(default_factory=Counter)  # error code -> keys
    cleared: int = 0  # objects the CLEAR replies said they deleted
    forced_clears: int = 0
    evicted: int = 0  # objects the EVICT replies said they deleted
    lookups: int = 0
    lookup_keys: int = 0
    hits: int = 0
    retrieves: int = 0
    retrieved_chunks: int = 0
    retrieved_bytes: int = 0
    requests: Counter[str] = field(default_factory=Counter)  # by op
    walked_away: int = 0  # clients that left holding locks or reservations
    abandoned_reservations: int = 0  # keys reserved by clients that never committed them
    abandoned_locks: int = 0  # objects read-locked by clients that never released them


def key(index: int) -> ObjectKey:
    return ObjectKey("books", 0, b"k%03d" % index)


def payload(rng: random.Random, size: int) -> bytes:
    return bytes([rng.randrange(256)]) * size


def store(client: Client, rng: random.Random, tally: Tally) -> None:
    count = rng.randint(1, 5)
    keys = [key(rng.randrange(KEY_POOL)) for _ in range(count)]
    keys = list(dict.fromkeys(keys))  # a request names each key once
    over = rng.random() < 0.08
    l1_only = rng.random() < 0.15
    sizes = [OVER_SIZE if over and i == 0 else rng.choice(SIZES) for i in range(len(keys))]
    tally.store_keys_sent += len(keys)
    try:
        stored = client.store(keys, [payload(rng, size) for size in sizes], l1_only=l1_only)
    except ServerError as refused:
        tally.refused_requests[refused.code.name.lower()] += 1
        tally.refused_store_keys[refused.code.name.lower()] += len(keys)
    else:
        tally.stored += stored
        tally.stored_for_l2 += 0 if l1_only else stored
        tally.storing_requests += stored > 0


def lookup(client: Client, rng: random.Random, tally: Tally) -> None:
    start = rng.randrange(KEY_POOL)
    keys = [key((start + i) % KEY_POOL) for i in range(rng.randint(1, 6))]
    hits = client.lookup(keys)
    tally.lookups += 1
    tally.lookup_keys += len(keys)
    tally.hits += hits
    if hits and rng.random() < 0.6:
        with client.retrieve(keys[:hits]) as views:
            assert len(views) == hits
            tally.retrieves += 1
            tally.retrieved_chunks += len(views)
            tally.retrieved_bytes += sum(memoryview(view).nbytes for view in views)
    elif hits:
        client.release(keys[:hits])


def walk_away(endpoint: str, rng: random.Random, tally: Tally) -> None:
    """A client that leaves mid-work: it holds a lookup's read locks, or a reservation it
    never commits, and disconnects.  Each one's locks are on keys no other one locks, so
    each object's expiry is its own."""
    window = tally.walked_away * 3
    tally.walked_away += 1
    fresh: list[ObjectKey] = []
    client = Client(endpoint)
    tally.requests["Hello"] += 1
    try:
        if window + 3 <= KEY_POOL and rng.random() < 0.5:
            keys = [key(index) for index in range(window, window + 3)]
            hits = client.lookup(keys)
            tally.hits += hits
            tally.lookups += 1
            tally.lookup_keys += len(keys)
            tally.abandoned_locks += hits
        else:
            fresh = [ObjectKey("books", 0, b"abandoned%d" % tally.walked_away)]
            tally.store_keys_sent += len(fresh)
            reply = client._call(p.StoreReserve(0, "", fresh, [SIZES[0]], [""]), p.StoreReserveReply)
            tally.abandoned_reservations += sum(slot.offset != p.NO_SLOT for slot in reply.slots)
    except ServerError as refused:
        tally.refused_requests[refused.code.name.lower()] += 1
        if fresh:
            tally.refused_store_keys[refused.code.name.lower()] += len(fresh)
    finally:
        client.close()


def drive(server: TiersServer, seed: int, operations: int = 200, *, force_clears: bool = True) -> Tally:
    rng = random.Random(seed)
    tally = Tally()
    with Client(server.endpoint) as client:
        tally.requests["Hello"] += 1
        for _ in range(operations):
            roll = rng.random()
            if roll < 0.55:
                store(client, rng, tally)
            elif roll < 0.85:
                lookup(client, rng, tally)
            elif roll < 0.90:
                tally.evicted += client.evict([key(rng.randrange(KEY_POOL)) for _ in range(3)])
                tally.requests["Evict"] += 1
            elif roll < 0.93:
                force = force_clears and rng.random() < 0.5
                tally.cleared += client.clear(force=force)
                tally.forced_clears += force
                tally.requests["Clear"] += 1
            else:
                walk_away(server.endpoint, rng, tally)
    return tally


def idle(server: TiersServer, within_s: float = 20.0) -> Samples:
    """The scrape once the server has nothing left to do: every store settled, every lock
    and reservation of the clients gone (released, or reaped by the TTL sweeps)."""
    deadline = time.monotonic() + within_s
    while True:
        assert server.storage.flush(timeout=within_s)
        found = scrape(server)
        busy = {
            name: value(found, name, **labels)
            for name, labels in (
                ("l1_read_locks", {}),
                ("l1_write_locked", {}),
                ("client_locked_keys", {}),
                ("l1_lapsed_objects", {}),
                *(("in_flight", {"kind": kind}) for kind in _IN_FLIGHT),
            )
            if value(found, name, **labels)
        }
        # The reservations of clients that walked away stay fenced: their process (this
        # one) lives on, and might still copy into them.
        unfenced = value(found, "l1_quarantined_bytes") - value(found, "l1_fenced_bytes")
        if unfenced:
            busy["l1_quarantined_bytes (not fenced)"] = unfenced
        if not busy:
            return found
        assert time.monotonic() < deadline, f"never idle: {busy}"
        server.storage.l1_eviction.wake()  # its next step reaps what expired since
        time.sleep(0.1)


_IN_FLIGHT = ("l2_prefetches", "l2_stores", "client_prefetches", "client_stores", "pool_requests")


def _hits_of_results_nobody_claimed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The hit counts of the prefetch results given back unclaimed (expired, or dropped
    past the bound), as the server gives them back."""
    unclaimed: list[int] = []
    count = PrefetchResults._count

    def counted(results: PrefetchResults, reason: str, held: list[HeldResult], why: str) -> None:
        unclaimed.extend(result.hits for result in held)
        count(results, reason, held, why)

    monkeypatch.setattr(PrefetchResults, "_count", counted)
    return unclaimed


def books_server(
    make_server: Factory, tmp_path: Path, prefetch_policy: str, *, inline: bool = False
) -> TiersServer:
    faulty_fs = {
        "type": "fault_inject",
        "seed": 7,
        "store_fail_rate": 0.15,
        "load_fail_rate": 0.15,
        "inner": {"type": "fs", "path": str(tmp_path / "fs")},
    }
    small_mock = {"type": "mock", "max_size_gb": 0.005}
    server = make_server(
        adapters=[json.dumps(faulty_fs), json.dumps(small_mock)],
        l1_size_gb=0.01,
        l1_lock_ttl_s=0.3,
        l1_write_ttl_s=0.3,
        l2_prefetch_policy=prefetch_policy,
        metrics_port=free_port(),
        # inline: clients send bytes with STORE_INLINE (reservations are then refused)
        no_shm=inline,
    )
    return server


@pytest.mark.parametrize(
    ("prefetch_policy", "data_plane"), [("default", "shm"), ("retain", "shm"), ("default", "inline")]
)
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_books_balance(
    make_server: Factory,
    tmp_path: Path,
    seed: int,
    prefetch_policy: str,
    data_plane: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = books_server(make_server, tmp_path, prefetch_policy, inline=data_plane == "inline")
    unclaimed = _hits_of_results_nobody_claimed(monkeypatch)
    # odd seeds clear by force too, even ones leave locked objects to their readers
    tally = drive(server, seed, force_clears=seed % 2 == 1)
    found = idle(server)
    failed = failures(found)

    # Every key a client stored is one L1 wrote, and one the front end counted.
    assert value(found, "keys_written_total") == tally.stored
    assert value(found, "store_chunks_total") == tally.stored

    assert value(found, "stores_total") == tally.storing_requests
    # Requests by op: each client's HELLO, each CLEAR and EVICT, each LOOKUP and RETRIEVE.
    tally.requests.update(Lookup=tally.lookups, Retrieve=tally.retrieves)
    for op, requests in tally.requests.items():
        assert value(found, "requests_total", frontend="0:native", op=op) == requests, op

    # Every refused request is counted under its reason by the front end.
    for reason, requests in tally.refused_requests.items():
        assert failed.get(reason, 0) == requests, (reason, failed)

    # Every key a STORE named is accounted for: newly stored, skipped (L1 had it, or a
    # writer was filling it), or refused -- the request, or its commit -- or reserved by a
    # client that walked away (forgotten by the front end's sweep at the write TTL, each
    # key counted as ``store_reservation_expired``; L1 reaps it, among ``l1_lock_expired``).
    skipped = families(found, "store_keys_skipped_total")
    refused = families(found, "store_keys_refused_total")
    assert tally.store_keys_sent == (
        tally.stored + sum(skipped.values()) + sum(refused.values()) + tally.abandoned_reservations
    ), (tally.store_keys_sent, tally.stored, skipped, refused, tally.abandoned_reservations)
    for reason, keys in tally.refused_store_keys.items():
        assert refused.get(reason, 0) == keys, (reason, refused)
    # ``store_reservation_expired`` counts those walked-away keys, and also the keys of a
    # commit that came after the sweep forgot its reservation (a slow client, on a loaded
    # machine, under these 0.3 s TTLs): those are counted twice, refused too, as
    # ``reservation_lost``.  So the books balance from /metrics alone only up to those.
    expired_reservations = failed.get("store_reservation_expired", 0)
    assert (
        tally.abandoned_reservations
        <= expired_reservations
        <= tally.abandoned_reservations + refused.get("reservation_lost", 0)
    ), (expired_reservations, tally.abandoned_reservations, refused)
    # one client stores at a time, and the walk-aways reserve keys of their own
    assert skipped.get("being_written", 0) == 0, skipped

    # L1 refused each of them under its own reason too: no room to be made, or none made.
    assert failed.get("out_of_memory", 0) == failed.get("l1_write_oom", 0) + failed.get(
        "l1_write_cannot_fit", 0
    )
    # What clients read is what the front end says it handed out.
    assert value(found, "retrieves_total") == tally.retrieves
    assert value(found, "retrieve_chunks_total") == tally.retrieved_chunks
    assert value(found, "keys_read_total") == tally.retrieved_chunks
    assert value(found, "bytes_total", direction="retrieve") == tally.retrieved_bytes

    # Lookups: as many as asked, keys as asked, hits as answered.
    assert value(found, "lookups_total") == tally.lookups
    assert value(found, "lookup_keys_total") == tally.lookup_keys
    hits = value(found, "lookup_hit_chunks_total", tier="l1") + value(
        found, "lookup_hit_chunks_total", tier="l2"
    )
    # Hits a prefetch found are counted as it ends (one given up with no result, still
    # queued or loading at its deadline, counts none); those of a result nobody claimed in
    # time were never answered (under these 0.3 s TTLs a LOOKUP waiting for its prefetch on
    # a loaded machine may reach the result after it expired, and is answered 0 hits).
    assert hits == tally.hits + sum(unclaimed), (hits, tally.hits, unclaimed)

    # Clients that left: each object they kept locked, and each reservation they never
    # committed, is reaped once at its TTL, and counted -- unless a forced CLEAR took the
    # object first: its locks then end with its quarantine (counted there, "forced").
    abandoned = tally.abandoned_locks + tally.abandoned_reservations
    expired = failed.get("l1_lock_expired", 0)
    assert expired <= abandoned <= expired + value(found, "l1_quarantined_total", reason="forced")
    # Every extent held back for a reader whose lock expired is given back by now; those
    # of walked-away reservations stay fenced (their client's process is this one).
    quarantined = sum(
        value(found, "l1_quarantined_total", reason=reason)
        for reason in ("forced", "dropped", "expired", "fenced")
    )
    reclaimed = sum(
        value(found, "l1_quarantine_reclaimed_total", how=how)
        for how in ("released", "lease_end", "writer_done")
    )
    still_fenced = value(found, "l1_quarantined_extents")
    assert quarantined == reclaimed + still_fenced
    assert still_fenced <= tally.abandoned_reservations

    # L1: what came in, less what went out, is what is there.  Objects loaded from L2 are
    # the slack: the default prefetch policy's are temporary, freed after their read (L2
    # still holds them), so at idle none is left -- unless a forced CLEAR took one a client
    # held, which its reply counts; ``retain`` keeps those it hands off, but one that
    # landed past a failed load (the hit prefix ends there) is freed uncounted, and
    # ``adapter_keys_loaded_total`` counts it all the same.
    loaded = sum(value(found, "adapter_keys_loaded_total", adapter=name) for name in ADAPTERS)
    left_unasked = sum(
        failed.get(reason, 0)
        for reason in ("prefetch_loaded_object_lost", "l1_nvme_read_error", "l1_nvme_writeback_dropped")
    )
    written_and_left = (
        tally.stored
        - value(found, "evictions_total", tier="l1")
        - value(found, "l1_deleted_after_store_total")
        - tally.cleared
        - tally.evicted
        - left_unasked
    )
    objects = value(found, "l1_objects")
    assert objects == len(server.storage.l1)
    assert written_and_left <= objects <= written_and_left + loaded
    if prefetch_policy == "default" and not tally.forced_clears:
        assert objects == written_and_left

    # The bytes gauge is the resident objects' extents (L1 allocates whole pages), and
    # the fenced ones of walked-away reservations.
    l1 = server.storage.l1
    with l1.lock:
        extents = sum(l1._allocator.extent_size(obj.size) for obj in l1._table.objects.values())
    assert value(found, "l1_used_bytes") == extents + value(found, "l1_fenced_bytes")

    # L2 stores: each committed key was bound for each adapter, and is stored there,
    # failed there, or skipped because it left L1 first.
    settled = sum(
        value(found, "adapter_keys_stored_total", adapter=name)
        + value(found, "adapter_keys_store_failed_total", adapter=name)
        for name in ADAPTERS
    )
    assert settled + value(found, "l2_store_skipped_gone_total") == tally.stored_for_l2 * len(ADAPTERS)
    store_failed = sum(value(found, "adapter_keys_store_failed_total", adapter=name) for name in ADAPTERS)
    assert failed.get("l2_store_failed", 0) + failed.get("l2_store_submit_error", 0) == store_failed
    for name in ADAPTERS:
        assert value(found, "adapter_store_tasks_submitted_total", adapter=name) == value(
            found, "adapter_store_tasks_completed_total", adapter=name
        )
        # the engine's counters of an adapter and the adapter's own agree
        assert value(found, "adapter_keys_stored_total", adapter=name) == value(
            found, "adapter_stat", adapter=name, stat="store_keys_ok"
        )
        assert value(found, "adapter_keys_store_failed_total", adapter=name) == value(
            found, "adapter_stat", adapter=name, stat="store_keys_failed"
        )
        # loads: every key a load was asked for is loaded or failed
        assert value(found, "adapter_keys_loaded_total", adapter=name) + value(
            found, "adapter_keys_load_failed_total", adapter=name
        ) == value(found, "adapter_stat", adapter=name, stat="load_keys_ok") + value(
            found, "adapter_stat", adapter=name, stat="load_keys_failed"
        )
        # idle: nothing pinned, no task pending
        assert value(found, "adapter_stat", adapter=name, stat="pinned_keys") == 0
        assert value(found, "adapter_stat", adapter=name, stat="pending_tasks") == 0
    # lookups the engine asked of an adapter are the batches it answered, at once or as
    # tasks; the keys they found are its hits
    for name in ADAPTERS:
        stat = {
            key: value(found, "adapter_stat", adapter=name, stat=key)
            for key in ("lookup_tasks", "lookups_answered_now", "lookup_hits")
        }
        assert value(found, "adapter_lookups_total", adapter=name) == (
            stat["lookup_tasks"] + stat["lookups_answered_now"]
        ), (name, stat)
        assert value(found, "adapter_keys_found_total", adapter=name) == stat["lookup_hits"], (name, stat)
    # prefetches: a key loaded was found first; an L2 hit handed to a client was loaded
    found_keys = sum(value(found, "adapter_keys_found_total", adapter=name) for name in ADAPTERS)
    load_failed = sum(value(found, "adapter_keys_load_failed_total", adapter=name) for name in ADAPTERS)
    assert loaded + load_failed <= found_keys
    assert value(found, "lookup_hit_chunks_total", tier="l2") <= loaded
    load_failed = sum(value(found, "adapter_keys_load_failed_total", adapter=name) for name in ADAPTERS)
    assert failed.get("l2_load_failed", 0) == load_failed


def adapter_books(found: Samples, name: str) -> dict[str, float]:
    return {
        "used_bytes": value(found, "adapter_used_bytes", adapter=name),
        "objects": value(found, "adapter_stat", adapter=name, stat="objects"),
    }


def scanned(server: TiersServer, name: str, within_s: float = 20.0) -> Samples:
    """The scrape once the adapter's listing at start-up is done."""
    deadline = time.monotonic() + within_s
    while True:
        found = scrape(server)
        if value(found, "adapter_stat", adapter=name, stat="scan_running") == 0:
            return found
        assert time.monotonic() < deadline, "the start-up listing never ended"
        time.sleep(0.05)


@pytest.mark.parametrize("seed", [5, 6])
def test_an_adapters_usage_is_what_its_listing_finds_after_a_restart(tmp_path: Path, seed: int) -> None:
    """What an adapter says it holds (bytes, objects) is what a restarted server's listing
    of it finds: none of its accounting is of objects that are not there, or the other way."""
    faulty_fs = json.dumps(
        {
            "type": "fault_inject",
            "seed": seed,
            "store_fail_rate": 0.2,
            "inner": {"type": "fs", "path": str(tmp_path / "fs")},
        }
    )
    name = "0:fault_inject"
    settings = {"adapters": [faulty_fs], "l1_size_gb": 0.01, "l1_lock_ttl_s": 0.3, "l1_write_ttl_s": 0.3}
    first = ServerHarness()
    try:
        server = first.make(**settings, metrics_port=free_port())
        drive(server, seed)
        before = adapter_books(idle(server), name)
    finally:
        first.close()
    assert before["objects"] > 0
    second = ServerHarness()
    try:
        found = scanned(second.make(**settings, metrics_port=free_port()), name)
    finally:
        second.close()
    after = adapter_books(found, name)
    assert after == before
    assert value(found, "adapter_stat", adapter=name, stat="scan_keys") == after["objects"]
    assert value(found, "adapter_stat", adapter=name, stat="scan_bytes") == after["used_bytes"]
