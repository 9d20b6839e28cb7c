"""``LMCACHE_LOG_LEVEL`` takes the levels LMCache takes: an engine's environment set for
LMCache (``CRITICAL`` to keep its logs quiet) means the same to this server, not INFO and
a warning."""

from __future__ import annotations

import logging

import pytest

from lmcache_tiers.server.logs import configure_logging


@pytest.mark.parametrize(("value", "level"), [("CRITICAL", logging.CRITICAL), ("critical", logging.CRITICAL)])
def test_lmcache_s_critical_level_is_taken(
    value: str, level: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    package = logging.getLogger("lmcache_tiers")
    # configure_logging sets the level of every plugin package's logger too: all are put
    # back, or the tests after this one in the process log nothing under CRITICAL.
    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)]
    before = {logger: logger.level for logger in [*loggers, package]}
    monkeypatch.setenv("LMCACHE_LOG_LEVEL", value)
    try:
        with caplog.at_level(logging.DEBUG):
            configure_logging()
            assert package.level == level
    finally:
        for name in list(logging.Logger.manager.loggerDict):
            logger = logging.getLogger(name)
            logger.setLevel(before.get(logger, logging.NOTSET))  # one made by it: as made
    assert "LMCACHE_LOG_LEVEL" not in caplog.text
