"""BurstLog: one line per burst, and records that keep nothing of an exception but its text."""

from __future__ import annotations

import logging

import pytest

from lmcache_tiers.burst import BurstLog
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
