"""A lookup the circuit breaker gave up at ``call_timeout_s`` may still be reading in the
backend -- a plain backend's call left on its thread, or a coroutine that swallows its
cancellation (a client library retrying through it) -- and judge what it read after a
store of the key landed: the store must count as one that ran while the record was read.
Otherwise an old record of another key, read before the store replaced it, is taken for
the key's current one -- and the store's entry released (its bytes uncounted, the
eviction policy told it is gone) although its record is the one in the store."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import pytest
from l2_backends import AsyncDictBackend, DictBackend, DictConfig, open_dict

from lmcache_tiers.config import CircuitConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, ObjectSize
from lmcache_tiers.l2.record import RecordError, encode_header
from lmcache_tiers.plugin import BackendContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.threads import DEADLINE_S

KEY = ObjectKey("llama", 0, b"\x01" * 16)
OTHER = ObjectKey("llama", 0, b"\x02" * 16)
SIZE = 1000


def judged(
    context: BackendContext, keys: Sequence[ObjectKey], values: list[bytes | None]
) -> list[int | ObjectSize | None]:
    """The sizes of ``values`` read as records (a kept record of another key: a miss,
    ``kept_record``)."""
    found: list[int | ObjectSize | None] = []
    for key, value in zip(keys, values, strict=True):
        try:
            header = None if value is None else context.read_record_header(value, key)
        except RecordError as exc:
            context.kept_record(key, exc)
            header = None
        found.append(None if header is None else ObjectSize(header.payload_len, header.l1_size))
    return found


class SlowJudge(DictBackend):
    """Records; a lookup holding ``hold`` reads the record, then waits for ``let_judge``
    on its thread -- left there by the circuit's timeout -- before judging it."""

    def __init__(self, config: DictConfig, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.hold = False
        self.read = threading.Event()
        #: set once the lookup goes on past its timeout (a thread is simply left running)
        self.went_on = self.read
        self.judge = threading.Event()
        self.judged = threading.Event()

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        with self.lock:
            values = [self.objects.get(key) for key in keys]
        held = self.hold
        if held:
            self.read.set()
            assert self.judge.wait(DEADLINE_S), "the test never let the left lookup judge"
        found = judged(self.context, keys, values)
        if held:
            self.judged.set()
        return found

    def let_judge(self) -> None:
        self.judge.set()


class SwallowsCancellation(AsyncDictBackend):
    """Records; a coroutine lookup holding ``hold`` reads the record, then waits for
    ``let_judge`` -- catching every cancellation and waiting on -- before judging it."""

    def __init__(self, config: DictConfig, context) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, context)
        self.hold = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self.judge: asyncio.Event | None = None
        self.read = threading.Event()
        #: set once the lookup swallowed its cancellation and went on
        self.went_on = threading.Event()
        self.judged = threading.Event()

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:  # type: ignore[override]
        with self.lock:
            values = [self.objects.get(key) for key in keys]
        held = self.hold
        if held:
            self.loop, self.judge = asyncio.get_running_loop(), asyncio.Event()
            self.read.set()
            while not self.judge.is_set():
                try:
                    await self.judge.wait()
                except asyncio.CancelledError:
                    self.went_on.set()
        found = judged(self.context, keys, values)
        if held:
            self.judged.set()
        return found

    def let_judge(self) -> None:
        assert self.loop is not None and self.judge is not None
        self.loop.call_soon_threadsafe(self.judge.set)


@pytest.mark.parametrize("backend_class", [SlowJudge, SwallowsCancellation], ids=["thread", "coroutine"])
def test_a_store_landing_under_a_lookup_left_at_its_timeout_keeps_its_entry(
    adapters: list[BackendAdapter], backend_class: type[SlowJudge | SwallowsCancellation]
) -> None:
    adapter = open_dict(
        backend_class,
        records=True,
        circuit=CircuitConfig(enabled=True, failure_threshold=100, call_timeout_s=0.05),
    )
    adapters.append(adapter)
    backend = adapter.backend.inner  # type: ignore[attr-defined]
    assert isinstance(backend, backend_class)
    client = BlockingAdapterClient(adapter)
    assert client.store([KEY], [memoryview(bytes(SIZE))]) == [True]
    # Another writer's record of another key replaces it under the key's name.
    backend.objects[KEY] = encode_header(OTHER, b"x" * SIZE) + b"x" * SIZE
    backend.hold = True

    assert client.lookup_and_lock([KEY]).found == [False], "given up at its timeout: a miss"
    assert backend.read.is_set()
    assert backend.went_on.wait(DEADLINE_S), "the left lookup goes on reading"
    assert adapter.stats().get("circuit_call_timeouts") == 1
    backend.hold = False
    # This adapter stores the key again while the lookup left behind still reads.
    assert client.store([KEY], [memoryview(bytes(2 * SIZE))]) == [True]
    stored = adapter.state.accounting.get(KEY)
    assert stored == ObjectSize(2 * SIZE, 2 * SIZE)
    backend.let_judge()
    assert backend.judged.wait(DEADLINE_S)

    assert adapter.state.accounting.get(KEY) is stored, "the store's entry stays"
    assert adapter.used_bytes() == 2 * SIZE
    assert adapter.stats().get("objects_vanished", 0) == 0
    assert client.lookup_and_lock([KEY]).found == [True]
    adapter.unlock([KEY])
