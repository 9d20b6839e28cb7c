"""Drops counted in ``failures_total`` that are not an adapter's own error still get a log
line of their own: the counter says how often, the line says what happened and what to do."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from engine_support import GatedConfig, gated_backend, keys_of, store
from l2_backends import Fifo

from lmcache_tiers.config import AdapterSpec
from lmcache_tiers.controllers.l1_eviction import L1EvictionController
from lmcache_tiers.controllers.stats import EngineStats
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

ALIGN = 4096
BLOCKS = 16
SIZE = 64 * 1024


@pytest.fixture
def l1() -> Iterator[L1Manager]:
    manager = L1Manager(BLOCKS * ALIGN, align=ALIGN, prefault=False)
    yield manager
    manager.close()


def _lines_naming(caplog: pytest.LogCaptureFixture, reason: str) -> list[str]:
    return [record.getMessage() for record in caplog.records if reason in record.getMessage()]


def test_an_eviction_round_that_frees_nothing_is_logged(l1: L1Manager, caplog) -> None:
    controller = L1EvictionController(
        l1, Fifo(), trigger_watermark=0.5, eviction_ratio=0.1, stats=EngineStats(0)
    )
    keys = [ObjectKey("nothing-evictable", 0, index.to_bytes(8, "big")) for index in range(BLOCKS)]
    l1.reserve_write(keys, [ALIGN] * BLOCKS)
    l1.finish_write(keys)
    assert len(l1.reserve_read_prefix(keys, 1)) == BLOCKS  # every object read-locked

    with caplog.at_level(logging.WARNING):
        controller.step(set())
        controller.step(set())

    assert controller.stats.failures()["l1_nothing_evictable"] == 2
    lines = _lines_naming(caplog, "l1_nothing_evictable")
    assert len(lines) == 1, f"one line per burst, not one per round: {lines}"
    assert "100%" in lines[0] and "locked" in lines[0], lines[0]
    l1.finish_read(keys)


def test_keys_an_adapter_found_but_failed_to_load_are_logged(engine, caplog) -> None:
    storage = engine([AdapterSpec(type="gated", config=GatedConfig())])
    keys = keys_of(11, 4)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.clear()
    gated_backend(storage).fail_loads.update(keys[1:3])

    with caplog.at_level(logging.WARNING):
        assert storage.wait_prefetch(storage.submit_prefetch(keys), 10) == 1

    assert storage.status()["failures"]["l2_load_failed"] == 2
    lines = _lines_naming(caplog, "l2_load_failed")
    assert len(lines) == 1, lines
    assert "2 keys" in lines[0] and storage.adapters[0].name in lines[0], lines[0]
    storage.release(keys[:1])


def test_failed_loads_of_two_adapters_each_get_their_line(engine, caplog) -> None:
    """One adapter failing loads does not hide another's behind its burst: each line names
    one adapter, and an operator must learn that both fail."""
    storage = engine([AdapterSpec(type="gated", config=GatedConfig()) for _ in range(2)])
    first, second = gated_backend(storage, 0), gated_backend(storage, 1)
    in_first, in_second = keys_of(21, 4), keys_of(22, 4)
    # Each key is in one adapter only, so no other adapter's load stands in for a failed one
    # (l2_load_fallback): each adapter's failures end its prefix.
    first.fail_stores.update(in_second)
    second.fail_stores.update(in_first)
    store(storage, in_first + in_second, SIZE)
    assert storage.flush(10)
    storage.clear()
    first.fail_loads.update(in_first[1:3])
    second.fail_loads.update(in_second[1:3])

    with caplog.at_level(logging.WARNING):
        assert storage.wait_prefetch(storage.submit_prefetch(in_first), 10) == 1
        storage.release(in_first[:1])
        assert storage.wait_prefetch(storage.submit_prefetch(in_second), 10) == 1
        storage.release(in_second[:1])

    assert storage.status()["failures"]["l2_load_failed"] == 4
    lines = _lines_naming(caplog, "failed to load (failure reason l2_load_failed)")
    named = {adapter.name for adapter in storage.adapters if any(adapter.name in line for line in lines)}
    assert named == {adapter.name for adapter in storage.adapters}, lines
