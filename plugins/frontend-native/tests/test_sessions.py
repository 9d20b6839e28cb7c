from __future__ import annotations

import math
import random
import sys
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import pytest
from lmcache_plugin_frontend_native import handlers as handlers_module
from lmcache_plugin_frontend_native import sessions
from lmcache_plugin_frontend_native.handlers import DataPlane, Handlers
from lmcache_plugin_frontend_native.sessions import INDEX_BACKLOG_KEYS, PendingPrefetch, SessionTable

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1 import reads as l1_reads
from lmcache_tiers.l1 import writes as l1_writes
from lmcache_tiers.plugin import FrontendStats
from lmcache_tiers.plugin import wire_protocol as p

A, B, C = (ObjectKey("m", 0, bytes([i]) * 8) for i in (1, 2, 3))


def reserved(name: str, extent_bytes: int = 4096) -> types.SimpleNamespace:
    """What L1 reserves for a key, as far as a session looks at it."""
    return types.SimpleNamespace(name=name, extent_bytes=extent_bytes)


def test_locks_are_counted_and_grouped_by_count() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"client", now=0.0)
    session.add_read_locks([A, B], deadline=10.0)  # a lookup
    session.add_read_locks([A], deadline=12.0)  # a retrieve of the first key
    # grouped by count and the earliest deadline, which L1 is told of the locks it drops
    assert session.take_read_locks([A, B, C], now=5.0) == {(2, 10.0): [A], (1, 10.0): [B]}
    assert session.take_read_locks([A, B], now=5.0) == {}  # nothing held twice


def test_each_lock_expires_at_its_own_deadline() -> None:
    # L1 reaps each lock at its own deadline: a count outliving one of them would make
    # the release drop another client's lock.
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"client", now=0.0)
    session.add_read_locks([A, B], deadline=10.0)
    session.add_read_locks([A, B], deadline=12.0)  # folded into the same record
    session.add_read_locks([A], deadline=13.0)
    assert session.take_read_locks([A, B], now=11.0) == {(2, 12.0): [A], (1, 12.0): [B]}
    session.add_read_locks([A], deadline=10.0)
    session.add_read_locks([A], deadline=21.0)  # the same keys: one record, two deadlines
    table.sweep(now=11.0)
    assert session.lock_deadlines == {A: {21.0: 1}}


def test_expired_locks_are_forgotten_not_released() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"client", now=0.0)
    session.add_read_locks([A], deadline=10.0)
    session.add_read_locks([B], deadline=30.0)
    # L1 reaped A's lock at its TTL: releasing it now could drop somebody else's lock
    assert session.take_read_locks([A, B], now=11.0) == {(1, 30.0): [B]}


def test_writes_belong_to_the_session_that_reserved_them() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    mine, theirs = table.get(b"one", 0.0), table.get(b"two", 0.0)
    mine.add_writes({A: reserved("a"), B: reserved("b")}, deadline=20.0)
    assert theirs.take_writes([A], now=1.0) == ({}, [False])
    assert mine.take_writes([B, C, A], now=1.0) == ({B: reserved("b"), A: reserved("a")}, [True, False, True])
    mine.add_writes({C: reserved("c")}, deadline=20.0)
    assert mine.take_writes([C], now=25.0) == ({}, [False])  # reaped by the write TTL


def test_sweep_drops_idle_empty_sessions_and_expired_records() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20, idle_s=60)
    busy = table.get(b"busy", 0.0)
    busy.add_read_locks([A], deadline=10.0)
    busy.prefetches[3] = PendingPrefetch([A], started=0.0, deadline=10.0)
    table.get(b"idle", 0.0)
    table.sweep(now=11.0)
    assert table.peek(b"idle") is not None and not busy.read_locks
    assert table.gauges(now=11.0) == (2, 0, 0, 1)
    busy.prefetches.clear()
    table.sweep(now=61.0)
    assert len(table) == 0


class _EagerLocks:
    """The per-key bookkeeping updated on every call: what a session must be equivalent to."""

    def __init__(self) -> None:
        self.deadlines: dict[ObjectKey, list[float]] = {}

    @property
    def counts(self) -> Counter[ObjectKey]:
        return Counter({key: len(held) for key, held in self.deadlines.items()})

    def add(self, keys: list[ObjectKey], deadline: float) -> None:
        for key in keys:
            self.deadlines.setdefault(key, []).append(deadline)
            self.deadlines[key].sort()

    def take(self, keys: list[ObjectKey], now: float) -> dict[tuple[int, float], list[ObjectKey]]:
        groups: dict[tuple[int, float], list[ObjectKey]] = {}
        for key in keys:
            live = [deadline for deadline in self.deadlines.pop(key, []) if deadline > now]
            if live:
                groups.setdefault((len(live), min(live)), []).append(key)
        return groups

    def take_one(self, keys: list[ObjectKey], now: float) -> dict[float, list[ObjectKey]]:
        taken: dict[float, list[ObjectKey]] = {}
        for key in dict.fromkeys(keys):
            live = [deadline for deadline in self.deadlines.pop(key, []) if deadline > now]
            if live:
                taken.setdefault(live[0], []).append(key)  # sorted: the earliest
                if live[1:]:
                    self.deadlines[key] = live[1:]
        return taken

    def expire(self, now: float) -> None:
        for key, held in list(self.deadlines.items()):
            held[:] = [deadline for deadline in held if deadline > now]
            if not held:
                del self.deadlines[key]


