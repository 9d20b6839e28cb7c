"""The shutdown flush over a slow L2: its progress on a terminal, its log line, and that
an abandon request ends it with what is left counted once the storage closes."""

from __future__ import annotations

import io
import logging
import threading

import pytest
from rich.console import Console

from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.server.flush import ABANDONED_FAILURES, flush_l2, flush_message, pending_l2_stores
from lmcache_tiers.storage import StorageManager

SIZE = 4096


def _slow_storage() -> StorageManager:
    registry = load_registry()
    slow = decode_adapter(registry, {"type": "mock", "max_size_gb": 0.01, "latency_s": 30}, 0)
    return StorageManager(ServerConfig(l1_size_gb=1 / 64, l2_adapters=(slow,)), registry)


def _store(storage: StorageManager, count: int) -> None:
    keys = [ObjectKey("flush-test", 0, index.to_bytes(32, "big")) for index in range(count)]
    reserved = storage.reserve_write(keys, [SIZE] * count)
    for obj in reserved.values():
        storage.view(obj)[:] = b"\x01" * SIZE
    storage.commit_write(list(reserved))


def test_nothing_pending_returns_at_once_and_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    registry = load_registry()
    with StorageManager(ServerConfig(l1_size_gb=1 / 64), registry) as storage, caplog.at_level(logging.INFO):
        assert flush_l2(storage, 10.0, lambda: None)
    assert "flushing" not in caplog.text


def test_abandon_ends_the_flush_and_the_close_counts_what_was_left(caplog: pytest.LogCaptureFixture) -> None:
    storage = _slow_storage()
    try:
        _store(storage, 4)
        assert pending_l2_stores(storage) >= 1
        terminal = io.StringIO()
        console = Console(file=terminal, force_terminal=True, width=100)
        asked = threading.Event()
        checks: list[int] = []

        def abandon() -> str | None:
            checks.append(1)
            if len(checks) >= 3:  # a second signal after a few slices of waiting
                asked.set()
            return "a second signal" if asked.is_set() else None

        with caplog.at_level(logging.INFO, logger="lmcache_tiers.server.app"):
            assert not flush_l2(storage, 60.0, abandon, console)
        assert "flushing L2 stores (Ctrl-C again to abandon)" in terminal.getvalue()
        assert flush_message(1, 60.0) in caplog.text
        assert "flush abandoned on a second signal: 1 L2 stores not waited for" in caplog.text
    finally:
        storage.close(drain_timeout_s=0.0)
    failures = storage.stats.failures()
    assert sum(failures.get(name, 0) for name in ABANDONED_FAILURES) == 4


def test_the_deadline_ends_the_flush_too(caplog: pytest.LogCaptureFixture) -> None:
    storage = _slow_storage()
    try:
        _store(storage, 2)
        with caplog.at_level(logging.INFO, logger="lmcache_tiers.server.app"):
            assert not flush_l2(storage, 1.0, lambda: None)
        assert "flush timed out after 1s: 1 L2 stores not waited for" in caplog.text
    finally:
        storage.close(drain_timeout_s=0.0)
