"""An L1 closing between a read's presence check and its copy answers a miss (KeyError),
counted and logged: never the RuntimeError or ValueError of a closed backing."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from l1_closing import ALIGN, closing_after_the_check, memory_or_nvme_l1

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager


def key(index: int) -> ObjectKey:
    return ObjectKey("read-closing", 0, index.to_bytes(8, "big"))


@pytest.fixture(params=["memory", "nvme"])
def l1(request: pytest.FixtureRequest) -> Iterator[L1Manager]:
    yield from memory_or_nvme_l1(request)


def stored(l1: L1Manager, stored_key: ObjectKey) -> None:
    """Write one READY object of ``ALIGN`` bytes under ``stored_key``."""
    reserved = l1.reserve_write([stored_key], [ALIGN])
    l1.write_object(reserved[stored_key], memoryview(bytes(range(256)) * (ALIGN // 256)))
    assert l1.finish_write([stored_key]) == [True]


def test_a_read_whose_l1_closes_before_its_copy_is_a_counted_miss(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stored(l1, key(1))
    (obj,) = l1.reserve_read([key(1)]).values()
    closing_after_the_check(l1, monkeypatch)
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError):
        l1.read_object(obj, memoryview(bytearray(ALIGN)))
    assert l1.failures().get("l1_read_closed") == 1
    assert "closed" in caplog.text


def test_a_read_loan_whose_l1_closes_before_its_view_is_taken_is_a_counted_miss(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An L2 store borrows the object's bytes (a view of the arena, a copy of the NVMe
    # file's) after the same check: the arena released by a close in between answered
    # its ValueError rather than a miss.
    stored(l1, key(1))
    (obj,) = l1.reserve_store([key(1)]).values()
    closing_after_the_check(l1, monkeypatch)
    with pytest.raises(KeyError):
        l1.lend(obj)
    assert l1.failures().get("l1_read_closed") == 1