def _deadline_apart(rng: random.Random, now: float) -> float:
    # a collected prefetch's deadline can be earlier than the last lock's
    return now + (10 if rng.random() < 0.8 else rng.uniform(-2, 10))


def _deadline_on_l1_grid(rng: random.Random, now: float) -> float:
    # L1's deadlines for a 1 s lock TTL: requests a few ms apart share one; a collected
    # prefetch's is its LOOKUP's, earlier, maybe expired
    started = now if rng.random() < 0.8 else now - rng.uniform(0, 1.2)
    return l1_reads.read_lock_deadline(started, 1.0)


@pytest.mark.parametrize(
    ("clock_step", "deadline_of"),
    [(1.0, _deadline_apart), (0.01, _deadline_on_l1_grid)],
    ids=["deadlines-apart", "deadlines-shared"],
)
def test_lock_records_match_per_key_bookkeeping_under_any_sequence(
    clock_step: float, deadline_of: Callable[[random.Random, float], float]
) -> None:
    # Sharing deadlines, records of the same counts are indexed together (one pass over
    # the keys they name between them): that must still count every lock of every key.
    rng = random.Random(16)
    pool = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(40)]
    for _ in range(30):
        session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
        model = _EagerLocks()
        now, previous = 0.0, pool[:4]
        for _ in range(300):
            now += rng.random() * clock_step
            action = rng.random()
            if action < 0.6:
                if rng.random() < 0.4:
                    keys = list(previous)  # equal keys again (a repeated lookup), not the same list
                else:
                    start = rng.randrange(len(pool))
                    keys = pool[start : start + rng.randrange(1, 12)]
                    if rng.random() < 0.2:
                        keys = keys + keys[:2]  # a retrieve may list a key twice
                deadline = deadline_of(rng, now)
                session.add_read_locks(keys, deadline)
                model.add(keys, deadline)
                previous = keys
            elif action < 0.85:
                draw = rng.random()
                if draw < 0.4:
                    # the keys just locked (a release after a lookup or retrieve), possibly
                    # from a fresh session record alone, possibly listing a key twice
                    wanted = list(previous)
                elif draw < 0.55:
                    wanted = list(pool)  # everything: the next locks start a fresh record
                else:
                    wanted = rng.sample(pool, rng.randrange(1, 10))
                if rng.random() < 0.25:  # a RELEASE of what one request took
                    assert dict(session.take_one_read_lock(wanted, now)) == model.take_one(wanted, now)
                else:
                    assert dict(session.take_read_locks(wanted, now)) == model.take(wanted, now)
            else:
                session.expire(now)
                model.expire(now)
                assert session.empty == (not model.counts)
            assert session.locked_keys == len(model.deadlines)  # the client_locked_keys gauge
        assert session.read_locks == model.counts
        assert session.lock_deadlines == {key: dict(Counter(held)) for key, held in model.deadlines.items()}


class _CountedGets(dict):  # type: ignore[type-arg]
    """A session's per-key locks that count the keys looked up in them one at a time."""

    gets = 0

    def get(self, *args):  # type: ignore[no-untyped-def]
        _CountedGets.gets += 1
        return super().get(*args)


def test_lookups_of_overlapping_prefixes_visit_each_key_once_per_indexing() -> None:
    # An engine looking up a new prompt each step sends prefixes that overlap the last
    # ones: indexing their records must visit each key once, not once per record naming it.
    session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
    pool = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(1024)]
    session.add_read_locks(pool[:512], 10.0)
    session.lock_deadlines  # noqa: B018 -- indexed: the next records overlap held keys
    session._locks = _CountedGets(session._locks)
    _CountedGets.gets = 0
    for start in range(1, 9):
        session.add_read_locks(pool[start : start + 512], 10.0)
    session.lock_deadlines  # noqa: B018
    assert _CountedGets.gets <= 512 + 8
    assert session.read_locks == Counter(
        {key: min(index + 1, 9, 520 - index) for index, key in enumerate(pool[:520])}
    )


def test_a_key_holding_one_lock_keeps_no_dict_of_its_own() -> None:
    # A LOOKUP's keys each hold one lock: a dict per key would cost ~200 bytes each.
    session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
    keys = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(2 * INDEX_BACKLOG_KEYS)]
    for start in range(0, len(keys), 256):
        session.add_read_locks(keys[start : start + 256], 10.0)
    session.add_read_locks(keys[:1], 11.0)  # a second lock: this key gets its counts
    assert session.lock_deadlines[keys[0]] == {10.0: 1, 11.0: 1}
    assert session.lock_deadlines[keys[1]] == {10.0: 1}
    assert sum(isinstance(held, dict) for held in session._locks.values()) == 1


