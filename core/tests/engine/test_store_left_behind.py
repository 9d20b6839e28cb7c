"""A store controller stuck in a step at shutdown is left behind (``JOIN_GRACE_S``), and L1
closes without it: the acknowledged writes it never stored are counted and logged by the
close itself, once, not whenever (if ever) the stuck step returns."""

from __future__ import annotations

import logging

from engine_support import GatedStorePolicy, MiB, keys_of, mock, store

from lmcache_tiers.controllers import base

DROPPED = ("l2_store_abandoned", "l2_store_dropped_at_shutdown")


def dropped(failures: dict[str, int]) -> int:
    return sum(failures.get(reason, 0) for reason in DROPPED)


def test_writes_of_a_store_controller_left_behind_are_counted_by_the_close(
    engine, monkeypatch, caplog
) -> None:
    monkeypatch.setattr(base, "JOIN_GRACE_S", 0.2)
    storage = engine([mock()], l2_store_policy="gated")
    GatedStorePolicy.gate.clear()  # the store controller's step stalls in its policy
    stalled, queued = keys_of(1, 3), keys_of(2, 2)
    store(storage, stalled, MiB)
    assert GatedStorePolicy.entered.acquire(timeout=10)
    store(storage, queued, MiB)  # behind the stalled batch, in the queue

    with caplog.at_level(logging.WARNING):
        storage.close(drain_timeout_s=0.0)
    assert storage.store._thread.is_alive(), "left behind in its step"
    # Closed: L1 and the adapters are gone, and nothing will ever store these five.
    assert dropped(storage.failures()) == len(stalled) + len(queued)
    assert "never stored in L2" in caplog.text

    GatedStorePolicy.gate.set()  # the step returns at last: its finish counts nothing again
    storage.store._thread.join(30)
    assert not storage.store._thread.is_alive()
    failures = storage.failures()
    assert dropped(failures) == len(stalled) + len(queued)
    assert "controller_step_error" not in failures, "the step stopped at the closed L1, not failed on it"
