"""An L1 closing between a write's reservation check and its copy fails the store with a
KeyError (as for a reservation that left L1), counted and logged: never the bare
RuntimeError or ValueError of a closed backing, and nothing is written into it."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from l1_closing import ALIGN, closing_after_the_check, memory_or_nvme_l1

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

PAYLOAD = memoryview(bytes(range(256)) * (ALIGN // 256))


def key(index: int) -> ObjectKey:
    return ObjectKey("write-closing", 0, index.to_bytes(8, "big"))


@pytest.fixture(params=["memory", "nvme"])
def l1(request: pytest.FixtureRequest) -> Iterator[L1Manager]:
    yield from memory_or_nvme_l1(request)


def test_a_write_whose_l1_closes_before_its_copy_is_a_counted_failed_store(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reserved = l1.reserve_write([key(1)], [ALIGN])
    closing_after_the_check(l1, monkeypatch)
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError):
        l1.write_object(reserved[key(1)], PAYLOAD)
    assert l1.failures().get("l1_write_closed") == 1
    assert "closed while an object was being written" in caplog.text


def test_a_fill_loan_whose_l1_closes_before_its_view_is_taken_is_a_counted_failed_store(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A front end's inline store and a prefetch's load borrow the extent to fill (the
    # arena's own bytes) or a staging buffer committed into the NVMe file afterwards.
    reserved = l1.reserve_write([key(1)], [ALIGN])
    closing_after_the_check(l1, monkeypatch)
    with pytest.raises(KeyError):
        loan = l1.lend(reserved[key(1)], fill=True)
        loan.buffer[:] = PAYLOAD
        loan.commit()
    assert l1.failures().get("l1_write_closed") == 1


def test_staged_fills_whose_l1_closes_before_their_commit_are_counted_and_logged_once(
    nvme_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # An NVMe L1 lends a staging buffer: a close landing while it is filled is found by
    # the commit, which is then the failed store (a burst of them at a stop: one line).
    with L1Manager(16 * ALIGN, align=ALIGN, nvme_path=str(nvme_dir)) as l1:
        reserved = l1.reserve_write([key(1), key(2), key(3)], [ALIGN] * 3)
        loans = [l1.lend(obj, fill=True) for obj in reserved.values()]
        l1.close()
        with caplog.at_level(logging.WARNING):
            for loan in loans:
                loan.buffer[:] = PAYLOAD
                with pytest.raises(KeyError):
                    loan.commit()
        assert l1.failures().get("l1_write_closed") == 3
        assert caplog.text.count("closed while an object was being written") == 1


def test_a_write_refused_for_another_reason_is_not_counted_as_closed(l1: L1Manager) -> None:
    # A released backing is told apart by L1 being closed: other errors stay theirs.
    reserved = l1.reserve_write([key(1)], [ALIGN])
    with pytest.raises(ValueError, match="holds"):
        l1.write_object(reserved[key(1)], PAYLOAD[:100])
    assert "l1_write_closed" not in l1.failures()