def test_records_of_one_deadline_add_to_whatever_each_key_holds() -> None:
    # Indexing records that all lock at one deadline (the usual case) takes a shorter path
    # per key: a key holding nothing, one lock at that deadline or another, or counts
    # already, and named once, several times by one record, or by several records.
    session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
    a, b, c, d, e = (ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(5))
    session.add_read_locks([a], 20.0)
    session.add_read_locks([b], 10.0)
    session.add_read_locks([c, c], 20.0)
    session.lock_deadlines  # noqa: B018 -- a: 20.0 alone, b: 10.0 alone, c: {20.0: 2}
    session.add_read_locks([a, b, c, d], 20.0)
    session.add_read_locks([a, d, e, e], 20.0)
    session.add_read_locks([a, d, e, e], 20.0)  # the same keys again: one record, two locks
    assert session.lock_deadlines == {
        a: {20.0: 4},
        b: {10.0: 1, 20.0: 1},
        c: {20.0: 3},
        d: {20.0: 3},
        e: {20.0: 4},
    }
    assert session.take_read_locks([b], now=5.0) == {(2, 10.0): [b]}


def test_a_lock_filed_under_an_earlier_deadline_lives_to_its_own() -> None:
    # A lock forgotten as expired by a RELEASE of one lock leaves its key filed under the
    # old deadline; a lock the key took since must outlive that deadline's sweep.
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"client", now=0.0)
    session.add_read_locks([A, B], 10.0)
    session.lock_deadlines  # noqa: B018 -- indexed and filed under 10.0
    assert session.take_one_read_lock([A], now=11.0) == {}  # expired: forgotten only
    session.add_read_locks([A], 30.0)
    session.lock_deadlines  # noqa: B018
    table.sweep(now=12.0)
    assert session.lock_deadlines == {A: {30.0: 1}}
    assert session.take_read_locks([A], now=12.0) == {(1, 30.0): [A]}


def test_repeated_lookups_of_one_prefix_keep_one_record_and_count_every_lock() -> None:
    session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
    for step in range(1000):
        session.add_read_locks([A, B], deadline=10.0 + step)
    assert session.take_read_locks([A, B], now=5.0) == {(1000, 10.0): [A, B]}


def test_unindexed_lock_records_stay_bounded() -> None:
    session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
    keys = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(3 * INDEX_BACKLOG_KEYS)]
    for start in range(0, len(keys), 16):
        session.add_read_locks(keys[start : start + 16], deadline=10.0)
        assert session._backlog <= INDEX_BACKLOG_KEYS
    assert len(session.read_locks) == len(keys)


def test_sessions_holding_nothing_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # Identities are the peers' choice: one that keeps coming back under new ones must not
    # make the table (and every sweep) grow for the whole idle time.
    monkeypatch.setattr(sessions, "MAX_EMPTY_SESSIONS", 4, raising=False)
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20, idle_s=60)
    busy = table.get(b"busy", 0.0)
    busy.add_read_locks([A], deadline=100.0)
    for index in range(10):
        table.get(b"peer-%d" % index, now=1.0 + index)
    table.sweep(now=11.0)
    assert table.peek(b"busy") is busy  # holds something: kept, however old
    assert sorted(session.identity for session in table if session is not busy) == [
        b"peer-%d" % index for index in range(6, 10)
    ]


def test_releasing_once_drops_one_lock_per_key_and_forgets_expired_ones() -> None:
    session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
    session.add_read_locks([A, B], deadline=10.0)  # a lookup
    session.add_read_locks([A], deadline=12.0)  # a retrieve of the first key
    session.add_read_locks([C], deadline=4.0)
    # a key named twice goes once, as L1 locked it; C's lock was reaped, so only forgotten;
    # the lock forgotten is the one expiring first, as L1 drops it
    assert session.take_one_read_lock([A, A, B, C], now=5.0) == {10.0: [A, B]}
    assert session.read_locks == {A: 1}
    assert session.take_read_locks([A, B, C], now=5.0) == {(1, 12.0): [A]}


# -- the sessions and L1 together: every client's locks counted alike by both --------------

LOCK_TTL = 10.0


