"""Small dict backends (plain and coroutine) the L2 tests run the adapter on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Annotated, Any, TypeVar

import msgspec

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.controllers.l2_eviction import L2EvictionController
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, BackendAdapter, BackendContext, ObjectSize, create_adapter
from lmcache_tiers.l2.record import RecordError, decode_record, verify_payload
from lmcache_tiers.l2.runners import LoopRunner
from lmcache_tiers.serde import Serde, SerdeContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import DeflateSerde

# the tests' bounded poll, re-exported: one for core's tests and the plugins'
from lmcache_tiers.testing.threads import DEADLINE_S
from lmcache_tiers.testing.threads import wait_until as wait_until

T = TypeVar("T")


class DictConfig(L2AdapterConfig):
    """Objects in a process-wide dict (shared per namespace), optionally as records."""

    namespace: Annotated[str, msgspec.Meta(description="The shared dict this adapter stores in.")] = ""
    capacity: Annotated[int | None, msgspec.Meta(description="Bytes it holds at most; None: no limit.")] = (
        None
    )
    records: Annotated[
        bool,
        msgspec.Meta(
            description="Store header and payload and verify both on every read, as persistent backends do."
        ),
    ] = False


_SPACES: dict[str, dict[ObjectKey, bytes]] = {}


class DictBackend:
    """Plain batch I/O on one dict; with ``records`` it stores and checks record headers."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        self.config = config
        self.context = context
        self.lock = threading.Lock()
        self.objects = _SPACES.setdefault(config.namespace or uuid.uuid4().hex, {})
        self.calls: dict[str, int] = {}

    def _called(self, method: str) -> None:
        self.calls[method] = self.calls.get(method, 0) + 1

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        self._called("put_many")
        with self.lock:
            for key, payload in zip(keys, payloads, strict=True):
                header = self.context.record_header(key, payload) if self.config.records else b""
                self.objects[key] = header + bytes(payload)
        return [True] * len(keys)

    def _drop_corrupt(self, key: ObjectKey) -> None:
        self.objects.pop(key, None)
        self.context.count("corrupt_records_removed")

    def _size(self, key: ObjectKey, value: bytes) -> int | ObjectSize | None:
        if not self.config.records:
            return len(value)
        try:
            header = self.context.read_record_header(value, key)
        except RecordError:
            self._drop_corrupt(key)
            return None
        return None if header is None else ObjectSize(header.payload_len, header.l1_size)

    def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:
        self._called("contains_many")
        with self.lock:
            return [None if key not in self.objects else self._size(key, self.objects[key]) for key in keys]

    def _payload(self, key: ObjectKey, value: bytes) -> bytes | None:
        if not self.config.records:
            return value
        try:
            header = self.context.read_record_header(value, key)
            if header is None:
                return None
            payload = memoryview(value)[header.header_len :]
            verify_payload(header, payload)
        except RecordError:
            self._drop_corrupt(key)
            return None
        return bytes(payload)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        self._called("get_many_into")
        ok = []
        with self.lock:
            for key, buffer in zip(keys, buffers, strict=True):
                value = self.objects.get(key)
                payload = None if value is None else self._payload(key, value)
                if payload is None or len(payload) != buffer.nbytes:
                    ok.append(False)
                    continue
                buffer[:] = payload
                ok.append(True)
        return ok

    def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:
        with self.lock:
            return [self.objects.pop(key, None) is not None for key in keys]

    def list_keys(self) -> list[tuple[ObjectKey, int]]:
        with self.lock:
            items = list(self.objects.items())
        if not self.config.records:
            return [(key, len(value)) for key, value in items]
        # As a file store lists: stored sizes from the object sizes, headers not read.
        return [(key, decode_record(value)[0].payload_len) for key, value in items]

    def capacity(self) -> int | None:
        return self.config.capacity


class AsyncDictBackend(DictBackend):
    """The same dict behind coroutines, with optional open and close."""

    def __init__(self, config: DictConfig, context: BackendContext) -> None:
        super().__init__(config, context)
        self.opened = 0
        self.closed = 0

    async def open(self) -> None:
        self.opened += 1

    async def close(self) -> None:
        self.closed += 1

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        await asyncio.sleep(0)
        return DictBackend.put_many(self, keys, payloads)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> list[int | ObjectSize | None]:  # type: ignore[override]
        await asyncio.sleep(0)
        return DictBackend.contains_many(self, keys)

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:  # type: ignore[override]
        await asyncio.sleep(0)
        return DictBackend.get_many_into(self, keys, buffers)

    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]:  # type: ignore[override]
        await asyncio.sleep(0)
        return DictBackend.delete_many(self, keys)

    async def list_keys(self) -> AsyncIterator[tuple[ObjectKey, int]]:  # type: ignore[override]
        for item in DictBackend.list_keys(self):
            await asyncio.sleep(0)
            yield item


