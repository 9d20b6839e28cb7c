"""A store controller stuck in a step at shutdown is left behind (``JOIN_GRACE_S``), and L1
closes without it: the acknowledged writes it never stored are counted and logged by the
close itself, once, not whenever (if ever) the stuck step returns."""

from __future__ import annotations

import logging
import threading

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


def test_a_step_left_behind_in_a_submit_submits_no_more_slices(engine, monkeypatch, caplog) -> None:
    """Stuck in one adapter's ``submit_store`` with another slice of the same step still to
    submit: once the close has counted the objects and closed L1, the returning step must
    not go on to submit that slice -- to a closed L1 it fails the step (a traceback, a
    ``controller_step_error``), to a still open one it stores writes counted as abandoned."""
    monkeypatch.setattr(base, "JOIN_GRACE_S", 0.2)
    storage = engine([mock(), mock()])
    first = storage.adapters[0]
    gate, entered = threading.Event(), threading.Semaphore(0)
    submit_store = first.submit_store

    def stuck_submit(*args, **kwargs):
        entered.release()
        gate.wait()
        return submit_store(*args, **kwargs)

    monkeypatch.setattr(first, "submit_store", stuck_submit)
    keys = keys_of(1, 3)
    store(storage, keys, MiB)  # one batch: one slice for each adapter, taken in one step
    assert entered.acquire(timeout=10)

    with caplog.at_level(logging.WARNING):
        storage.close(drain_timeout_s=0.0)
    assert storage.store._thread.is_alive(), "left behind in its step"
    assert dropped(storage.failures()) == len(keys)

    gate.set()  # the submit returns at last: the second slice is not submitted
    storage.store._thread.join(30)
    assert not storage.store._thread.is_alive()
    # Counted once, by the close: no step error, no failed submit of the second slice.
    assert storage.failures() == {"l2_store_abandoned": len(keys)}
