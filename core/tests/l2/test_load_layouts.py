"""Each load's result carries the layouts the records it copied state (``LoadResult``):
per load, not per key, so loads of one key whose records differ (two engines of different
dtypes sharing keys) each hand their own layout to the L1 object they fill, whatever order
their results are handled in, and nothing is left behind for a later load of the key.  A
load that read records of two layouts cannot tell which its bytes are of: a miss."""

from __future__ import annotations

import logging

import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.interface import LoadResult, layouts_of
from lmcache_tiers.l2.ops import LoadOp
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.protocols import ObjectSize

A = ObjectKey("m", 0, b"a" * 8)
SIZE = 8


@pytest.fixture
def state() -> AdapterState:
    state = AdapterState(AdapterContext(index=0, name="0:t", config=L2AdapterConfig()))
    state.accounting.add_scanned([(A, ObjectSize(SIZE, SIZE))])
    return state


def started_load(state: AdapterState) -> LoadOp:
    """A load of ``A`` in its backend call (prepared; ``finish`` ends it)."""
    op = LoadOp(state, [A], [memoryview(bytearray(SIZE))])
    io_keys, _ = op.prepare()
    assert io_keys == [A]
    return op


def test_loads_handled_in_the_other_order_each_get_their_own_layout(state: AdapterState) -> None:
    first = started_load(state)
    state.note_layout(A, "bfloat16[4]")  # it reads the record a bf16 engine wrote
    first_result = first.finish([True])
    second = started_load(state)  # after an fp16 engine rewrote the key
    state.note_layout(A, "float16[4]")
    second_result = second.finish([True])
    # The newer result handled first: it must not get the older load's layout.
    assert second_result == [True] and layouts_of(second_result) == ["float16[4]"]
    assert first_result == [True] and layouts_of(first_result) == ["bfloat16[4]"]


def test_overlapping_loads_that_read_one_layout_both_get_it(state: AdapterState) -> None:
    first = started_load(state)
    state.note_layout(A, "bfloat16[4]")  # the first load reads its record
    second = started_load(state)
    assert layouts_of(first.finish([True])) == ["bfloat16[4]"]
    state.note_layout(A, "bfloat16[4]")  # the second one reads its record
    assert layouts_of(second.finish([True])) == ["bfloat16[4]"]


def test_a_read_after_the_load_ended_is_not_its_layout(state: AdapterState) -> None:
    op = started_load(state)
    state.note_layout(A, "bfloat16[4]")
    result = op.finish([True])
    state.note_layout(A, "float16[4]")  # a later lookup reads a rewritten record
    assert layouts_of(result) == ["bfloat16[4]"]
    assert state.unreadable([A]) == [False]


def test_overlapping_loads_that_read_two_layouts_are_misses(
    state: AdapterState, caplog: pytest.LogCaptureFixture
) -> None:
    # The backend does not say which load read which record: each of the two could hold
    # either's bytes, so neither may label them.
    first, second = started_load(state), started_load(state)
    state.note_layout(A, "bfloat16[4]")
    state.note_layout(A, "float16[4]")
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l2"):
        assert first.finish([True]) == [False]
        assert second.finish([True]) == [False]
    assert state.counters.snapshot()["load_layout_ambiguous"] == 2
    assert "different layouts" in caplog.text


def test_a_load_that_read_no_layout_and_a_failed_key_carry_none(state: AdapterState) -> None:
    op = started_load(state)
    assert layouts_of(op.finish([True])) == [""]
    failed = started_load(state)
    state.note_layout(A, "bfloat16[4]")
    result = failed.finish([False])
    assert result == [False] and layouts_of(result) == [""]


def test_a_plain_list_result_has_no_layouts() -> None:
    assert layouts_of([True, False]) == ["", ""]
    with pytest.raises(ValueError):
        LoadResult([True], ["a", "b"])
