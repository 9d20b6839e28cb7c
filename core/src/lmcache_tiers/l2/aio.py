"""Base class for adapters whose batch I/O is written as coroutines.

The adapter gets its own asyncio loop on its own thread, started on first use.  Every
submitted task runs as a coroutine on it (at most ``max_concurrency`` backend calls at
once); serde encoding and decoding of size-changing chains run in the loop's default
executor so CPU-heavy transforms never stall other tasks.  A subclass implements::

    async def put_many(self, keys, payloads) -> list[bool]
    async def contains_many(self, keys) -> list[int | ObjectSize | None]
    async def get_many_into(self, keys, buffers) -> list[bool]
    async def delete_many(self, keys) -> list[bool]
    def aiter_keys(self) -> AsyncIterator[ObjectKey]      # an async generator
    def capacity_bytes(self) -> int | None
    async def open_backend(self) -> None                  # optional, runs on the loop first
    async def close_backend(self) -> None                 # optional, always runs once on close

with the same meaning as the synchronous methods of
:class:`~lmcache_tiers.l2.base.BatchL2Adapter`.  ``open_backend`` is where loop-bound
clients (aiohttp sessions, redis connections) are created; if it raises, every operation
fails until the adapter is closed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from abc import abstractmethod
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import AdapterContext
from lmcache_tiers.l2.core import AdapterCore, ContainsResult, log
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.l2.ops import BatchOp, DeleteOp, LoadOp, LookupOp, StoreOp

T = TypeVar("T")
#: keys fetched per cross-thread round trip by ``iter_keys``
_ITER_BATCH = 1024


class AsyncBatchL2Adapter(AdapterCore):
    """Base class of coroutine adapters; see the module docstring for the contract."""

    #: backend calls in flight at once
    max_concurrency: ClassVar[int] = 64

    def __init__(self, config: L2AdapterConfig, context: AdapterContext) -> None:
        super().__init__(config, context)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._opened: concurrent.futures.Future[None] | None = None
        self._semaphore = asyncio.Semaphore(max(1, self.max_concurrency))
        self._futures: set[concurrent.futures.Future[Any]] = set()

    # -- coroutine batch I/O, implemented by the adapter ----------------------------------

    @abstractmethod
    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]: ...

    @abstractmethod
    async def contains_many(self, keys: Sequence[ObjectKey]) -> Sequence[ContainsResult]: ...

    @abstractmethod
    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]: ...

    @abstractmethod
    async def delete_many(self, keys: Sequence[ObjectKey]) -> list[bool]: ...

    @abstractmethod
    def aiter_keys(self) -> AsyncIterator[ObjectKey]:
        """Every stored key, as an async generator."""

    async def open_backend(self) -> None:
        """Create loop-bound resources; runs once on the adapter's loop before any I/O."""

    async def close_backend(self) -> None:
        """Release the backend; runs once in ``close()`` (on the loop if it was started)."""

    # -- loop plumbing -----------------------------------------------------------------------

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        """The adapter's loop, started on first use; call with ``_state_lock`` held."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._run_loop, args=(loop,), name=f"l2-{self.name}-loop", daemon=True
            )
            self._thread.start()
            self._loop = loop
            self._opened = asyncio.run_coroutine_threadsafe(self.open_backend(), loop)
        return self._loop

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()

    def _schedule(self, coroutine_factory: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run a coroutine on the loop; call with ``_state_lock`` held."""
        future = asyncio.run_coroutine_threadsafe(coroutine_factory(), self._ensure_loop())
        self._futures.add(future)
        future.add_done_callback(self._futures.discard)
        return future

    async def _offload(self, function: Callable[[], T]) -> T:
        """Run CPU work (serde) off the loop when the chain does any."""
        if self.identity:
            return function()
        return await asyncio.get_running_loop().run_in_executor(None, function)

    async def _call(
        self, method: str, keys: list[ObjectKey], *args: Sequence[memoryview]
    ) -> list[Any] | None:
        if not keys:
            return []
        try:
            result = await getattr(self, method)(keys, *args)
            return list(self.check_result(result, len(keys), method))
        except Exception as exc:
            self.backend_failed(method, exc)
            return None

    async def _backend_ready(self) -> bool:
        assert self._opened is not None
        try:
            await asyncio.wrap_future(self._opened)
        except Exception as exc:
            self.backend_failed("open_backend", exc)
            return False
        return True

    async def _run(self, task_id: int, op: BatchOp, method: str, prepare: Callable[[], Any]) -> None:
        prepared = False
        try:
            result: list[Any] | None = None
            if await self._backend_ready():
                async with self._semaphore:
                    args = await self._offload(prepare) if method == "put_many" else prepare()
                    prepared = True
                    io_args = args if isinstance(args, tuple) else (args,)
                    result = await self._call(method, *io_args)
        except asyncio.CancelledError:
            if prepared:
                self.publish(task_id, op, op.finish(None))
            raise

        def finish() -> None:
            self.publish(task_id, op, op.finish(result))

        if method == "get_many_into":
            # Decoding may be heavy; the executor finishes and publishes even if the loop
            # task is cancelled meanwhile, so pins are never left behind.
            await self._offload(finish)
        else:
            finish()

    def _enqueue(self, op_kind: L2Op, op: BatchOp, method: str, prepare: Callable[[], Any]) -> int:
        def start(task_id: int) -> None:
            self._schedule(lambda: self._run(task_id, op, method, prepare))

        return self.submit(op_kind, len(op.keys), start)

    # -- L2Adapter --------------------------------------------------------------------------

    def submit_store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None = None,
    ) -> int:
        self.validate_batch(keys, buffers, layouts)
        op = StoreOp(self, keys, buffers, layouts)
        return self._enqueue(L2Op.STORE, op, "put_many", op.prepare)

    def submit_lookup_and_lock(self, keys: Sequence[ObjectKey]) -> int:
        op = LookupOp(self, keys)
        return self._enqueue(L2Op.LOOKUP, op, "contains_many", op.prepare)

    def submit_load(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> int:
        self.validate_batch(keys, buffers)
        op = LoadOp(self, keys, buffers)
        return self._enqueue(L2Op.LOAD, op, "get_many_into", op.prepare)

    async def _delete(self, op: DeleteOp) -> list[bool]:
        result: list[Any] | None = None
        io_keys = op.prepare()
        try:
            if await self._backend_ready():
                result = await self._call("delete_many", io_keys)
        finally:
            outcome = op.finish(result)
        return outcome

    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self.name}: delete() would block the adapter's own event loop")
        op = DeleteOp(self, keys)
        with self._state_lock:
            if self._closed:
                return [False] * len(op.keys)
            future = self._schedule(lambda: self._delete(op))
        try:
            outcome: list[bool] = future.result()
        except concurrent.futures.CancelledError:
            return [False] * len(op.keys)
        return outcome

    def iter_keys(self) -> Iterator[ObjectKey]:
        with self._state_lock:
            if self._closed:
                return
            loop = self._ensure_loop()
        generator = self.aiter_keys()

        async def next_batch() -> tuple[list[ObjectKey], bool]:
            batch: list[ObjectKey] = []
            try:
                while len(batch) < _ITER_BATCH:
                    batch.append(await generator.__anext__())
            except StopAsyncIteration:
                return batch, True
            return batch, False

        try:
            while True:
                batch, exhausted = asyncio.run_coroutine_threadsafe(next_batch(), loop).result()
                yield from batch
                if exhausted:
                    return
        finally:
            aclose = getattr(generator, "aclose", None)
            if aclose is not None and loop.is_running():
                try:
                    asyncio.run_coroutine_threadsafe(aclose(), loop).result(self.close_timeout_s)
                except Exception:
                    log.debug("%s: closing the key iterator failed", self.name, exc_info=True)

    def close(self) -> None:
        if not self.begin_close():
            return
        with self._state_lock:
            loop, thread, futures = self._loop, self._thread, list(self._futures)
        if futures:
            _done, running = concurrent.futures.wait(futures, timeout=self.close_timeout_s)
            if running:
                log.warning(
                    "%s: %d backend calls still running after %.0f s; cancelled",
                    self.name,
                    len(running),
                    self.close_timeout_s,
                )
            for future in running:
                future.cancel()
        self.finish_close()
        try:
            if loop is None:
                asyncio.run(self.close_backend())
            else:
                asyncio.run_coroutine_threadsafe(self.close_backend(), loop).result(self.close_timeout_s)
        except Exception:
            log.exception("%s: close_backend failed", self.name)
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            deadline = time.monotonic() + self.close_timeout_s
            thread.join(max(0.0, deadline - time.monotonic()))
