"""Circuit breaker: a backend that keeps failing is not called until it answers again.

A remote store that goes away (a Redis restarted, an S3 endpoint unreachable) would
otherwise cost every lookup a timeout and every store a failed round trip.  After
``failure_threshold`` consecutive failed calls the circuit **opens**: lookups answer
misses at once, stores are skipped, loads and deletes fail, each counted and none
reaching the backend.  While open, a probe -- the backend's ``ping()`` when it has one,
else ``contains_many`` of a key nobody stores -- runs every ``probe_interval_s``; the
first probe that succeeds **closes** the circuit and calls resume.  Nothing has to be
restarted, and the server keeps serving from L1 throughout.

It is composition: :func:`guard_backend` puts a guard in front of the backend (one with
plain methods, one with coroutines), so the adapter, its runner and the backend are
unchanged.  A failed call is one that raised (the adapter counts it as a
``backend_errors`` too); a per-key False or None is an answer, not a failure.  With
``call_timeout_s`` a lookup (or probe) not answered in time is a failed call too: it
holds no buffer, so it can be abandoned; stores and loads hold buffers the backend may
still use, so only the backend's own timeouts end them.  A ``CancelledError`` the
backend raises of its own accord (a client library that cancelled its own request) is a
failed call as well; one that cancels the call because the adapter closes is not.

Calls given up at their timeout are left to end by themselves.  At most
:data:`TIMED_HELPERS` timed calls of one backend are in flight at once, running or left
(threads for a backend of plain methods, tasks for one of coroutines): a call past that
waits for one to end, and fails as not answered in time (``circuit_call_timeouts``),
without reaching the backend, if none ends before its timeout.

A refused call raises :class:`~lmcache_tiers.l2.calls.NotCalled`, which the adapter takes
for a failed batch without counting it as a backend error, rather than answering misses
or False: a lookup's None says "absent", and the adapter would release the accounted
keys it asked about (or, after a refused delete, ask whether they are gone).

It is on by default for backends that declare ``remote = True`` (``circuit.enabled``
turns it on or off for any backend).  State and counters are in the adapter's
``stats()``: ``circuit_open`` (0/1), ``circuit_consecutive_failures``, and the counters
``circuit_opened``, ``circuit_closed``, ``circuit_failures``, ``circuit_probes``,
``circuit_probe_failures``, ``circuit_probe_start_failures`` (a probe thread that could
not start; the next refused call tries again), ``circuit_call_timeouts``,
``circuit_skipped_store_keys``, ``circuit_missed_lookup_keys``, ``circuit_failed_load_keys``,
``circuit_failed_delete_keys``.  Each transition is one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from lmcache_tiers.config import CircuitConfig, L2AdapterConfig
from lmcache_tiers.errors import raised_by_a_plugin
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.breaker import CallTimeout, CircuitBreaker
from lmcache_tiers.l2.calls import NotCalled, cancelled_from_outside, is_async_backend, optional_method
from lmcache_tiers.l2.context import BackendContext
from lmcache_tiers.l2.leftcalls import LeftCallThreads

log = logging.getLogger("lmcache_tiers.l2")

__all__ = [
    "PROBE_KEY",
    "AsyncCircuitBackend",
    "CallTimeout",
    "CircuitBackend",
    "CircuitBreaker",
    "guard_backend",
]

#: what a probe asks about when the backend has no ``ping``: a key no engine produces
PROBE_KEY = ObjectKey("lmcache-tiers-circuit-probe", 0, b"\x00" * 16)

#: timed calls (lookups, probes) of one guarded backend in flight at once, running or left
#: at their timeout (threads for plain methods, tasks for coroutines): calls stuck for good
#: in a backend -- past ``call_timeout_s``, until the backend's own timeouts end them --
#: keep the circuit from closing only once there are this many
TIMED_HELPERS = 32

#: counter of the keys each operation refused while the circuit was open
_REFUSED = {
    "put_many": "circuit_skipped_store_keys",
    "contains_many": "circuit_missed_lookup_keys",
    "get_many_into": "circuit_failed_load_keys",
    "delete_many": "circuit_failed_delete_keys",
}


class _Guard:
    """What both flavours share: the breaker, the pass-through members, refusals."""

    def __init__(self, inner: Any, config: CircuitConfig, context: BackendContext) -> None:
        self.inner = inner
        self.context = context
        self.call_timeout_s = config.call_timeout_s
        self.breaker = CircuitBreaker(context.name, config, context.count)
        self.needs_l1_buffers = bool(getattr(inner, "needs_l1_buffers", False))
        self.remote = bool(getattr(inner, "remote", False))
        concurrency = getattr(inner, "concurrency", None)
        if concurrency is not None:
            self.concurrency = concurrency

    def refuse_if_open(self, method: str, keys: Sequence[ObjectKey]) -> None:
        """Raise :class:`NotCalled` (counted) when the circuit is open and ``method`` must
        not run.  Not a list of misses or False: a lookup's None means "absent", and the
        adapter would forget the accounted keys it asked about, or check again after a
        delete whether they are gone."""
        if self.breaker.is_open:
            self.context.count(_REFUSED[method], len(keys))
            self.keep_probing()
            raise NotCalled("the circuit is open")

    def keep_probing(self) -> None:
        """Start the probing again if it could not start when the circuit opened."""
        # A coroutine backend's probe is a task on the adapter's loop: creating one needs
        # no thread, so it never fails to start.
        return None

    def failed(self, method: str, exc: BaseException) -> None:
        if isinstance(exc, CallTimeout):
            self.context.count("circuit_call_timeouts")
        self.breaker.failed(f"{method}: {type(exc).__name__}: {exc}")

    def list_keys(self) -> Any:
        return self.inner.list_keys()

    def capacity(self) -> Any:
        return self.inner.capacity()

    def interrupt(self) -> None:
        interrupt = optional_method(self.inner, "interrupt")
        if interrupt is not None:
            interrupt()

    def stats(self) -> dict[str, int]:
        gauges = optional_method(self.inner, "stats")
        merged = {str(k): int(v) for k, v in (gauges() if gauges is not None else {}).items()}
        merged.update(self.breaker.gauges())
        return merged


class CircuitBackend(_Guard):
    """Guards a backend of plain methods; probes run on a thread of their own."""

    def __init__(self, inner: Any, config: CircuitConfig, context: BackendContext) -> None:
        super().__init__(inner, config, context)
        self._probe_lock = threading.Lock()
        self._probing = False
        self._probe_thread: threading.Thread | None = None
        #: the last attempt to start a probe thread failed (logged once per streak)
        self._probe_start_failing = False
        # Timed calls run on helper threads so that one not answered in time can be left.
        # A left call may stay stuck in the backend until its own timeout ends it, so there
        # are many: a few stuck calls must not leave the probes, and the lookups after the
        # backend answered again, queued behind them (see leftcalls.py).
        self._helpers: LeftCallThreads | None = None
        if self.call_timeout_s is not None:
            self._helpers = LeftCallThreads(TIMED_HELPERS, f"l2-{context.name}-timed")
        self.breaker.on_open = self._start_probing

    def open(self) -> None:
        opener = optional_method(self.inner, "open")
        if opener is not None:
            opener()

    def _bounded(self, call: Callable[[], Any]) -> Any:
        """``call()``, given up after ``call_timeout_s`` (on a helper thread) when set."""
        if self._helpers is None:
            return call()
        future = self._helpers.submit(call)
        try:
            return future.result(self.call_timeout_s)
        except TimeoutError:
            if future.done():
                # The call itself raised a TimeoutError, or answered right after the wait
                # gave up: either way its own outcome, not a timeout of ours.
                return future.result()
            future.cancel()  # not started yet: it need not run at all
            raise CallTimeout(self.call_timeout_s or 0.0) from None

    def _reading(self, keys: Sequence[ObjectKey]) -> Any:
        """``contains_many`` of ``keys`` on a helper thread, noted as a read of their
        records (``BackendContext.reading_records``) for as long as it runs: left at its
        timeout, it may judge what it read after its lookup has finished, and a store of
        a key that landed meanwhile must count as one that may have replaced that record
        (it is not marked unreadable, nor is the store's entry released)."""
        with self.context.reading_records(keys):
            return self.inner.contains_many(keys)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            if method == "contains_many" and self._helpers is not None:
                result = self._bounded(lambda: self._reading(*args))
            else:
                result = getattr(self.inner, method)(*args)
        except (Exception, asyncio.CancelledError) as exc:
            # A plain method running coroutines of its own may raise CancelledError (no
            # Exception): nothing here cancels it, so it is the backend's failure.
            self.failed(method, exc)
            raise
        except BaseException as exc:
            if raised_by_a_plugin(exc):  # the call fails as a backend error: the breaker sees it too
                self.failed(method, exc)
            raise
        self.breaker.succeeded()
        return result

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> Any:
        self.refuse_if_open("put_many", keys)
        return self._call("put_many", keys, payloads)

    def contains_many(self, keys: Sequence[ObjectKey]) -> Any:
        self.refuse_if_open("contains_many", keys)
        return self._call("contains_many", keys)

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> Any:
        self.refuse_if_open("get_many_into", keys)
        return self._call("get_many_into", keys, buffers)

    def delete_many(self, keys: Sequence[ObjectKey]) -> Any:
        self.refuse_if_open("delete_many", keys)
        return self._call("delete_many", keys)

    # -- probing --------------------------------------------------------------------------

    def keep_probing(self) -> None:
        # A probe thread that could not start (no threads left) is started again here, by
        # the calls the open circuit refuses: nothing else would ever close it.
        if not self._probing:
            self._start_probing()

    def _start_probing(self) -> None:
        with self._probe_lock:
            # Not once the adapter closes: closing ended the probing, and a thread started
            # then (by a call refused, or one failing and opening the circuit, while the
            # adapter winds down) would end at once, one per call.
            if self._probing or self.context.closing:
                return
            name = f"l2-{self.context.name}-probe"
            thread = threading.Thread(target=self._probe_loop, name=name, daemon=True)
            try:
                thread.start()
            except RuntimeError as exc:
                # Raising here would replace the failed call's own error with this one,
                # and the circuit would stay open for good with nothing probing.
                self._probe_start_failed(exc)
                return
            self._probing = True
            self._probe_thread = thread
            self._probe_start_failing = False

    def _probe_start_failed(self, exc: RuntimeError) -> None:
        """Counted; logged once per streak (every refused call retries, each counted)."""
        self.context.count("circuit_probe_start_failures")
        if self._probe_start_failing:
            return
        self._probe_start_failing = True
        log.warning(
            "%s: circuit open but its probe thread could not start (%s); calls stay refused, and "
            "each refused call tries to start it again",
            self.context.name,
            exc,
        )

    def _probe_loop(self) -> None:
        answered = False
        while not answered and self.context.sleep(self.breaker.probe_interval_s):
            answered = self._probe()
        # Closing and ending the probing are one step: a reopening starts a new thread.
        with self._probe_lock:
            if answered:
                self.breaker.probe_succeeded()
            self._probing = False

    def _probe(self) -> bool:
        self.context.count("circuit_probes")
        ping = optional_method(self.inner, "ping")

        def ask() -> Any:
            return ping() if ping is not None else self.inner.contains_many([PROBE_KEY])

        try:
            self._bounded(ask)
        except (Exception, asyncio.CancelledError) as exc:
            # A plain method running coroutines of its own may raise CancelledError (no
            # Exception), as ``calls.call`` notes: a failed probe.  Escaping, it would end
            # the probing for good with the circuit open.
            self.breaker.probe_failed(exc)
            return False
        except BaseException as exc:
            if not raised_by_a_plugin(exc):
                raise
            # A sys.exit() in the plugin's ping ended the probe thread, the circuit open
            # for good with nothing probing: a failed probe too.
            self.breaker.probe_failed(exc)
            return False
        return True

    def close(self) -> None:
        try:
            thread = self._probe_thread
            if thread is not None:
                thread.join(1.0)  # it sleeps through context.sleep, which closing ends
            if self._helpers is not None:
                self._helpers.shutdown()
        finally:
            closer = optional_method(self.inner, "close")
            if closer is not None:
                closer()


class AsyncCircuitBackend(_Guard):
    """Guards a backend of coroutines; probes run as a task on the adapter's loop."""

    def __init__(self, inner: Any, config: CircuitConfig, context: BackendContext) -> None:
        super().__init__(inner, config, context)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._probe_task: asyncio.Task[None] | None = None
        # Timed calls, running or given up at their timeout, until they end: at most
        # TIMED_HELPERS, as a plain backend's run on that many threads.  Held here because
        # the event loop keeps only weak references to tasks, so a left one nobody held
        # could be destroyed mid-flight (its cleanup cut short, "Task was destroyed but it
        # is pending!").
        self._timed: set[asyncio.Future[Any]] = set()
        self.breaker.on_open = self._start_probing

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        opener = optional_method(self.inner, "open")
        if opener is not None:
            outcome = opener()
            if inspect.isawaitable(outcome):
                await outcome

    async def _bounded(self, call: Any, reading: Sequence[ObjectKey] = ()) -> Any:
        """Await ``call``, cancelled after ``call_timeout_s`` when set.  A lookup's keys
        (``reading``) are noted as a read of their records until its task has ended, as a
        plain backend's lookup on its helper thread: one that swallows the cancellation
        goes on past its lookup op's end and may judge what it read after a store of a key
        landed, which must count as one that may have replaced that record."""
        timeout = self.call_timeout_s
        if timeout is None:
            return await call
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            free = await self._free_slot(deadline)
        except asyncio.CancelledError:
            _drop(call)
            raise
        if not free:
            # As a call queued behind TIMED_HELPERS busy threads: never made, and failed
            # at its timeout.
            _drop(call)
            raise CallTimeout(timeout)
        task = asyncio.ensure_future(call)
        self._timed.add(task)
        task.add_done_callback(self._timed_ended)
        # Begun before the task first runs (a coroutine starts at the next loop step).
        noted = contextlib.ExitStack()
        noted.enter_context(self.context.reading_records(reading))
        task.add_done_callback(lambda _: noted.close())
        try:
            done, _ = await asyncio.wait({task}, timeout=max(0.0, deadline - loop.time()))
        except asyncio.CancelledError:
            task.cancel()
            raise
        if not done:
            # Cancelled and left to wind down by itself, as a timed call of a plain
            # backend is left on its thread: a call slow to honour the cancellation (a
            # cleanup of its own, a reconnect to a host that does not answer) must not
            # hold the lookup or the probe past the timeout.
            task.cancel()
            raise CallTimeout(timeout)
        return task.result()

    async def _free_slot(self, deadline: float) -> bool:
        """Wait, until ``deadline`` (loop time), for fewer than ``TIMED_HELPERS`` timed calls
        in flight; whether there are.  The caller starts its call without awaiting in
        between, so no other call takes the slot first."""
        loop = asyncio.get_running_loop()
        while len(self._timed) >= TIMED_HELPERS:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            # A task's done-callbacks run in the order they were added: _timed_ended
            # has dropped an ended call before this wait returns.
            await asyncio.wait(set(self._timed), timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        return True

    def _timed_ended(self, task: asyncio.Future[Any]) -> None:
        self._timed.discard(task)
        if not task.cancelled():
            task.exception()  # taken, so that a left call's error is not logged as never retrieved

    async def _call(self, method: str, *args: Any) -> Any:
        call = getattr(self.inner, method)(*args)
        try:
            result = await (self._bounded(call, *args) if method == "contains_many" else call)
        except Exception as exc:
            self.failed(method, exc)
            raise
        except asyncio.CancelledError as exc:
            if not cancelled_from_outside(self.context.closing):
                # The backend's own (a client library that cancelled its own request):
                # a failed call.  One cancelling this task (close) says nothing of it.
                self.failed(method, exc)
            raise
        except GeneratorExit:
            raise  # this coroutine being closed, as in ``calls.call_async``
        except BaseException as exc:
            if raised_by_a_plugin(exc):  # the call fails as a backend error: the breaker sees it too
                self.failed(method, exc)
            raise
        self.breaker.succeeded()
        return result

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> Any:
        self.refuse_if_open("put_many", keys)
        return await self._call("put_many", keys, payloads)

    async def contains_many(self, keys: Sequence[ObjectKey]) -> Any:
        self.refuse_if_open("contains_many", keys)
        return await self._call("contains_many", keys)

    async def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> Any:
        self.refuse_if_open("get_many_into", keys)
        return await self._call("get_many_into", keys, buffers)

    async def delete_many(self, keys: Sequence[ObjectKey]) -> Any:
        self.refuse_if_open("delete_many", keys)
        return await self._call("delete_many", keys)

    # -- probing --------------------------------------------------------------------------

    def _start_probing(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._spawn_probe)

    def _spawn_probe(self) -> None:
        if self._probe_task is None or self._probe_task.done():
            self._probe_task = asyncio.get_running_loop().create_task(self._probe_loop())

    async def _probe_loop(self) -> None:
        while not self.context.closing:
            await asyncio.sleep(self.breaker.probe_interval_s)
            if self.context.closing:
                return
            if await self._probe():
                self.breaker.probe_succeeded()
                return

    async def _probe(self) -> bool:
        self.context.count("circuit_probes")
        ping = optional_method(self.inner, "ping")
        try:
            outcome = ping() if ping is not None else self.inner.contains_many([PROBE_KEY])
            if inspect.isawaitable(outcome):
                await self._bounded(outcome)
        except Exception as exc:
            self.breaker.probe_failed(exc)
            return False
        except asyncio.CancelledError as exc:
            if cancelled_from_outside(self.context.closing):
                raise  # close() cancels the probing
            # The client library cancelled its own request: a failed probe.  Escaping, it
            # would end the probing for good with the circuit open.
            self.breaker.probe_failed(exc)
            return False
        except GeneratorExit:
            raise  # this coroutine being closed, as in ``calls.call_async``
        except BaseException as exc:
            if not raised_by_a_plugin(exc):
                raise
            # A sys.exit() in the plugin's ping: escaping, it would end the probing (or,
            # a KeyboardInterrupt or SystemExit, the adapter's event loop) for good.
            self.breaker.probe_failed(exc)
            return False
        return True

    async def close(self) -> None:
        task = self._probe_task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        closer = optional_method(self.inner, "close")
        if closer is not None:
            outcome = closer()
            if inspect.isawaitable(outcome):
                await outcome


def _drop(call: Any) -> None:
    """Give up an awaitable never awaited: a coroutine is closed before it ran (no
    "never awaited" warning), a future already running is cancelled."""
    if inspect.iscoroutine(call):
        call.close()
    else:
        asyncio.ensure_future(call).cancel()


def circuit_enabled(backend: object, config: L2AdapterConfig) -> bool:
    circuit = config.circuit
    if circuit is not None and circuit.enabled is not None:
        return circuit.enabled
    return bool(getattr(backend, "remote", False))


def guard_backend(backend: object, config: L2AdapterConfig, context: BackendContext) -> object:
    """``backend`` behind a circuit breaker when its config (or its being remote) asks for one."""
    if not circuit_enabled(backend, config):
        return backend
    circuit = config.circuit or CircuitConfig()
    flavour = AsyncCircuitBackend if is_async_backend(backend) else CircuitBackend
    return flavour(backend, circuit, context)
