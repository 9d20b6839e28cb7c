"""A transfer past its deadline is counted for /metrics, not only logged.

It is still waited for (its memory cannot be given back while the kernel may still move
it), so a stalled device holds it for good: ``transfers_past_deadline`` counts such
transfers and ``transfers_stuck`` says how many wait past their deadline now -- what an
operator alerts on.  The stall is real: a READ through NIXL's POSIX AIO from a FIFO nobody
writes to, released (by writing to it) only once the gauge showed the transfer stuck.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_nixl import runtime as runtime_module
from lmcache_plugin_nixl.memory import buffer_address
from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError, OverdueTransfers, descriptors


def test_a_transfer_past_its_deadline_is_counted_and_shown_stuck_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_module, "TRANSFER_TIMEOUT_S", 0.0)  # past it at the first look
    shared = NixlRuntime.shared()
    runtime = NixlRuntime(shared.api, shared.module_name)  # an agent of its own: other POSIX params
    runtime.ensure_backend("POSIX", {"use_posix_aio": "true"})
    fifo = tmp_path / "stalled"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)  # read-write: opening does not wait for a writer
    memory = mmap.mmap(-1, 4096)
    view = memoryview(memory)
    dram = runtime.register_dram("POSIX", [(buffer_address(view), 4096)])
    files = runtime.register_files("POSIX", [fd])
    overdue = OverdueTransfers()
    seen_stuck: list[dict[str, int]] = []
    check = runtime._transfer_state

    def state_once_seen_stuck(handle: Any) -> str:
        # The storage answers only once the wait reported the transfer stuck.
        if not seen_stuck and overdue.stats()["transfers_stuck"]:
            seen_stuck.append(overdue.stats())
            os.write(fd, b"late" * 1024)
        return check(handle)

    monkeypatch.setattr(runtime, "_transfer_state", state_once_seen_stuck)
    try:
        request = (descriptors([(buffer_address(view), 4096, 0)]), descriptors([(0, 4096, fd)]))
        try:
            runtime.transfer_many("POSIX", "READ", [request], "FILE", overdue=overdue)
        except NixlTransferError:
            pass  # how the READ ended does not matter here: that it was counted does
        assert seen_stuck == [{"transfers_past_deadline": 1, "transfers_stuck": 1}]
        assert overdue.stats() == {"transfers_past_deadline": 1, "transfers_stuck": 0}, (
            "one transfer past its deadline, counted once however many periods; none stuck now"
        )
    finally:
        files.release()
        dram.release()
        os.close(fd)
        view.release()
        memory.close()
