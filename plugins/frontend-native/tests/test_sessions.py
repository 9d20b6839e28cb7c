from __future__ import annotations

import random
from collections import Counter

import pytest
from lmcache_plugin_frontend_native import sessions
from lmcache_plugin_frontend_native.sessions import INDEX_BACKLOG_KEYS, PendingPrefetch, SessionTable

from lmcache_tiers.keys import ObjectKey

A, B, C = (ObjectKey("m", 0, bytes([i]) * 8) for i in (1, 2, 3))


def test_locks_are_counted_and_grouped_by_count() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"client", now=0.0)
    session.add_read_locks([A, B], deadline=10.0)  # a lookup
    session.add_read_locks([A], deadline=12.0)  # a retrieve of the first key
    assert session.take_read_locks([A, B, C], now=5.0) == {2: [A], 1: [B]}
    assert session.take_read_locks([A, B], now=5.0) == {}  # nothing held twice


def test_expired_locks_are_forgotten_not_released() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"client", now=0.0)
    session.add_read_locks([A], deadline=10.0)
    session.add_read_locks([B], deadline=30.0)
    # L1 reaped A's lock at its TTL: releasing it now could drop somebody else's lock
    assert session.take_read_locks([A, B], now=11.0) == {1: [B]}


def test_writes_belong_to_the_session_that_reserved_them() -> None:
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    mine, theirs = table.get(b"one", 0.0), table.get(b"two", 0.0)
    mine.add_writes({A: 100, B: 200}, deadline=20.0)
    assert theirs.take_writes([A], now=1.0) == ({}, [False])
    assert mine.take_writes([B, C, A], now=1.0) == ({B: 200, A: 100}, [True, False, True])
    mine.add_writes({C: 5}, deadline=20.0)
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
        self.counts: Counter[ObjectKey] = Counter()
        self.deadlines: dict[ObjectKey, float] = {}

    def add(self, keys: list[ObjectKey], deadline: float) -> None:
        self.counts.update(keys)
        self.deadlines.update(dict.fromkeys(keys, deadline))

    def take(self, keys: list[ObjectKey], now: float) -> dict[int, list[ObjectKey]]:
        groups: dict[int, list[ObjectKey]] = {}
        for key in keys:
            count = self.counts.pop(key, 0)
            if count and self.deadlines.pop(key) > now:
                groups.setdefault(count, []).append(key)
        return groups

    def expire(self, now: float) -> None:
        for key in [key for key, deadline in self.deadlines.items() if deadline <= now]:
            del self.deadlines[key], self.counts[key]


def test_lock_records_match_per_key_bookkeeping_under_any_sequence() -> None:
    rng = random.Random(16)
    pool = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(40)]
    for _ in range(30):
        session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
        model = _EagerLocks()
        now, previous = 0.0, pool[:4]
        for _ in range(300):
            now += rng.random()
            action = rng.random()
            if action < 0.6:
                if rng.random() < 0.4:
                    keys = list(previous)  # equal keys again (a repeated lookup), not the same list
                else:
                    start = rng.randrange(len(pool))
                    keys = pool[start : start + rng.randrange(1, 12)]
                    if rng.random() < 0.2:
                        keys = keys + keys[:2]  # a retrieve may list a key twice
                # a collected prefetch's deadline can be earlier than the last lock's
                deadline = now + (10 if rng.random() < 0.8 else rng.uniform(-2, 10))
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
                assert dict(session.take_read_locks(wanted, now)) == model.take(wanted, now)
            else:
                session.expire(now)
                model.expire(now)
                assert session.empty == (not model.counts)
        assert session.read_locks == model.counts
        assert session.lock_deadlines == model.deadlines


def test_repeated_lookups_of_one_prefix_keep_one_record_and_count_every_lock() -> None:
    session = SessionTable(lock_ttl_s=10, write_ttl_s=20).get(b"client", now=0.0)
    for step in range(1000):
        session.add_read_locks([A, B], deadline=10.0 + step)
    assert session.take_read_locks([A, B], now=5.0) == {1000: [A, B]}


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
    # a key named twice goes once, as L1 locked it; C's lock was reaped, so only forgotten
    assert session.take_one_read_lock([A, A, B, C], now=5.0) == [A, B]
    assert session.read_locks == {A: 1}
    assert session.take_read_locks([A, B, C], now=5.0) == {1: [A]}
