"""A lookup's keys, known distinct, locked by a client holding nothing: no set of them is
made unless another record or a partial release needs one, and everything a session
answers is what it answers without the hint."""

from __future__ import annotations

import random

from lmcache_plugin_frontend_native.sessions import INDEX_BACKLOG_KEYS, Session, SessionTable

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.testing.hash_counting import HashCountingKey


def test_a_lookup_and_release_of_distinct_keys_hashes_none_of_them() -> None:
    # lookup, retrieve of the same keys, release: the usual life of a prompt's locks
    table = SessionTable(lock_ttl_s=10, write_ttl_s=20)
    session = table.get(b"engine", now=0.0)
    keys = [HashCountingKey(index) for index in range(64)]
    HashCountingKey.hashes = 0
    session.add_read_locks(keys, 10.0, distinct=True)  # type: ignore[arg-type]
    assert table.gauges(now=1.0).locked_keys == 64
    session.add_read_locks(list(keys), 10.0)  # type: ignore[arg-type]
    assert session.take_read_locks(list(keys), now=1.0) == {(2, 10.0): keys}  # type: ignore[arg-type]
    assert HashCountingKey.hashes == 0
    assert table.gauges(now=1.0).locked_keys == 0
    assert session.empty


def test_a_lone_distinct_record_answers_what_one_without_the_hint_does() -> None:
    rng = random.Random(49)
    pool = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(24)]
    for _ in range(60):
        hinted, plain = Session(b"hinted", 0.0), Session(b"plain", 0.0)
        now, previous = 0.0, pool[:3]
        for _ in range(120):
            now += rng.random()
            action = rng.random()
            if action < 0.5:
                if rng.random() < 0.3:
                    keys = list(previous)
                else:
                    start = rng.randrange(len(pool))
                    keys = pool[start : start + rng.randrange(1, 10)]
                    if rng.random() < 0.2:
                        keys = keys + keys[:2]
                deadline = now + rng.choice([2.0, 5.0])
                hinted.add_read_locks(keys, deadline, distinct=len(set(keys)) == len(keys))
                plain.add_read_locks(list(keys), deadline)
                previous = keys
            elif action < 0.8:
                draw = rng.random()
                wanted = list(previous) if draw < 0.5 else rng.sample(pool, rng.randrange(1, 8))
                if draw > 0.9:
                    assert hinted.take_one_read_lock(wanted, now) == plain.take_one_read_lock(wanted, now)
                else:
                    assert hinted.take_read_locks(wanted, now) == plain.take_read_locks(wanted, now)
            elif action < 0.9:
                hinted.expire(now)
                plain.expire(now)
            else:
                hinted.take_read_locks(list(pool), now)
                plain.take_read_locks(list(pool), now)
            assert hinted.locked_keys == plain.locked_keys
            assert hinted.empty == plain.empty
        assert hinted.lock_deadlines == plain.lock_deadlines


def test_a_lone_distinct_record_past_the_backlog_is_indexed_at_once() -> None:
    session = Session(b"big", 0.0)
    keys = [ObjectKey("m", 0, index.to_bytes(8, "big")) for index in range(INDEX_BACKLOG_KEYS + 1)]
    session.add_read_locks(keys, 10.0, distinct=True)
    assert not session._records
    assert session.locked_keys == len(keys)
    assert session.take_read_locks(keys[:2], now=1.0) == {(1, 10.0): keys[:2]}
    assert session.locked_keys == len(keys) - 2
