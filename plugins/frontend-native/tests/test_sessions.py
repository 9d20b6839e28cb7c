from __future__ import annotations

from lmcache_plugin_frontend_native.sessions import PendingPrefetch, SessionTable

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
    assert table.totals() == (0, 0, 1)
    busy.prefetches.clear()
    table.sweep(now=61.0)
    assert len(table) == 0
