"""L1 reaps expired locks at a cadence that follows its shortest TTL, not every 5 s."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from engine_support import keys_of, store
from stepped_reaper import SteppedClock, stepped_reaper

from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.sweep_cadence import (
    SWEEP_COST_FACTOR,
    SWEEP_FLOOR_S,
    SWEEP_TTL_FRACTION,
    next_sweep_at,
    sweep_interval,
)

SIZE = 4096
BLOCKS = 16
TTL_S = 1.0


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


@pytest.fixture
def stepped(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[L1Manager, L1EvictionController, SteppedClock]]:
    """An L1 with lock and write TTLs of ``TTL_S`` and its eviction controller, driven by
    hand on a stepped clock, the reaps a quarter second apart."""
    l1 = L1Manager(BLOCKS * SIZE, align=SIZE, prefault=False, lock_ttl_s=TTL_S, write_ttl_s=TTL_S)
    with stepped_reaper(monkeypatch, l1) as reaper:
        yield reaper


def next_wake_up(controller: L1EvictionController, clock: SteppedClock) -> float:
    """When the controller's thread steps next: after its regular interval, or sooner when
    ``next_step_in`` asks (as ``ControllerThread`` waits)."""
    again = controller.next_step_in()
    return clock.now + (controller.interval_s if again is None else min(controller.interval_s, again))


def step_as_the_thread_does(controller: L1EvictionController, clock: SteppedClock) -> None:
    """Move the clock to the controller's next wake-up and step it."""
    clock.now = next_wake_up(controller, clock)
    controller.step(set())


def test_locks_expired_under_a_short_ttl_are_reaped_within_a_quarter_of_their_ttl(stepped) -> None:
    l1, controller, clock = stepped
    ready = keys_of(1, 2)
    locked = l1.reserve_write(ready, [SIZE] * len(ready))
    assert l1.finish_write_and_reserve_read(ready) == [True] * len(ready)  # never released
    locked |= l1.reserve_write(keys_of(2, 1), [SIZE])  # never committed
    assert (l1.stats().read_locks, l1.stats().write_locked) == (2, 1)
    expiry = max(obj.lock_deadline for obj in locked.values())

    reaped_at = None
    while reaped_at is None and clock.now < expiry + TTL_S:  # well past the cadence asked for
        step_as_the_thread_does(controller, clock)
        if (l1.stats().read_locks, l1.stats().write_locked) == (0, 0):
            reaped_at = clock.now
    assert reaped_at is not None, "expired locks still held a TTL past their expiry"
    assert expiry <= reaped_at <= expiry + TTL_S * SWEEP_TTL_FRACTION, "reaped later than the cadence"
    assert controller.stats.failures()["l1_lock_expired"] == 3
    assert all(l1.contains(key) for key in ready), "a reaped read lock leaves its object"


def test_a_slow_reap_puts_the_next_off_by_its_own_cost(stepped, monkeypatch: pytest.MonkeyPatch) -> None:
    # A reap of ~100,000 read locks takes 0.2-0.8 s under the L1 lock: at the quarter-second
    # cadence of a 1 s TTL the next would be due at once.  The L1's own reap runs; the
    # stepped clock moves on by the time such a reap takes.
    l1, controller, clock = stepped
    duration = 0.5
    reaps: list[float] = []
    reap = l1.expire_locks

    def slow_reap(now: float | None = None) -> int:
        reaps.append(clock.now)
        try:
            return reap(now)
        finally:
            clock.now += duration

    monkeypatch.setattr(l1, "expire_locks", slow_reap)
    step_as_the_thread_does(controller, clock)
    assert len(reaps) == 1, "the first reap, due a quarter TTL after the start"
    due = reaps[0] + duration * (1 + SWEEP_COST_FACTOR)
    while next_wake_up(controller, clock) < due:
        step_as_the_thread_does(controller, clock)
    assert len(reaps) == 1, "a reap came sooner than 19 times the last one's duration after it"
    assert next_wake_up(controller, clock) == due, "the thread is not woken when the next reap is due"
    step_as_the_thread_does(controller, clock)
    assert reaps == [reaps[0], due], "the reap due did not run"


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