class _L1Storage:
    """What the handlers use of a StorageManager for LOOKUP and RELEASE, on a bare L1."""

    def __init__(self, l1: L1Manager) -> None:
        self.l1 = l1

    def start_prefetch(
        self, keys: Sequence[ObjectKey], *, readers: int = 1, owner_expires: bool = False
    ) -> tuple[int, list[ObjectKey]]:
        return 0, [obj.key for obj in self.l1.reserve_read_prefix(keys, readers, until_repeat=True)]

    def release(self, keys: Sequence[ObjectKey], count: int = 1) -> None:
        self.l1.finish_read(keys, count)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic clock of the handlers and of L1's read locks, set by the test; it starts
    on the lock-deadline grid (a 64th of the TTL), so that a lock taken then expires exactly
    its TTL later."""
    step = LOCK_TTL / 64
    now = [math.ceil(time.monotonic() / step) * step]
    fake = types.SimpleNamespace(monotonic=lambda: now[0])
    monkeypatch.setattr(handlers_module, "time", fake)
    monkeypatch.setattr(l1_reads, "time", fake)
    return now


@pytest.fixture
def served() -> Iterator[tuple[Handlers, L1Manager]]:
    l1 = L1Manager(16 * 4096, lock_ttl_s=LOCK_TTL, write_ttl_s=2 * LOCK_TTL, prefault=False)
    l1.reserve_write([A], [4096])
    l1.finish_write([A])
    handlers = Handlers(
        _L1Storage(l1),  # type: ignore[arg-type]
        chunk_size=256,
        data_plane=DataPlane(),
        stats=FrontendStats(),
        status_provider=dict,
        max_inline_bytes=1 << 20,
    )
    yield handlers, l1
    l1.close()


def _lookup(handlers: Handlers, client: bytes) -> None:
    response = handlers.lookup(p.Lookup(1, "", [A]), client, ())
    assert isinstance(response, tuple)  # answered at once: everything is in L1
    reply, _ = response
    assert isinstance(reply, p.LookupReply) and reply.hits == 1


def _release(handlers: Handlers, client: bytes) -> int:
    reply, _ = handlers.release(p.Release(2, "", [A]), client, ())
    assert isinstance(reply, p.ReleaseReply)
    return reply.released


def test_a_vanished_clients_lock_is_reaped_while_others_keep_locking_the_key(
    served: tuple[Handlers, L1Manager], clock: list[float]
) -> None:
    # A hot prefix: a client looks it up and releases it every step.  The lock of a
    # client that vanished meanwhile must still go at its deadline, not live on in place
    # of the locks the others release.
    handlers, l1 = served
    obj = l1.get(A)
    assert obj is not None
    start = clock[0]
    _lookup(handlers, b"vanished")
    for step in range(1, 41):
        clock[0] = start + step * LOCK_TTL / 8
        _lookup(handlers, b"engine")
        assert _release(handlers, b"engine") == 1
        handlers.sessions.sweep(clock[0])
        l1.expire_locks(clock[0])
        assert obj.read_locks == (1 if step < 8 else 0), step


def test_a_relock_after_the_clients_own_lock_expired_counts_what_l1_holds(
    served: tuple[Handlers, L1Manager], clock: list[float]
) -> None:
    # The client's first lock expired (L1 reaps it) but neither the sweep nor the reaper
    # ran yet when it locks the key again: its session must count one live lock, as L1
    # holds for it, or its release would drop another client's.
    handlers, l1 = served
    obj = l1.get(A)
    assert obj is not None
    start = clock[0]
    _lookup(handlers, b"one")
    clock[0] = start + LOCK_TTL + 1
    _lookup(handlers, b"one")
    _lookup(handlers, b"two")
    assert _release(handlers, b"one") == 1
    assert obj.read_locks == 2  # two's, and the expired one until the reaper runs
    assert l1.expire_locks(clock[0]) == 1  # the expired one, at its deadline
    assert obj.read_locks == 1  # two's, until its own deadline
    assert l1.expire_locks(start + 2 * LOCK_TTL) == 0
    assert _release(handlers, b"two") == 1
    assert not obj.locked


def test_a_sessions_deadlines_are_never_later_than_l1s(served: tuple[Handlers, L1Manager]) -> None:
    # A session must not count on a lock L1 has reaped: its release would drop another's.
    # Every read lock L1 takes (a prefetch's loaded from L2 too) is on the lock grid at a
    # time after the one the session's deadline is computed from.
    handlers, l1 = served
    table = handlers.sessions
    start = time.monotonic()
    for offset in range(-200, 200):
        now = start + offset * l1.lock_grid_s / 7
        assert table.read_lock_deadline(now) == l1.lock_deadline(now)
        assert table.prefetch_lock_deadline(now) == l1.lock_deadline(now)
        assert table.read_lock_deadline(now) <= l1.lock_deadline(now + l1.lock_grid_s / 3)


def test_locking_the_same_keys_again_and_again_keeps_a_count_per_deadline(clock: list[float]) -> None:
    # A client that looks the same keys up again and again over a whole TTL without
    # releasing them (buggy, or hostile): its session and L1 keep a count per deadline of
    # the lock grid (a 64th of the TTL), not an entry per lock, and agree on the count.
    many = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(512)]
    l1 = L1Manager(len(many) * 4096, lock_ttl_s=LOCK_TTL, write_ttl_s=2 * LOCK_TTL, prefault=False)
    try:
        l1.reserve_write(many, [4096] * len(many))
        assert all(l1.finish_write(many))
        handlers = Handlers(
            _L1Storage(l1),  # type: ignore[arg-type]
            chunk_size=256,
            data_plane=DataPlane(),
            stats=FrontendStats(),
            status_provider=dict,
            max_inline_bytes=1 << 20,
        )
        start = clock[0]
        for step in range(10_000):
            clock[0] = start + step * LOCK_TTL / 10_000
            response = handlers.lookup(p.Lookup(1, "", many), b"client", ())
            assert isinstance(response, tuple)  # answered at once: everything is in L1
            reply, _ = response
            assert isinstance(reply, p.LookupReply) and reply.hits == len(many)
        session = handlers.sessions.peek(b"client")
        assert session is not None
        assert [len(counts) <= 66 for _keys, counts in session._records] == [True]
        assert session.read_locks == Counter(dict.fromkeys(many, 10_000))
        assert max(len(held) for held in session.lock_deadlines.values()) <= 66
        objs = [l1.get(key) for key in many]
        for obj in objs:
            assert obj is not None and obj.read_locks == 10_000
            assert len(obj.lock_groups or ()) <= 2 * 66
        reply, _ = handlers.release(p.Release(2, "", many), b"client", ())
        assert isinstance(reply, p.ReleaseReply) and reply.released == len(many)
        assert not any(obj is not None and obj.locked for obj in objs)
        assert session.empty and l1.stats().read_locks == 0
    finally:
        l1.close()


# -- a randomized model: L1 and the sessions of several clients, side by side ---------------


class _ModelStorage(_L1Storage):
    """``_L1Storage`` with RETRIEVE's read."""

    def read(self, keys: Sequence[ObjectKey], *, generations: list[int] | None = None) -> list[object]:
        return list(self.l1.reserve_read_prefix(keys, generations=generations))


