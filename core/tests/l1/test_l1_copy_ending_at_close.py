"""An L1 closing while a copy out of it runs, after the copy's own transfer ended but before
its checks that the bytes were the object's, answers a miss counted as ``l1_read_closed``
and logged: never the uncounted KeyError of an object that left L1, nor the RuntimeError of
a closed backing.  A write whose copy ended as L1 closed fails the same way, counted as
``l1_write_closed``: it will never be committed."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from l1_closing import ALIGN, memory_or_nvme_l1

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

PAYLOAD = memoryview(bytes(range(256)) * (ALIGN // 256))


def key(index: int) -> ObjectKey:
    return ObjectKey("copy-ending-at-close", 0, index.to_bytes(8, "big"))


@pytest.fixture(params=["memory", "nvme"])
def l1(request: pytest.FixtureRequest) -> Iterator[L1Manager]:
    yield from memory_or_nvme_l1(request)


def stored(l1: L1Manager, stored_key: ObjectKey) -> None:
    reserved = l1.reserve_write([stored_key], [ALIGN])
    l1.write_object(reserved[stored_key], PAYLOAD)
    assert l1.finish_write([stored_key]) == [True]


def closing_after_the_transfer(l1: L1Manager, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """Close ``l1`` right after its backing's ``method`` (``read_into``, ``write_from``) moved
    the bytes: the close lands between the transfer and the checks that follow it."""
    backing = l1._backing
    transfer = getattr(backing, method)

    def transfer_then_close(*args: object) -> None:
        transfer(*args)
        l1.close()

    monkeypatch.setattr(backing, method, transfer_then_close)


def test_a_read_whose_l1_closes_as_its_copy_ends_is_a_counted_miss(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stored(l1, key(1))
    (obj,) = l1.reserve_read([key(1)]).values()
    closing_after_the_transfer(l1, monkeypatch, "read_into")
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError, match="L1 closed"):
        l1.read_object(obj, memoryview(bytearray(ALIGN)))
    assert l1.failures().get("l1_read_closed") == 1
    assert "closed while an object was being read" in caplog.text


def test_a_read_loan_whose_l1_closes_before_its_copy_ends_is_a_counted_miss(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # An arena loan's bytes are copied by its borrower (detach): the arena stays mapped
    # for the loan's view, and the check after the copy finds L1 closed.
    with L1Manager(16 * ALIGN, align=ALIGN, prefault=False) as l1:
        stored(l1, key(1))
        (obj,) = l1.reserve_store([key(1)]).values()
        loan = l1.lend(obj)
        with caplog.at_level(logging.WARNING):
            l1.close()
            with pytest.raises(KeyError, match="L1 closed"):
                loan.detach()
            loan.buffer.release()
        assert l1.failures().get("l1_read_closed") == 1


def test_an_nvme_read_whose_l1_closes_before_its_write_back_check_is_a_counted_miss(
    nvme_dir: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The NVMe L1 asks the file about write-back errors after a copy: a closed file
    # refuses the question (RuntimeError), which is the close's miss too.
    with L1Manager(16 * ALIGN, align=ALIGN, nvme_path=str(nvme_dir)) as l1:
        stored(l1, key(1))
        (obj,) = l1.reserve_read([key(1)]).values()
        bytes_ = l1._bytes
        check_kept = bytes_._check_kept

        def kept_then_close(checked: object) -> None:
            check_kept(checked)  # type: ignore[arg-type]
            l1.close()

        monkeypatch.setattr(bytes_, "_check_kept", kept_then_close)
        with pytest.raises(KeyError, match="L1 closed"):
            l1.read_object(obj, memoryview(bytearray(ALIGN)))
        assert l1.failures().get("l1_read_closed") == 1


def test_a_write_whose_l1_closes_as_its_copy_ends_is_a_counted_failed_store(
    l1: L1Manager, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    reserved = l1.reserve_write([key(1)], [ALIGN])
    closing_after_the_transfer(l1, monkeypatch, "write_from")
    with caplog.at_level(logging.WARNING), pytest.raises(KeyError, match="L1 closed"):
        l1.write_object(reserved[key(1)], PAYLOAD)
    assert l1.failures().get("l1_write_closed") == 1
    assert "closed while an object was being written" in caplog.text


def test_a_read_of_an_object_that_left_an_open_l1_is_not_counted_as_closed(l1: L1Manager) -> None:
    # The same check after the copy, for an L1 still open: the object's own miss.
    stored(l1, key(1))
    (obj,) = l1.reserve_read([key(1)]).values()
    assert l1.delete([key(1)], force=True) == [True]
    l1.finish_read([key(1)])
    with pytest.raises(KeyError):
        l1.read_object(obj, memoryview(bytearray(ALIGN)))
    assert "l1_read_closed" not in l1.failures()
