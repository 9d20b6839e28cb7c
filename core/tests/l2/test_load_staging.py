"""A load whose staging buffer cannot be had (the serde chain decodes from one) fails that
object, counted and logged, and holds nothing afterwards -- on worker threads and on an
event loop alike."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence

import pytest
from l2_backends import AsyncDictBackend, DictBackend, DictConfig, Xor, open_dict

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, BackendContext, ObjectSize
from lmcache_tiers.l2.state import MAX_OBJECT_BYTES
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

SIZE = 1000
#: a stored size beyond a process's address space (47 bits of it without an mmap hint,
#: even under 5-level paging): mmap fails with ENOMEM.  The largest a lookup takes for
#: any object's: past it the size is refused before any load (test_impossible_sizes.py).
HUGE = MAX_OBJECT_BYTES


def _huge_answer(backend: DictBackend, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
    """The dict's answer, with the stored size of ``backend.huge`` beyond any memory."""
    found = DictBackend.contains_many(backend, keys)
    huge = getattr(backend, "huge", None)
    return [
        ObjectSize(HUGE, SIZE) if key == huge and size else size
        for key, size in zip(keys, found, strict=True)
    ]


class HugeStored(DictBackend):
    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        return _huge_answer(self, keys)


class AsyncHugeStored(AsyncDictBackend):
    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:  # type: ignore[override]
        return _huge_answer(self, keys)


@pytest.mark.parametrize("backend", [HugeStored, AsyncHugeStored], ids=["plain", "coroutines"])
def test_a_load_whose_staging_buffer_cannot_be_mapped_fails_that_key_only(
    adapters: list[BackendAdapter], backend: type[DictBackend]
) -> None:
    adapter = open_dict(backend, serde=[Xor()])
    adapters.append(adapter)
    huge, fine = make_keys(2)
    adapter.backend.huge = huge  # type: ignore[attr-defined]
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store([huge, fine], [memoryview(bytes([7]) * SIZE)] * 2) == [True, True]
    assert client.lookup_and_lock([huge, fine]).found == [True, True]

    buffers = [memoryview(bytearray(SIZE)), memoryview(bytearray(SIZE))]
    assert client.load([huge, fine], buffers) == [False, True]

    assert bytes(buffers[1]) == bytes([7]) * SIZE
    adapter.unlock([huge, fine])
    assert adapter.pinned_keys() == {}, "the load's own pins are gone"
    stats = adapter.stats()
    assert stats["load_staging_failures"] == 1
    assert stats["pending_tasks"] == 0


class StalledRead(AsyncDictBackend):
    """Reads through an executor thread blocked on a device that does not answer (a pipe):
    cancelling the coroutine leaves the thread holding the staging buffer."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.pipe = -1
        self.reading = threading.Event()

    def _read(self, buffer: memoryview) -> int:
        self.reading.set()
        return os.readv(self.pipe, [buffer])

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        await asyncio.get_running_loop().run_in_executor(None, self._read, buffers[0])
        return [True] * len(keys)


def test_a_load_abandoned_on_close_while_its_staging_buffer_is_still_read_into_holds_nothing() -> None:
    adapter = open_dict(StalledRead, serde=[Xor()])
    adapter.close_timeout_s = 0.2
    # The loop's thread cannot end while the reader holds its executor: close waits the
    # whole backend-close budget for it, which is no part of what is checked here.
    adapter.close_backend_timeout_s = 0.2
    backend: StalledRead = adapter.backend  # type: ignore[assignment]
    reader, writer = os.pipe()
    backend.pipe = reader
    try:
        (key,) = make_keys(1)
        client = BlockingAdapterClient(adapter, timeout=10.0)
        assert client.store([key], [memoryview(bytes([7]) * SIZE)]) == [True]
        task_id = adapter.submit_load([key], [memoryview(bytearray(SIZE))])
        assert backend.reading.wait(10)
        adapter.close()
        assert adapter.pop_completed_loads() == {task_id: [False]}
        assert adapter.pinned_keys() == {}, "the abandoned load's pin is gone"
        assert adapter.stats()["load_keys_failed"] == 1
    finally:
        os.write(writer, bytes(SIZE))  # the late reader ends, into memory still mapped
        os.close(writer)
        os.close(reader)
