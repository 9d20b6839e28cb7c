"""The layouts of loaded keys are kept for the prefetch that collects them (take_layouts),
within a bound: loads nobody collects (no prefetch behind them) must not grow the table for
ever.  Past the bound the oldest entries no reader holds are dropped (counted, logged), never
the whole table: a prefetch's keys, still pinned while their load completes, keep their
layouts, or their objects would reach L1 with no layout and a front end's layout check
would fall back to the size alone."""

from __future__ import annotations

import logging

import pytest

import lmcache_tiers.l2.state as state_module
from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.state import AdapterState

BOUND = 8


def key(number: int) -> ObjectKey:
    return ObjectKey("m", 0, number.to_bytes(8, "big"))


def load(state: AdapterState, keys: list[ObjectKey], layout: str) -> None:
    """A completed load of ``keys`` whose records gave ``layout``."""
    state.loading_begin(keys)
    for each in keys:
        state.note_layout(each, layout)
    state.loading_end(keys, keys)


@pytest.fixture
def state(monkeypatch: pytest.MonkeyPatch) -> AdapterState:
    monkeypatch.setattr(state_module, "_LOADED_LAYOUTS_MAX", BOUND)
    return AdapterState(AdapterContext(index=0, name="0:t", config=L2AdapterConfig()))


def test_a_pinned_keys_layout_outlives_a_flood_of_uncollected_loads(
    state: AdapterState, caplog: pytest.LogCaptureFixture
) -> None:
    prefetched = key(0)
    assert state.pins.pin([prefetched]) == [True]  # a prefetch's lookup holds it
    load(state, [prefetched], "layout-of-the-prefetch")
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        for number in range(1, 4 * BOUND):
            load(state, [key(number)], "other")
    assert state.take_layouts([prefetched]) == ["layout-of-the-prefetch"]
    assert state.counters.snapshot()["loaded_layouts_dropped"] > 0
    assert any("layouts" in r.getMessage() and "dropped" in r.getMessage() for r in caplog.records)


def test_past_the_bound_the_oldest_layouts_go_first(state: AdapterState) -> None:
    for number in range(BOUND + 1):
        load(state, [key(number)], f"layout-{number}")
    assert state.take_layouts([key(0)]) == [""], "the oldest uncollected layout is dropped"
    kept = [f"layout-{number}" for number in range(1, BOUND + 1)]
    assert state.take_layouts([key(number) for number in range(1, BOUND + 1)]) == kept
    assert state.counters.snapshot()["loaded_layouts_dropped"] == 1


def test_each_load_of_a_key_keeps_its_own_layout_for_its_own_taker(state: AdapterState) -> None:
    # Two loads of one key end before either prefetch collects: each collects one layout,
    # the oldest first -- one shared entry would leave the second taker with none.
    load(state, [key(0)], "layout-of-the-first-load")
    load(state, [key(0)], "layout-of-the-second-load")
    assert state.take_layouts([key(0)]) == ["layout-of-the-first-load"]
    assert state.take_layouts([key(0)]) == ["layout-of-the-second-load"]
    assert state.take_layouts([key(0)]) == [""], "handed over once per load"


def test_a_load_whose_record_gave_no_layout_is_not_handed_another_loads(state: AdapterState) -> None:
    load(state, [key(0)], "")  # a record written without a layout
    load(state, [key(0)], "layout-of-the-second-load")
    assert state.take_layouts([key(0)]) == [""]
    assert state.take_layouts([key(0)]) == ["layout-of-the-second-load"]


def test_the_bound_counts_every_load_kept(state: AdapterState) -> None:
    for _ in range(BOUND + 1):
        load(state, [key(0)], "same-key")
    load(state, [key(1)], "newest")
    # The oldest key's loads go first: nine of one key overflow a bound of eight.
    assert state.take_layouts([key(0)]) == [""]
    assert state.take_layouts([key(1)]) == ["newest"]
    assert state.counters.snapshot()["loaded_layouts_dropped"] == BOUND + 1
