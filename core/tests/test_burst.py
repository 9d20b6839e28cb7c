"""BurstLog: one line per burst, and records that keep nothing of an exception but its text."""

from __future__ import annotations

import logging

import pytest

from lmcache_tiers.burst import BurstLog, report_held_back
from lmcache_tiers.l1 import L1Arena


class _Keeper(logging.Handler):
    """Keeps every record, as test capture and memory handlers do."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _load_into(view: memoryview) -> None:
    raise ValueError(f"payload checksum mismatch in {len(view)} bytes")


def test_a_kept_record_does_not_keep_the_exception_or_the_views_of_its_frames(
    caplog: pytest.LogCaptureFixture,
) -> None:
    keeper = _Keeper()
    log = logging.getLogger("lmcache_tiers.test_burst")
    log.addHandler(keeper)
    arena = L1Arena(1 << 20, prefault=False)
    try:
        burst = BurstLog(log, "test_failures")
        try:
            _load_into(arena.buffer[0:4096])
        except ValueError as exc:
            burst.warn("load", "%s: load failed: %s", "0:test", exc)
        (record,) = keeper.records
        assert record.getMessage() == "0:test: load failed: payload checksum mismatch in 4096 bytes"
        assert not any(isinstance(arg, BaseException) for arg in record.args or ())
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l1.arena"):
            arena.close()
        assert "still alive" not in caplog.text
    finally:
        log.removeHandler(keeper)
        arena.close()


def test_a_log_made_for_errors_logs_at_error_and_one_line_may_say_its_own_level(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("lmcache_tiers.test_burst_levels")
    errors = BurstLog(log, "test_lost", level=logging.ERROR)
    warnings = BurstLog(log, "test_dropped")
    with caplog.at_level(logging.WARNING, logger=log.name):
        errors.event(1, "acknowledged writes lost")
        warnings.event(1, "objects dropped")
        warnings.warn("lost", "one acknowledged write lost", level=logging.ERROR)
    assert [record.levelno for record in caplog.records] == [logging.ERROR, logging.WARNING, logging.ERROR]


def test_warnings_held_back_are_logged_once_their_window_ends_or_at_the_stop(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst followed by quiet: the tail of it, only counted, was in no log line until
    the next warning of its kind came -- maybe never."""
    log = logging.getLogger("lmcache_tiers.test_burst_held")
    burst = BurstLog(log, "test_dropped", window_s=10.0)
    clock = [1000.0]
    monkeypatch.setattr("lmcache_tiers.burst.time.monotonic", lambda: clock[0])
    with caplog.at_level(logging.WARNING, logger=log.name):
        for key in ("a", "b", "c"):
            burst.warn("dropped", "%s dropped", key)
        assert [r.getMessage() for r in caplog.records] == ["a dropped"]
        report_held_back(1005.0)  # within the window: still held
        assert len(caplog.records) == 1
        report_held_back(1010.0)  # its window ended: the last held, with the count
        assert (
            caplog.records[-1].getMessage()
            == "c dropped (2 like it held back in the last 10 s, this the last)"
        )
        report_held_back(1030.0)  # nothing held any more
        assert len(caplog.records) == 2
        clock[0] = 1012.0  # within the window the held-back line began
        burst.warn("dropped", "%s dropped", "d")
        assert len(caplog.records) == 2
        report_held_back()  # the stop: every kind, whatever its window
        # (every BurstLog of the process reports: an adapter of an earlier test in this
        # worker may have its own line held back, so only this logger's lines count)
        own = [record.getMessage() for record in caplog.records if record.name == log.name]
        assert own[-1] == "d dropped (1 like it held back in the last 10 s, this the last)"