def _check_l1_structure(l1: L1Manager) -> None:
    """Every READY object's counts add up: readers per deadline, the store's, the total."""
    table = l1._table  # the test checks the manager's own bookkeeping
    for key, obj in table.objects.items():
        assert obj.read_locks >= obj.storing >= 0, key
        assert (key in table.locked) == obj.locked, key
        groups = obj.lock_groups
        if groups is None:
            continue
        deadlines, counts = groups[0::2], groups[1::2]
        assert len(groups) > 2 and deadlines == sorted(set(deadlines)), groups
        assert all(count > 0 for count in counts), groups
        assert obj.lock_deadline == deadlines[-1], groups
        assert obj.read_locks - obj.storing == sum(counts), (obj.read_locks, obj.storing, groups)


def _l1_readers_from(obj: object, floor: float) -> int:
    """How many readers' locks ``obj`` holds expiring at ``floor`` or later."""
    groups = obj.lock_groups  # type: ignore[attr-defined]
    readers = obj.read_locks - obj.storing  # type: ignore[attr-defined]
    if groups is None:
        return readers if obj.lock_deadline >= floor else 0  # type: ignore[attr-defined]
    return sum(
        int(count) for deadline, count in zip(groups[0::2], groups[1::2], strict=True) if deadline >= floor
    )


