"""What a prefetch drops without an adapter failing is counted and logged too."""

from __future__ import annotations

import logging
import time

import pytest
from engine_support import GatedConfig, MiB, gated_backend, keys_of, mock, parked_prefetch, store

from lmcache_tiers.config import AdapterSpec

SIZE = 32 * 1024


def test_an_object_loaded_then_lost_before_its_hand_off_is_counted(engine, caplog) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    keys = keys_of(1, 2)
    handle = parked_prefetch(storage, keys, SIZE)
    # The load reservations expire while the load runs: the load succeeds, its objects
    # are gone from L1 by the time they would be handed over.
    assert storage.l1.expire_locks(now=time.monotonic() + storage.l1.write_ttl_s + 1) == 2

    with caplog.at_level(logging.WARNING):
        gated_backend(storage).gate.set()
        assert storage.wait_prefetch(handle, 10) == 0

    failures = storage.status()["failures"]
    assert failures.get("prefetch_loaded_object_lost") == 2
    assert "l2_load_failed" not in failures, "the loads themselves succeeded"
    assert "prefetch_loaded_object_lost" in caplog.text


def test_an_object_loaded_then_taken_over_by_a_client_write_is_counted_with_its_cause(engine, caplog) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    keys = keys_of(5, 2)
    handle = parked_prefetch(storage, keys, SIZE)
    # A client stores the same keys while their loads run: the loads give way.
    assert store(storage, keys, SIZE) == keys

    with caplog.at_level(logging.WARNING):
        gated_backend(storage).gate.set()
        assert storage.wait_prefetch(handle, 10) == 0

    failures = storage.status()["failures"]
    assert failures.get("prefetch_loaded_object_lost") == 2
    assert failures.get("l1_load_taken_over_by_write") == 2
    assert "l2_load_failed" not in failures, "the loads themselves succeeded"
    lost_lines = [r.getMessage() for r in caplog.records if "prefetch_loaded_object_lost" in r.getMessage()]
    assert lost_lines and all("client's write" in line for line in lost_lines), lost_lines
    assert len(storage.read(keys)) == 2, "the client's writes are kept"
    storage.release(keys)
    # The extents the loads filled went back once the prefetch let go of them.
    assert storage.l1.stats().used_bytes == 2 * SIZE


def _in_l2_with_l1_pinned(engine, pinned_mib: int) -> tuple[object, list, list]:
    """Two 20 MiB objects in L2 only, and six of ``pinned_mib`` read-locked in L1 (64 MiB)."""
    storage = engine([mock()])  # 64 MiB of L1
    wanted = keys_of(2, 2)
    store(storage, wanted, 20 * MiB)
    assert storage.flush(10)
    storage.clear()
    pinned = keys_of(3, 6)
    store(storage, pinned, pinned_mib * MiB)
    assert storage.flush(10)
    assert len(storage.read(pinned)) == 6
    return storage, wanted, pinned


@pytest.mark.parametrize(("pinned_mib", "loaded"), [(8, 0), (7, 1)], ids=["no room", "room for one"])
def test_a_prefetch_l1_has_too_little_room_for_is_counted_and_logged(
    engine, caplog, pinned_mib: int, loaded: int
) -> None:
    # 48 MiB read-locked: no room for 20 more; 42 MiB: room for one of the two
    storage, wanted, pinned = _in_l2_with_l1_pinned(engine, pinned_mib)

    with caplog.at_level(logging.WARNING):
        assert storage.wait_prefetch(storage.submit_prefetch(wanted), 10) == loaded

    failures = storage.status()["failures"]
    assert failures.get("prefetch_l1_full") == 1
    assert "prefetch_key_being_written" not in failures, "no other writer was filling those keys"
    assert "prefetch_l1_full" in caplog.text
    storage.release(wanted[:loaded])
    storage.release(pinned)


def test_a_policy_that_fails_on_every_prefetch_is_counted_each_time_and_logged_once_per_burst(
    engine, caplog
) -> None:
    # A third-party policy with a bug fails on every lookup that reaches L2: each failure
    # is a miss the reader sees, so each is counted, but a traceback per lookup would bury
    # the log (thousands a second under load).
    storage = engine([mock()], l2_prefetch_policy="raising")
    keys = keys_of(4, 2)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    prefetches = 5

    with caplog.at_level(logging.WARNING):
        for _ in range(prefetches):
            assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 0

    assert storage.status()["failures"].get("prefetch_policy_error") == prefetches
    logged = [record for record in caplog.records if "prefetch policy failed" in record.getMessage()]
    assert 1 <= len(logged) < prefetches, "one line per burst, not one per failure"
    assert logged[0].exc_info is not None, "the first failure is logged with its traceback"
