"""A listener raising on every notification costs one traceback in the log, then one
line per burst telling how many more failed; every failure is counted."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from l2_backends import open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

ALIGN = 4096
NOTIFICATIONS = 20


def listener_lines(caplog: pytest.LogCaptureFixture) -> tuple[int, int]:
    """(lines with a traceback, all lines) the listener's failures logged."""
    lines = [record for record in caplog.records if "listener" in record.getMessage()]
    return sum(1 for record in lines if record.exc_info), len(lines)


class FailingL2Listener:
    def on_l2_keys_stored(self, adapter: Any, keys: Sequence[ObjectKey]) -> None:
        raise RuntimeError("an L2 listener's bug")

    def on_l2_keys_loaded(self, adapter: Any, keys: Sequence[ObjectKey]) -> None:
        raise RuntimeError("an L2 listener's bug")

    def on_l2_keys_deleted(self, adapter: Any, keys: Sequence[ObjectKey]) -> None:
        raise RuntimeError("an L2 listener's bug")


def test_an_l2_listener_failing_every_time_is_traced_once_and_counted_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    adapter = open_dict()
    try:
        adapter.add_listener(FailingL2Listener())
        client = BlockingAdapterClient(adapter, timeout=10.0)
        with caplog.at_level(logging.WARNING):
            for index in range(NOTIFICATIONS):
                keys = make_keys(1, start=index)
                assert client.store(keys, [memoryview(bytes(100))]) == [True]
        assert adapter.stats().get("listener_failures") == NOTIFICATIONS
        traced, lines = listener_lines(caplog)
        assert traced == 1, "one traceback, the first time"
        assert lines <= 2, "then one line per burst, not one a failure"
    finally:
        adapter.close()


class FailingL1Listener:
    def on_l1_keys_written(self, written: Sequence[ObjectKey]) -> None:
        raise RuntimeError("an L1 listener's bug")

    def on_l1_keys_read(self, read: Sequence[ObjectKey]) -> None:
        raise RuntimeError("an L1 listener's bug")

    def on_l1_keys_deleted(self, deleted: Sequence[ObjectKey]) -> None:
        raise RuntimeError("an L1 listener's bug")


def test_an_l1_listener_failing_every_time_is_traced_once_and_counted_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    l1 = L1Manager(64 * ALIGN, align=ALIGN, prefault=False)
    try:
        l1.add_listener(FailingL1Listener())
        keys = make_keys(NOTIFICATIONS)
        with caplog.at_level(logging.WARNING):
            for key in keys:
                l1.reserve_write([key], [ALIGN])
                assert l1.finish_write([key]) == [True]
        assert l1.failures()["l1_listener_error"] == NOTIFICATIONS
        traced, lines = listener_lines(caplog)
        assert traced == 1, "one traceback, the first time"
        assert lines <= 2, "then one line per burst, not one a failure"
    finally:
        l1.close()