@pytest.mark.parametrize("seed", range(100))
def test_l1_and_sessions_agree_on_every_lock_under_any_sequence(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Several native clients (some of which stop releasing: vanished), a holder that
    # releases without telling L1 when its locks expire (another front end), and L2
    # stores and forced deletes, on a few keys, with a clock that moves between the
    # session's reading and L1's.  After every step: L1's counts add up, and for every
    # live deadline T, L1 holds at least as many readers' locks expiring at T or later as
    # every holder together counts on -- so no release ever drops a lock some holder
    # still counts.
    rng = random.Random(seed)
    ttl = 10.0
    step = ttl / 64
    now = [1000.0]

    def monotonic() -> float:
        now[0] += rng.choice((0.0, 0.0, rng.uniform(0, step)))
        return now[0]

    fake = types.SimpleNamespace(monotonic=monotonic)
    monkeypatch.setattr(handlers_module, "time", fake)
    monkeypatch.setattr(l1_reads, "time", fake)
    monkeypatch.setattr(l1_writes, "time", fake)
    many = [ObjectKey("m", 0, bytes([index]) * 8) for index in range(6)]
    l1 = L1Manager(256 * 4096, lock_ttl_s=ttl, write_ttl_s=2 * ttl, prefault=False)
    try:
        l1.reserve_write(many, [4096] * len(many))
        l1.finish_write(many)
        handlers = Handlers(
            _ModelStorage(l1),  # type: ignore[arg-type]
            chunk_size=256,
            data_plane=DataPlane(shm_name="model"),
            stats=FrontendStats(),
            status_provider=dict,
            max_inline_bytes=1 << 20,
        )
        clients = [b"c0", b"c1", b"c2", b"c3"]
        vanished: set[bytes] = set()
        other: list[tuple[ObjectKey, float]] = []  # the other front end's locks, its deadlines
        stores: list[list[object]] = []
        for _ in range(400):
            action = rng.random()
            client = rng.choice(clients)
            keys = rng.sample(many, rng.randint(1, len(many)))
            if action < 0.25:
                handlers.lookup(p.Lookup(1, "", keys), client, ())
            elif action < 0.4:
                handlers.retrieve(p.Retrieve(1, "", keys), client, ())
            elif action < 0.55 and client not in vanished:
                handlers.release(p.Release(2, "", keys), client, ())
            elif action < 0.62 and client not in vanished:
                handlers.release(p.Release(2, "", keys, once=True), client, ())
            elif action < 0.68:
                deadline = l1.lock_deadline(now[0])
                other += [(obj.key, deadline) for obj in l1.reserve_read_prefix(keys)]
            elif action < 0.74 and other:
                # given back with a margin before their deadline, as that front end does
                key, deadline = other.pop(rng.randrange(len(other)))
                if deadline > now[0] + step:
                    l1.finish_read([key])
            elif action < 0.78:
                stores.append(list(l1.reserve_store(keys).values()))
            elif action < 0.82 and stores:
                l1.finish_store(stores.pop(rng.randrange(len(stores))))
            elif action < 0.84:
                vanished.add(client)
            elif action < 0.86:  # deleted by force (its extent quarantined) and stored again
                victim = rng.choice(many)
                assert l1.delete([victim], force=True) == [True]
                l1.reserve_write([victim], [4096])
                assert l1.finish_write([victim]) == [True]
            elif action < 0.9:
                handlers.sessions.sweep(monotonic())
            elif action < 0.95:
                l1.expire_locks(monotonic())
            else:
                now[0] += rng.choice((step / 3, ttl / 4, ttl / 2, ttl))
            _check_l1_structure(l1)
            at = now[0]
            other = [(key, deadline) for key, deadline in other if deadline > at]
            for key in many:
                obj = l1.get(key)
                assert obj is not None
                counted: list[float] = [deadline for held, deadline in other if held == key]
                for session in handlers.sessions:
                    for deadline, count in session.lock_deadlines.get(key, {}).items():
                        if deadline > at:
                            counted += [deadline] * count
                # locks on an extent a forced delete quarantined are the key's too, until its lease ends
                quarantined = [(held.until, held.holders) for held in l1._leases._held.get(key, [])]
                for floor in sorted(set(counted)):
                    kept = _l1_readers_from(obj, floor) + sum(n for until, n in quarantined if until >= floor)
                    assert kept >= sum(1 for d in counted if d >= floor), (key, floor)
        for store in stores:
            l1.finish_store(store)
        handlers.release_everything()
        l1.expire_locks(now[0] + 3 * ttl)
        _check_l1_structure(l1)
        assert l1.stats().read_locks == 0
    finally:
        l1.close()


def _counted(compare: Callable[[float, object], bool]) -> Callable[[float, object], bool]:
    """``compare``, counted in ``_WatchedDeadline.comparisons``."""

    def counting(self: float, other: object) -> bool:
        _WatchedDeadline.comparisons += 1
        return compare(self, other)

    return counting


class _WatchedDeadline(float):
    """A deadline that counts how often it is compared: what a sweep looks at."""

    comparisons = 0

    __lt__ = _counted(float.__lt__)
    __le__ = _counted(float.__le__)
    __gt__ = _counted(float.__gt__)
    __ge__ = _counted(float.__ge__)
    __hash__ = float.__hash__
    __eq__ = float.__eq__


def _a_client_holding_a_thousand_of_each() -> tuple[SessionTable, sessions.Session, list[ObjectKey]]:
    """A table with one client holding 1000 locks (in ten records, deadlines 10.0 to 10.9)
    and 1000 reservations (deadlines 20 to 920), every deadline watched; and its locked keys."""
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"heavy", now=0.0)
    held = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(1000)]
    writes = [ObjectKey("w", 0, index.to_bytes(8, "big")) for index in range(1000)]
    for start in range(0, 1000, 100):
        session.add_read_locks(held[start : start + 100], _WatchedDeadline(10.0 + start / 1000))
        session.add_writes(
            dict.fromkeys(writes[start : start + 100], reserved("obj")), _WatchedDeadline(20.0 + start)
        )
    return table, session, held


def test_a_sweep_does_not_walk_what_a_client_holds_until_it_expires() -> None:
    # The sweep runs on the loop thread every 0.2 s: a client holding many live locks and
    # reservations must not make each sweep walk them all, stalling every other client.
    table, session, _ = _a_client_holding_a_thousand_of_each()
    _WatchedDeadline.comparisons = 0
    table.sweep(now=5.0)
    assert _WatchedDeadline.comparisons <= 4
    assert len(session.lock_deadlines) == 1000 and len(session.writes) == 1000
    table.sweep(now=10.25)  # the locks of the first three records, and none of the writes, expired
    assert len(session.lock_deadlines) == 700 and len(session.writes) == 1000
    table.sweep(now=121.0)  # the first two hundred writes expired
    assert not session.lock_deadlines and len(session.writes) == 800
    table.sweep(now=2000.0)
    # Expired uncommitted: kept fenced until the client commits or aborts them.
    assert not session.writes and len(session.fenced) == 1000
    session.take_fenced(list(session.fenced))
    assert session.empty


def test_reservations_given_out_of_deadline_order_still_expire_at_their_deadlines() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"client", now=0.0)
    session.add_writes({A: reserved("a")}, deadline=30.0)
    session.add_writes({B: reserved("b")}, deadline=10.0)
    session.add_writes({C: reserved("c")}, deadline=20.0)
    session.add_writes({A: reserved("a2")}, deadline=40.0)  # A reserved again: its new deadline counts
    table.sweep(now=15.0)
    assert session.writes == {C: (20.0, reserved("c")), A: (40.0, reserved("a2"))}
    table.sweep(now=25.0)
    assert session.writes == {A: (40.0, reserved("a2"))}


