"""L1 reaps expired locks at a cadence that follows its shortest TTL, not every 5 s."""

from __future__ import annotations

import logging
import time

import pytest
from engine_support import keys_of, store

from lmcache_tiers.sweep_cadence import SWEEP_COST_FACTOR, SWEEP_FLOOR_S, next_sweep_at, sweep_interval

SIZE = 4096
TTL_S = 1.0
#: how long past the TTL the test waits for the reaping: the cadence (a quarter of the
#: TTL) plus room for a loaded machine, yet well short of the 5 s sweep it replaces
SLACK_S = 2.5


def test_the_cadence_is_a_fraction_of_the_shortest_ttl_within_bounds() -> None:
    assert sweep_interval([1.0, 600.0], ceiling=5.0) == 0.25
    assert sweep_interval([300.0, 600.0], ceiling=5.0) == 5.0, "long TTLs: no more often than before"
    assert sweep_interval([0.01], ceiling=5.0) == SWEEP_FLOOR_S
    assert sweep_interval([0.0, 8.0], ceiling=5.0) == 2.0, "a TTL of 0 (no grace period) enforces nothing"
    assert sweep_interval([], ceiling=0.2) == 0.2
    assert sweep_interval([1.0], ceiling=0.01) == 0.01, "a ceiling under the floor wins"


def test_a_reap_that_costs_much_of_its_interval_is_spaced_out_by_its_cost() -> None:
    # A reap walks every locked object under the L1 lock: 100,000 read locks took 0.2-0.8 s
    # here, so a 0.05 s cadence would reap back to back, holding the lock writes need.
    assert next_sweep_at(100.0, 100.001, 0.05) == 100.05, "a cheap reap: the interval after it began"
    started, ended = 100.0, 100.2
    due = next_sweep_at(started, ended, 0.05)
    assert due == pytest.approx(ended + SWEEP_COST_FACTOR * (ended - started))
    assert (ended - started) / (due - started) <= 0.05 + 1e-9, "reaping at most 5 % of the time"
    assert next_sweep_at(100.0, 100.2, 5.0) == 105.0, "under a long interval the cost is not felt"


def test_the_reap_interval_follows_the_l1_ttls(engine) -> None:
    short = engine(l1_lock_ttl_s=TTL_S, l1_write_ttl_s=10 * TTL_S)
    assert short.l1_eviction.reap_interval_s == TTL_S / 4
    default = engine()
    assert default.l1_eviction.reap_interval_s == 5.0, "the default TTLs: every 5 s, as before"


def test_locks_expired_under_a_short_ttl_are_reaped_about_at_their_ttl(engine) -> None:
    storage = engine(l1_lock_ttl_s=TTL_S, l1_write_ttl_s=TTL_S)
    ready = keys_of(1, 2)
    store(storage, ready, SIZE)
    taken = time.monotonic()
    assert [obj.key for obj in storage.read(ready)] == ready  # read locks never released
    assert len(storage.reserve_write(keys_of(2, 1), [SIZE])) == 1  # never committed
    assert (storage.l1.stats().read_locks, storage.l1.stats().write_locked) == (2, 1)

    deadline = taken + TTL_S + SLACK_S
    while time.monotonic() < deadline:
        stats = storage.l1.stats()
        if (stats.read_locks, stats.write_locked) == (0, 0):
            break
        time.sleep(0.02)
    stats = storage.l1.stats()
    assert (stats.read_locks, stats.write_locked) == (0, 0), "expired locks still held past TTL + cadence"
    assert storage.status()["failures"]["l1_lock_expired"] == 3
    assert all(storage.l1.contains(key) for key in ready), "a reaped read lock leaves its object"


def test_reaps_finding_expired_locks_one_after_another_log_one_line_per_burst(engine, caplog) -> None:
    # Reaps now come every quarter of the shortest TTL (20 a second at the floor): a line
    # for each that finds something would flood the log while clients keep leaving
    # locks; the counter has every one.
    storage = engine()
    keys = keys_of(3, 3)
    store(storage, keys, SIZE)
    later = time.monotonic() + 10 * storage.l1.lock_ttl_s  # past every lock's TTL
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l1"):
        for step, key in enumerate(keys, start=1):
            assert [obj.key for obj in storage.read([key])] == [key]  # never released
            assert storage.l1.expire_locks(later + step) == 1
    lines = [record for record in caplog.records if "L1 lock TTL expired" in record.getMessage()]
    assert len(lines) == 1, [record.getMessage() for record in lines]
    assert storage.l1.stats().read_locks == 0
