"""DeleteMarks: the marks a delete leaves for the next lookup are taken once, and never
more of them are kept than the limit -- the oldest forgotten, counted and logged."""

from __future__ import annotations

import logging

import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.l2.context import KEPT_MARKS_LIMIT, AdapterContext, BackendContext
from lmcache_tiers.l2.marks import DeleteMarks
from lmcache_tiers.l2.state import AdapterState


class Marks:
    def __init__(self, limit: int = KEPT_MARKS_LIMIT) -> None:
        self.state = AdapterState(AdapterContext(index=0, name="0:test", config=L2AdapterConfig()))
        self.marks: DeleteMarks[str] = DeleteMarks(
            BackendContext(self.state), "test_marks_forgotten", "their lookup counts again", limit=limit
        )

    def forgotten(self) -> int:
        return self.state.counters.snapshot().get("test_marks_forgotten", 0)


def test_a_mark_is_taken_once() -> None:
    marks = Marks()
    assert not marks.marks
    marks.marks.add("a")
    assert marks.marks
    assert marks.marks.take("a")
    assert not marks.marks.take("a"), "taking forgets it"
    assert not marks.marks.take("b")


def test_take_all_returns_the_marked_ones_and_forgets_them() -> None:
    marks = Marks()
    marks.marks.add_all(["a", "b", "c"])
    assert marks.marks.take_all(["b", "c", "d"]) == {"b", "c"}
    assert marks.marks.take_all(["b", "c"]) == set()
    assert len(marks.marks) == 1


def test_marks_past_the_limit_forget_the_oldest_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    marks = Marks(limit=3)
    with caplog.at_level(logging.WARNING):
        for name in ["a", "b", "c", "a", "d", "e"]:  # "a" again: the newest, "b" then "c" go
            marks.marks.add(name)
    assert len(marks.marks) == 3
    assert marks.forgotten() == 2
    assert marks.marks.take_all(["a", "b", "c", "d", "e"]) == {"a", "d", "e"}
    assert "their lookup counts again" in caplog.text


def test_the_default_limit_is_that_of_the_kept_records_marks() -> None:
    # A backend that keeps both kinds for one delete (mooncake) forgets them together.
    marks = Marks()
    marks.marks.add_all(str(number) for number in range(KEPT_MARKS_LIMIT + 1))
    assert len(marks.marks) == KEPT_MARKS_LIMIT
    assert marks.forgotten() == 1
    assert not marks.marks.take("0")