def test_a_gauge_read_does_not_walk_what_clients_hold() -> None:
    # Every /metrics and /status scrape reads the gauges from its own thread: a walk of a
    # client's many locks and reservations there holds the GIL, stalling the serving loop.
    table, session, held = _a_client_holding_a_thousand_of_each()
    session.add_read_locks(held[:50], _WatchedDeadline(11.0))  # keys locked twice count once
    assert len(session.lock_deadlines) == 1000  # indexed: the gauge reads no records either
    session.add_read_locks(held[900:], _WatchedDeadline(11.5))  # one record left unindexed
    _WatchedDeadline.comparisons = 0
    assert table.gauges(now=5.0) == (1, 1000, 1000, 0)
    assert _WatchedDeadline.comparisons == 0


def _walked_gauges(table: SessionTable, now: float | None) -> tuple[int, int, int]:
    """What the sessions hold by a walk of every lock and reservation: all of it (``now``
    None), or only what is live at ``now``."""
    clients = locked = reserved = 0
    for session in table:
        clients += 1
        deadlines: dict[ObjectKey, list[float]] = {}
        for key, held in session._locks.items():  # {deadline: locks}, or one lock's deadline
            deadlines.setdefault(key, []).extend(held if isinstance(held, dict) else [held])
        for keys, counts in session._records:
            for key in keys:
                deadlines.setdefault(key, []).extend(counts)
        locked += sum(1 for held in deadlines.values() if now is None or max(held) > now)
        reserved += sum(1 for deadline, _obj in session.writes.values() if now is None or deadline > now)
    return clients, locked, reserved


def _walked_fenced_bytes(session: sessions.Session) -> int:
    return sum(obj.extent_bytes for obj in session.fenced.values())


#: the clients of the randomized test whose exit cannot be seen
UNWATCHED = {b"client-0", b"client-1"}


def test_running_gauges_equal_a_walk_under_any_sequence() -> None:
    rng = random.Random(43)
    pool = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(30)]
    identities = [b"client-%d" % index for index in range(4)]
    for _ in range(20):
        # each client's fences counted up to its bound in the total, or all of them
        per_client = rng.choice([None, 20_000])
        table = SessionTable(lock_ttl_s=10, write_ttl_s=20, idle_s=15, fenced_bytes_per_client=per_client)
        previous: dict[bytes, list[ObjectKey]] = {}
        now = 0.0
        for _ in range(400):
            now += rng.random()
            identity = rng.choice(identities)
            session = table.get(identity, now)
            action = rng.random()
            if action < 0.35:
                if identity in previous and rng.random() < 0.4:
                    keys = list(previous[identity])  # a repeated lookup of the same prefix
                else:
                    start = rng.randrange(len(pool))
                    keys = pool[start : start + rng.randrange(1, 10)]
                    if rng.random() < 0.2:
                        keys = keys + keys[:2]  # a retrieve may list a key twice
                session.add_read_locks(keys, now + rng.uniform(-2, 10))
                previous[identity] = keys
            elif action < 0.5:
                wanted = list(previous.get(identity, [])) if rng.random() < 0.5 else rng.sample(pool, 5)
                session.take_read_locks(wanted, now)
            elif action < 0.6:
                session.take_one_read_lock(rng.sample(pool, rng.randrange(1, 8)), now)
            elif action < 0.75:
                extent = reserved("obj", rng.choice([4096, 8192, 65536]))
                session.add_writes(dict.fromkeys(rng.sample(pool, rng.randrange(1, 6)), extent), now + 20)
            elif action < 0.85:
                session.take_writes(rng.sample(pool, rng.randrange(1, 6)), now)
                session.take_fenced(rng.sample(pool, rng.randrange(0, 3)))  # committed or aborted late
            elif action < 0.95:
                table.sweep(now)  # expires records and reaps idle sessions holding nothing
                assert tuple(table.gauges(now))[:3] == _walked_gauges(table, now)
            else:
                # the session ends: everything it holds given back (a shutdown does this)
                session.take_read_locks(list(session.read_locks), now)
                session.writes.clear()
                session.take_fenced(list(session.fenced))
            assert tuple(table.gauges(now))[:3] == _walked_gauges(table, None)
            assert table.fenced.held == sum(
                min(_walked_fenced_bytes(session), per_client or sys.maxsize) for session in table
            )
            assert all(session.fenced_bytes == _walked_fenced_bytes(session) for session in table)
            # the clients whose exit cannot be seen, counted by a walk of those holding fences
            assert table.fenced.unwatched_held(lambda held: held.identity in UNWATCHED) == sum(
                min(_walked_fenced_bytes(session), per_client or sys.maxsize)
                for session in table
                if session.identity in UNWATCHED
            )


class _WalkedLocks(dict):  # type: ignore[type-arg]
    """A session's per-key locks that count how often they are walked whole."""

    walks = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        _WalkedLocks.walks += 1
        return super().__iter__()

    def keys(self):  # type: ignore[no-untyped-def]
        _WalkedLocks.walks += 1
        return super().keys()

    def items(self):  # type: ignore[no-untyped-def]
        _WalkedLocks.walks += 1
        return super().items()