class Xor:
    """Size-preserving transform: proves the chain runs without changing any size."""

    name = "xor"

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(b ^ 0x5A for b in data)

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(b ^ 0x5A for b in data)


#: a size-changing serde (deflate)
Zlib = DeflateSerde


def open_dict(
    backend: type[DictBackend] = DictBackend, *, serde: Sequence[Serde] = (), **config: Any
) -> BackendAdapter:
    settings = DictConfig(**config)
    facts = AdapterContext(index=0, name="0:t", config=settings, serde=tuple(serde))
    adapter = create_adapter(backend, settings, facts)
    assert isinstance(adapter, BackendAdapter)
    return adapter


def keys_of(model: str, count: int) -> list[ObjectKey]:
    """``count`` keys of ``model``, numbered from 0."""
    return [ObjectKey(model, 0, index.to_bytes(8, "big")) for index in range(count)]


def store_blank(adapter: BackendAdapter, keys: Sequence[ObjectKey], size: int) -> None:
    """Stores ``size`` zero bytes under each key, every one of them acknowledged."""
    stored = BlockingAdapterClient(adapter).store(list(keys), [memoryview(bytearray(size)) for _ in keys])
    assert stored == [True] * len(keys)


def namespace_holding(keys: Sequence[ObjectKey], size: int) -> str:
    """A new namespace in which ``keys`` were stored (``size`` bytes each) by an adapter
    now closed, so that the next adapter on it lists them in its start-up scan."""
    namespace = uuid.uuid4().hex
    holder = open_dict(DictBackend, namespace=namespace)
    store_blank(holder, keys, size)
    holder.close()
    return namespace


#: how long a test waits for what must happen; never a measure of speed
WAIT_BOUND_S = DEADLINE_S


def off_the_main_thread(call: Callable[[], T]) -> T:
    """``call`` on a thread of its own (as the server's start-up scan and the eviction
    policy's seeding read a listing), waited for up to WAIT_BOUND_S; what it raised -- a
    BaseException too, which must not end the test run -- is raised here."""
    outcome: list[tuple[T | None, BaseException | None]] = []

    def run() -> None:
        try:
            outcome.append((call(), None))
        except BaseException as exc:
            outcome.append((None, exc))

    caller = threading.Thread(target=run, daemon=True)
    caller.start()
    caller.join(WAIT_BOUND_S)
    assert outcome, "the call never returned"
    result, failure = outcome[0]
    if failure is not None:
        raise failure
    return result  # type: ignore[return-value]


def end_the_loop() -> None:
    """Schedule a SystemExit on the running loop (a client library's callback calling
    ``sys.exit``): asyncio lets it through, and the loop's thread ends."""
    asyncio.get_running_loop().call_soon(sys.exit, "a client library's callback")


def running_loop_runner(adapters: list[BackendAdapter], backend: object) -> tuple[BackendAdapter, LoopRunner]:
    """A loop runner over ``backend`` sharing a dict adapter's state (appended to
    ``adapters``, closed by their fixture), its loop running and its open done."""
    adapter = open_dict(AsyncDictBackend)
    adapters.append(adapter)
    runner = LoopRunner(adapter.state, backend, lambda *_: None, 1)
    opened: concurrent.futures.Future[None] = concurrent.futures.Future()
    opened.set_result(None)
    runner._opened = opened
    runner._thread.start()
    return adapter, runner


class Fifo:
    """Eviction policy: oldest write first."""

    def __init__(self) -> None:
        self.order: dict[ObjectKey, None] = {}

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            self.order.pop(key, None)
            self.order[key] = None

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        return None

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            self.order.pop(key, None)

    def victims(self) -> Iterator[ObjectKey]:
        return iter(list(self.order))


#: a bound on how long an eviction cycle may take, for a test that would otherwise hang on
#: the defect it looks for: a cycle that ends never comes near it
CYCLE_BOUND_S = 30.0


def step_returns(controller: L2EvictionController) -> bool:
    """One eviction cycle on a thread of its own: True if it ended (False: stuck in a
    listing or a delete)."""
    cycle = threading.Thread(target=controller.step, args=(set(),), daemon=True)
    cycle.start()
    cycle.join(CYCLE_BOUND_S)
    return not cycle.is_alive()


def join_left_running(controller: L2EvictionController, work: str) -> None:
    """Wait (bounded) for the controller's ``work`` threads -- ``listing`` or ``delete`` --
    that cycles left running past their deadline."""
    for thread in threading.enumerate():
        if thread.name == f"{controller.name}-{work}":
            thread.join(CYCLE_BOUND_S)
