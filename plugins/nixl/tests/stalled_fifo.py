"""A NIXL READ that stalls for real: POSIX AIO from a FIFO nobody writes to yet.

A runtime of its own (its agent takes other POSIX parameters than the shared one), one
4096-byte page of memory registered as the destination and the FIFO as the file: the READ
waits until the test writes to ``fd`` -- a hung mount, without one.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_plugin_nixl.memory import buffer_address
from lmcache_plugin_nixl.runtime import NixlRuntime, descriptors

PAGE = 4096


@dataclass
class StalledRead:
    runtime: NixlRuntime
    fd: int  # write to it to let the READ end
    view: memoryview  # the READ's destination
    request: tuple[Any, Any]  # (memory, file) descriptors for ``transfer_many(..., "READ", ...)``


@contextmanager
def stalled_read(tmp_path: Path) -> Iterator[StalledRead]:
    shared = NixlRuntime.shared()
    runtime = NixlRuntime(shared.api, shared.module_name)
    runtime.ensure_backend("POSIX", {"use_posix_aio": "true"})
    fifo = tmp_path / "stalled"
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR)  # read-write: opening does not wait for a writer
    memory = mmap.mmap(-1, PAGE)
    view = memoryview(memory)
    dram = runtime.register_dram("POSIX", [(buffer_address(view), PAGE)])
    files = runtime.register_files("POSIX", [fd])
    try:
        request = (descriptors([(buffer_address(view), PAGE, 0)]), descriptors([(0, PAGE, fd)]))
        yield StalledRead(runtime, fd, view, request)
    finally:
        files.release()
        dram.release()
        os.close(fd)
        view.release()
        memory.close()