def test_a_lookup_of_new_keys_does_not_walk_the_locks_a_client_already_holds() -> None:
    # Every LOOKUP and RETRIEVE adds a lock record on the loop thread: a client holding many
    # indexed locks must not make each new record cost a pass over all of them.
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"heavy", now=0.0)
    held = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(INDEX_BACKLOG_KEYS + 1)]
    session.add_read_locks(held, 10.0)  # past the backlog bound: indexed at once
    session._locks = _WalkedLocks(session._locks)
    _WalkedLocks.walks = 0
    fresh = [ObjectKey("n", 0, index.to_bytes(8, "big")) for index in range(4)]
    session.add_read_locks(fresh + held[:2], 10.0)
    session.add_read_locks(fresh[:2], 10.0)
    assert _WalkedLocks.walks == 0
    assert table.gauges(now=5.0).locked_keys == len(held) + len(fresh)


def test_a_sweep_looks_only_at_the_locks_that_expired() -> None:
    # A client that keeps locking has some lock expire every step of L1's lock grid: the
    # sweep that forgets them must look at those, not walk every lock the client holds.
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"heavy", now=0.0)
    live = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(1000)]
    expiring = [ObjectKey("e", 0, index.to_bytes(8, "big")) for index in range(10)]
    session.add_read_locks(expiring, _WatchedDeadline(10.0))
    session.add_read_locks(live, _WatchedDeadline(20.0))
    session.take_read_locks(live[:500], now=1.0)  # released: not looked at either
    assert len(session.lock_deadlines) == 510
    assert len(session._expiring[20.0]) == 500, "released keys are no longer filed"
    _WatchedDeadline.comparisons = 0
    table.sweep(now=15.0)
    assert _WatchedDeadline.comparisons <= 50
    assert set(session.lock_deadlines) == set(live[500:])
    assert table.gauges(now=15.0).locked_keys == 500
    table.sweep(now=25.0)
    assert session.empty


def test_the_bound_of_fenced_bytes_refuses_only_unwatched_clients_while_theirs_reach_it() -> None:
    table = SessionTable(
        lock_ttl_s=10, write_ttl_s=20, fenced_bytes_bound=10_000, fenced_bytes_per_client=6_000
    )
    unwatched = {b"relay-1", b"relay-2", b"relay-3"}

    def is_unwatched(session: sessions.Session) -> bool:
        return session.identity in unwatched

    def stall(identity: bytes, key: ObjectKey, nbytes: int) -> sessions.Session:
        session = table.get(identity, now=0.0)
        session.add_writes({key: reserved(identity.decode(), nbytes)}, deadline=1.0)
        table.sweep(now=2.0)
        return session

    def asks(identity: bytes) -> bool:
        return table.fenced.refuses(table.get(identity, now=2.0), is_unwatched, is_unwatched)

    # watched clients past the bound together: nobody is refused, and no walk is needed
    # to tell while all clients' bytes stay under it
    stall(b"engine-1", A, 8_000)
    stall(b"engine-2", B, 8_000)
    assert table.fenced.held == 12_000
    assert not asks(b"relay-1") and not asks(b"engine-3")
    # unwatched clients past it (each counted up to its bound): only their kind is refused
    stall(b"relay-1", A, 5_000)
    relay = stall(b"relay-2", C, 9_000)
    assert asks(b"relay-1") and asks(b"relay-3")
    assert table.fenced.unwatched == 11_000
    assert not asks(b"engine-1")
    assert table.fenced.refused == 2  # a watched client's store does not end the episode
    relay.take_fenced([C])
    assert not asks(b"relay-1") and table.fenced.refused == 0


def test_the_unwatched_clients_fenced_bytes_are_walked_again_only_once_fences_or_watches_changed() -> None:
    # While they reach the bound (for good, if such clients are gone), a walk of every
    # holder at each store would hold the loop thread up for every client.
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20, fenced_bytes_bound=100, fenced_bytes_per_client=1_000)
    for index in range(3):
        session = table.get(b"relay-%d" % index, now=0.0)
        session.add_writes({ObjectKey("m", 0, bytes([index])): reserved("relay", 50)}, deadline=1.0)
    table.sweep(now=2.0)
    asked: list[bytes] = []

    def is_unwatched(session: sessions.Session) -> bool:
        asked.append(session.identity)
        return True

    requester = table.get(b"relay-3", now=2.0)
    for _ in range(5):
        assert table.fenced.refuses(requester, lambda _session: True, is_unwatched)
    assert len(asked) == 3, "walked once while nothing changed"
    table.fenced.watches_changed()  # a sweep: lookups may have ended
    assert table.fenced.refuses(requester, lambda _session: True, is_unwatched)
    assert len(asked) == 6
    table.get(b"relay-0", now=2.0).take_fenced([ObjectKey("m", 0, bytes([0]))])
    assert table.fenced.refuses(requester, lambda _session: True, is_unwatched)
    assert len(asked) == 8
