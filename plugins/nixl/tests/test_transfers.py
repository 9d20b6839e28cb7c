"""Batched NIXL transfers: write-back cut into pieces, and a request that fails."""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
import time
from pathlib import Path

import pytest
from lmcache_plugin_nixl import runtime as runtime_module
from lmcache_plugin_nixl.memory import buffer_address
from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError, descriptors
from lmcache_plugin_nixl.transfers import pieces
from stalled_fifo import stalled_read

MIB = 1 << 20


def test_pieces_cut_long_items_from_their_own_start_and_pack_short_ones() -> None:
    addresses = [1000 * MIB, 2000 * MIB, 3000 * MIB, 4000 * MIB]
    rows = [(0, 5 * MIB + 4096, 7), (8192, MIB // 2, 8), (0, MIB // 2, 9), (4096, 2 * MIB, 10)]
    got = pieces(addresses, rows, 2 * MIB)
    assert got == [
        ([(1000 * MIB, 2 * MIB, 0)], [(0, 2 * MIB, 7)]),
        ([(1000 * MIB + 2 * MIB, 2 * MIB, 0)], [(2 * MIB, 2 * MIB, 7)]),
        # the long item's last 1 MiB + 4 KiB, and the next item with it while they fit
        (
            [(1000 * MIB + 4 * MIB, MIB + 4096, 0), (2000 * MIB, MIB // 2, 0)],
            [(4 * MIB, MIB + 4096, 7), (8192, MIB // 2, 8)],
        ),
        ([(3000 * MIB, MIB // 2, 0)], [(0, MIB // 2, 9)]),
        ([(4000 * MIB, 2 * MIB, 0)], [(4096, 2 * MIB, 10)]),
    ]


def test_pieces_cover_every_byte_once_and_never_pass_the_limit() -> None:
    lengths = [1, 4096, 3 * MIB - 1, 2 * MIB, 2 * MIB + 1, 7 * MIB]
    addresses = [index * 64 * MIB for index in range(len(lengths))]
    rows = [(index * 4096, length, index) for index, length in enumerate(lengths)]
    for limit in (4096, MIB, 2 * MIB, 64 * MIB):
        got = pieces(addresses, rows, limit)
        covered: dict[int, list[tuple[int, int]]] = {}
        for dram, storage in got:
            assert sum(length for _, length, _ in dram) <= limit or len(dram) == 1
            for (address, length, zero), (offset, same, device) in zip(dram, storage, strict=True):
                assert zero == 0 and same == length <= limit
                assert address - addresses[device] == offset - rows[device][0]  # same place in the item
                covered.setdefault(device, []).append((offset - rows[device][0], length))
        for device, length in enumerate(lengths):
            spans = covered[device]
            assert spans[0][0] == 0 and sum(size for _, size in spans) == length
            assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(spans))


def test_a_failed_request_fails_the_call_after_the_posted_ones_ended(tmp_path: Path) -> None:
    runtime = NixlRuntime.shared()
    runtime.ensure_backend("POSIX", {})
    memory = mmap.mmap(-1, 2 * MIB)
    memory[:] = bytes(range(256)) * (2 * MIB // 256)
    view = memoryview(memory)
    address = buffer_address(view)
    path = tmp_path / "target"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.ftruncate(fd, MIB)
    dram = runtime.register_dram("POSIX", [(address, 2 * MIB)])
    files = runtime.register_files("POSIX", [fd])
    closed = os.open(tmp_path / "closed", os.O_CREAT | os.O_RDWR, 0o600)
    os.close(closed)  # a descriptor nothing is open under: its request cannot succeed
    try:
        good = (descriptors([(address, MIB, 0)]), descriptors([(0, MIB, fd)]))
        bad = (descriptors([(address + MIB, MIB, 0)]), descriptors([(0, MIB, closed)]))
        with pytest.raises(NixlTransferError):
            runtime.transfer_many("POSIX", "WRITE", [good, bad], "FILE", background=True)
        # The request that was posted ended before the call returned: its bytes are there.
        assert os.pread(fd, MIB, 0) == bytes(view[:MIB])
        runtime.transfer_many("POSIX", "WRITE", [good], "FILE", background=True)  # handles were given back
    finally:
        files.release()
        dram.release()
        os.close(fd)
        view.release()
        memory.close()


def test_a_transfer_past_its_deadline_is_waited_for_before_its_memory_is_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NIXL cannot cancel a request the kernel is still working on: releasing its handle
    does not stop the I/O.  A READ from storage that stalls past the deadline (a hung
    mount; here a FIFO nobody writes to yet, read through POSIX AIO, which completes
    asynchronously) must not return while it may still land in memory the caller then
    gives back (an L1 extent, a staging block) -- the late bytes would overwrite whatever
    owns that memory next."""
    monkeypatch.setattr(runtime_module, "TRANSFER_TIMEOUT_S", 0.3)
    with stalled_read(tmp_path) as stalled:
        late = threading.Timer(1.5, os.write, (stalled.fd, b"late" * 1024))
        late.start()
        try:
            try:
                stalled.runtime.transfer_many("POSIX", "READ", [stalled.request], "FILE")
            except NixlTransferError:
                pass
            at_return = bytes(stalled.view)
            late.join()
            time.sleep(0.5)
            assert bytes(stalled.view) == at_return, "bytes landed in the memory after the transfer returned"
            assert "NIXL READ on POSIX still running" in caplog.text, "a stalled transfer is reported"
        finally:
            late.cancel()


def test_a_request_that_fails_while_another_runs_waits_for_the_other(tmp_path: Path) -> None:
    """NIXL raises from its state check for a request that failed (on the POSIX backend's
    default queue, only for that request: the others go on reporting their own state).
    Requests posted with it (write-back pieces) may still be running: the call must not
    return, and its memory be given back, before they end -- their late bytes would come
    from whatever owns that memory next.  Here the second request writes to a FIFO whose
    buffer is full (running until it is drained, through POSIX AIO), and the first
    request's check fails as a failed request's does."""
    shared = NixlRuntime.shared()
    runtime = NixlRuntime(shared.api, shared.module_name)  # an agent of its own: other POSIX params
    runtime.ensure_backend("POSIX", {"use_posix_aio": "true"})
    memory = mmap.mmap(-1, 8192)
    view = memoryview(memory)
    view[:] = b"A" * 8192
    address = buffer_address(view)
    target = os.open(tmp_path / "target", os.O_CREAT | os.O_RDWR, 0o600)
    fifo = tmp_path / "stalled"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    queued = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            queued += os.write(fd, b"q" * 4096)
    os.set_blocking(fd, True)
    dram = runtime.register_dram("POSIX", [(address, 8192)])
    files = runtime.register_files("POSIX", [target, fd])
    agent = runtime.agent
    first: list[object] = []

    class FirstRequestFails:
        def __getattr__(self, name: str) -> object:
            return getattr(agent, name)

        def transfer(self, handle: object) -> str:
            first.append(handle)
            return agent.transfer(handle)

        def check_xfer_state(self, handle: object) -> str:
            if handle is first[0]:
                raise RuntimeError("NIXL_ERR_BACKEND")
            return agent.check_xfer_state(handle)

    runtime.agent = FirstRequestFails()
    drained = bytearray()

    def drain() -> None:
        time.sleep(1.0)
        os.set_blocking(fd, False)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            try:
                drained.extend(os.read(fd, 1 << 16))
            except BlockingIOError:
                time.sleep(0.01)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        failing = (descriptors([(address, 4096, 0)]), descriptors([(0, 4096, target)]))
        stalled = (descriptors([(address + 4096, 4096, 0)]), descriptors([(0, 4096, fd)]))
        with pytest.raises(NixlTransferError):
            runtime.transfer_many("POSIX", "WRITE", [failing, stalled], "FILE", background=True)
        view[4096:] = b"X" * 4096  # the memory's next owner
        reader.join()
        assert bytes(drained[queued:]) == b"A" * 4096, "the write read memory given back"
    finally:
        reader.join()
        runtime.agent = agent
        files.release()
        dram.release()
        os.close(fd)
        os.close(target)
        view.release()
        memory.close()
