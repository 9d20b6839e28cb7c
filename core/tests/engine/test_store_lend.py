"""The store controller borrows each object's bytes from L1 for its L2 store: an object
whose bytes cannot be read (an NVMe L1 file answering EIO) costs its own store only."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from engine_support import keys_of, mock, store

from lmcache_tiers.keys import ObjectKey

SIZE = 64 << 10


def test_an_object_whose_bytes_cannot_be_read_fails_its_own_store_only(
    engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    storage = engine([mock()])
    keys = keys_of(1, 3)
    unreadable: ObjectKey = keys[1]
    lend = storage.l1.lend

    def lend_failing_one(obj: Any, **options: Any) -> Any:
        if obj.key == unreadable:
            raise OSError(5, "Input/output error")  # a read of the NVMe L1 file failing
        return lend(obj, **options)

    monkeypatch.setattr(storage.l1, "lend", lend_failing_one)
    with caplog.at_level(logging.WARNING, logger="lmcache_tiers"):
        store(storage, keys, SIZE)
        assert storage.flush(10), "the slice never ended: its batch is waited for"
    stored = set(storage.adapters[0].iter_keys())
    assert stored == {keys[0], keys[2]}
    status = storage.status()
    (adapter,) = status["adapters"]
    assert (adapter["keys_stored"], adapter["keys_store_failed"]) == (2, 1)
    assert status["failures"]["l2_store_submit_error"] == 1
    assert "controller_step_error" not in status["failures"]
    assert status["l1"]["read_locks"] == 0, "the store's locks were given back"
    assert unreadable.file_stem() in caplog.text


def test_a_store_that_cannot_be_submitted_counts_each_of_its_keys(
    engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``l2_store_submit_error`` counts keys, as ``l2_store_failed`` does and as the lend
    failures above count them; the slice is ``store_tasks_failed``."""
    storage = engine([mock()])
    adapter = storage.adapters[0]

    def refuse(*args: Any, **options: Any) -> int:
        raise RuntimeError("the adapter refuses the task")

    monkeypatch.setattr(adapter, "submit_store", refuse)
    store(storage, keys_of(1, 3), SIZE)
    assert storage.flush(10), "the slice never ended: its batch is waited for"
    status = storage.status()
    (counters,) = status["adapters"]
    assert counters["keys_store_failed"] == 3
    assert counters["store_tasks_failed"] == 1
    assert status["failures"]["l2_store_submit_error"] == 3
