"""Closing an NVMe L1 while a transfer is stuck (a hung disk): the wait is bounded,
counted and logged, the file is released by the last transfer to end, and the L1 lock is
not held meanwhile."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager, NvmeL1File
from lmcache_tiers.l1 import nvme as nvme_module
from lmcache_tiers.l1.nvme import DIRECT_IO_ALIGN, FILE_PREFIX, FILE_SUFFIX

SIZE = 3 * DIRECT_IO_ALIGN
KEY = ObjectKey("test-model", 0, b"stuck-read")


def block_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{FILE_PREFIX}*{FILE_SUFFIX}"))


class HungDisk:
    """Reads of the NVMe file wait at ``gate`` inside the transfer, as a read from a hung
    disk would (there is no hung disk to test on); ``entered`` is set once one waits."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        pread_all = NvmeL1File._pread_all

        def stuck_pread_all(file: NvmeL1File, buffer: memoryview, offset: int) -> None:
            self.entered.set()
            assert self.gate.wait(60), "the test never let the stuck read go"
            pread_all(file, buffer, offset)

        monkeypatch.setattr(NvmeL1File, "_pread_all", stuck_pread_all)


@pytest.fixture
def hung_disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[HungDisk]:
    disk = HungDisk(monkeypatch)
    yield disk
    disk.gate.set()  # a test that failed midway must not leave a reader stuck


def stuck_reader(l1: L1Manager, disk: HungDisk) -> tuple[threading.Thread, list[BaseException]]:
    """An object stored, and a thread reading it that is stuck in the disk."""
    obj = l1.reserve_write([KEY], [SIZE])[KEY]
    l1.write_object(obj, memoryview(bytes(range(256)) * (SIZE // 256)))
    assert l1.finish_write([KEY]) == [True]
    (reading,) = l1.reserve_read([KEY]).values()
    ended: list[BaseException] = []

    def read() -> None:
        try:
            l1.read_object(reading, memoryview(bytearray(SIZE)))
        except BaseException as exc:  # L1 closed under it: refused, which is expected
            ended.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert disk.entered.wait(10), "the read never reached the disk"
    return reader, ended


def test_close_waits_a_bounded_time_for_a_stuck_transfer_and_counts_it(
    nvme_dir: Path, hung_disk: HungDisk, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(nvme_module, "CLOSE_WAIT_S", 0.0)
    l1 = L1Manager(16 * DIRECT_IO_ALIGN, nvme_path=str(nvme_dir))
    reader, _ = stuck_reader(l1, hung_disk)
    with caplog.at_level(logging.ERROR, logger="lmcache_tiers.l1.nvme"):
        l1.close()  # returns although the read is still in the disk
    assert l1.failures().get("l1_nvme_close_transfers_left") == 1
    assert "1 transfers still running" in caplog.text
    # Not closed under the read: its descriptor number could be reused by another open().
    assert len(block_files(nvme_dir)) == 1
    hung_disk.gate.set()
    reader.join(10)
    assert not reader.is_alive()
    assert block_files(nvme_dir) == []  # the last transfer to end released the file


def test_close_lets_go_of_the_l1_lock_while_it_waits_for_transfers(
    nvme_dir: Path, hung_disk: HungDisk, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nvme_module, "CLOSE_WAIT_S", 60.0)  # waits until the read ends
    l1 = L1Manager(16 * DIRECT_IO_ALIGN, nvme_path=str(nvme_dir))
    reader, _ = stuck_reader(l1, hung_disk)
    file = l1._backing
    assert isinstance(file, NvmeL1File)
    closer = threading.Thread(target=l1.close)
    closer.start()
    # The close reached the file: it waits for the read from now on.  (A bound on waiting
    # for work that is already due, not a timing assertion.)
    deadline = time.monotonic() + 10.0
    while not file.closed:
        assert time.monotonic() < deadline, "the close never reached the file"
        time.sleep(0.01)
    # Asked without waiting: whether the lock is free depends on who holds it, not timing.
    free = l1.lock.acquire(blocking=False)
    if free:
        l1.lock.release()
    served = free and not l1.contains(KEY)  # another L1 call, answered: L1 is closed
    hung_disk.gate.set()
    reader.join(10)
    closer.join(10)
    assert free and served
    assert not closer.is_alive()
    assert "l1_nvme_close_transfers_left" not in l1.failures()  # the read ended in time
    assert block_files(nvme_dir) == []
