"""Where a backend's calls run: worker threads for plain methods, an event loop for coroutines.

Both runners run a batch operation the same way -- ``prepare``, the backend call,
``finish``, publish -- and differ only in how the call is made:

* :class:`ThreadRunner`: each operation kind (store, lookup, load) has its own worker
  thread(s), so a long store never delays a lookup, each task going to the one idle the
  shortest time (:mod:`~lmcache_tiers.l2.handoff`); ``delete`` and listings run on the
  caller's thread;
* :class:`LoopRunner`: one asyncio loop on its own thread, at most ``concurrency`` calls
  in flight; serde work of size-changing chains runs in the loop's executor so CPU-heavy
  transforms never stall other calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import itertools
import logging
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, Callable, Coroutine, Iterable, Iterator
from typing import Any, ClassVar, TypeVar

from lmcache_tiers.errors import PluginBaseException, awaiting_plugin_code, plugin_code
from lmcache_tiers.l2.background import WRITE_BACK, WRITE_BACK_NICE
from lmcache_tiers.l2.calls import call, call_async, optional_method
from lmcache_tiers.l2.handoff import Empty, HandOff, Worker
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.l2.loop_watch import LoopWatch
from lmcache_tiers.l2.ops import BatchOp
from lmcache_tiers.l2.state import AdapterState

log = logging.getLogger("lmcache_tiers.l2")

__all__ = ["WRITE_BACK_NICE", "LoopRunner", "Runner", "ThreadRunner", "chunks"]

T = TypeVar("T")
Publish = Callable[[int, BatchOp, Any], None]
Entry = Any  # one item of a backend listing: (key, size)


def chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    batch: list[T] = []
    for item in items:
        batch.append(item)
        if len(batch) >= size:
            yield batch
            batch = []
    if batch:
        yield batch


class Runner(ABC):
    """Runs one backend's calls; the adapter owns task ids and results."""

    #: how long a listing waits for its next entry before it fails: a store that stopped
    #: answering would otherwise hold the reading thread (and the start-up scan, which
    #: refuses stores that add bytes while it runs) for as long as the adapter is open.
    #: Measured per entry, not per batch: a live store that is slow (a request per page,
    #: a read per record) takes longer than this for a batch and must still be read whole.
    listing_stall_timeout_s: ClassVar[float] = 60.0

    def __init__(self, state: AdapterState, backend: object, publish: Publish) -> None:
        self.state = state
        self.backend = backend
        self.publish = publish
        #: the reading thread of a plain listing that stalled, left stuck in the backend
        self._stuck_listing: threading.Thread | None = None

    @abstractmethod
    def open(self, timeout: float) -> None:
        """Start the threads and run the backend's ``open``."""

    def opened(self, timeout: float) -> bool | None:
        """True once the backend opened, False if it failed to, None if still opening."""
        return True

    @abstractmethod
    def run(self, task_id: int, op: BatchOp) -> None:
        """Run ``op`` in the background and publish its result under ``task_id``."""

    @abstractmethod
    def call_now(self, op: BatchOp) -> Any:
        """Run ``op`` to completion for the calling thread (``delete``)."""

    @abstractmethod
    def listing(self, batch: int) -> Iterator[list[Entry]]:
        """The backend's ``list_keys`` in batches, for any thread but the runner's own."""

    @abstractmethod
    def stop(self, deadline: float) -> None:
        """Fail queued tasks, unblock and wait for running calls until ``deadline``."""

    @abstractmethod
    def close_backend(self, deadline: float) -> bool:
        """Run the backend's ``close`` (once) and end the runner's threads; False if the
        close did not return by ``deadline`` and was left running (counted and logged)."""

    def _crashed(self, task_id: int, hand_back: Callable[[], object] | None = None) -> None:
        """A task's op raised (a bug): counted (``tasks_crashed``: on /metrics the failed
        task would otherwise pass for a backend failure), logged with its traceback, what
        its prepare took handed back (``hand_back``) and the task failed, so that nobody
        waits for its result for ever -- nor finds its keys still pinned once it has it."""
        self.state.count("tasks_crashed")
        log.exception("%s: task %d crashed", self.state.name, task_id)
        if hand_back is not None:
            hand_back()
        self.state.board.fail(task_id)

    def _close_abandoned(self, waited_s: float) -> None:
        """The backend's close did not return by its deadline: counted, logged, and left
        running on its own (a daemon thread, or a task cancelled with the loop) so that a
        hung mount or peer cannot hold the server's stop for ever.  The adapter's close
        then fails (``BackendCloseTimedOut``): what was left undone may matter."""
        self.state.count("backend_close_timeouts")
        log.warning(
            "%s: close of the backend did not return in %.1f s (storage not answering?); going on "
            "without it: what it had left to do (removing its files, releasing its directory) "
            "may stay undone",
            self.state.name,
            waited_s,
        )

    def _listing_stalled(self) -> TimeoutError:
        """Count and log a listing whose next entry did not come in
        ``listing_stall_timeout_s``; the error its reader fails with (as any failed listing)."""
        self.state.count("listing_stalls")
        log.warning(
            "%s: the key listing stalled: no next entry in %.0f s (the backend does not "
            "answer?); the listing is abandoned as failed",
            self.state.name,
            self.listing_stall_timeout_s,
        )
        return TimeoutError(f"no next entry of the key listing in {self.listing_stall_timeout_s:.0f} s")

    def _listing_on_a_thread(
        self,
        batch: int,
        read_async: Callable[[AsyncIterable[Entry]], Iterator[list[Entry]]] | None = None,
    ) -> Iterator[list[Entry]]:
        """A synchronous ``list_keys`` in batches, read on a thread of its own so that its
        reader can give up on it: a call or an entry that never comes (a directory on a
        hung mount) fails the listing after ``listing_stall_timeout_s`` instead of holding
        the reader -- the start-up scan, or the eviction policy's seeding -- for good.

        ``list_keys`` is called before this returns (a listing begun is the backend's
        view from then on, as when it was called here); batches are then read one per
        ask, nothing ahead, so a listing stopped between batches is closed on its thread
        before ``close()`` returns.  A thread stuck in the backend is left behind (nothing
        can cancel it), and no new listing starts while it is (:meth:`_refuse_while_stuck`).
        A listing that is an async iterable goes to ``read_async``."""
        self._refuse_while_stuck()
        channel = _ListingChannel()
        reader = threading.Thread(
            target=self._read_listing,
            args=(batch, channel, read_async is not None),
            name=f"l2-{self.state.name}-listing",
            daemon=True,
        )
        reader.start()
        try:
            kind, value = self._next_answer(channel)
        except TimeoutError:
            # Nobody will ask for a batch: once list_keys returns, the thread closes the
            # listing and ends rather than wait for an ask for good.
            channel.asks.put(False)
            self._stuck_listing = reader
            raise
        if kind == "error":
            raise value
        if kind == "async":
            assert read_async is not None
            return read_async(value)
        return _ThreadedListing(self, channel, reader)

    def _refuse_while_stuck(self) -> None:
        """Raise TimeoutError (counted as ``listings_refused_stuck``, logged) while the
        reading thread of an earlier listing is still stuck in the backend: a store that
        hung one listing hangs the next, and each retried reading (the eviction policy's
        seeding) would leave one more thread behind for good."""
        stuck = self._stuck_listing
        if stuck is None or not stuck.is_alive():
            return
        self.state.count("listings_refused_stuck")
        self.state.burst.warn(
            "listings_refused_stuck",
            "%s: a key listing refused: an earlier one is still stuck in the backend (its "
            "thread cannot be cancelled); listings run again once it returns",
            self.state.name,
        )
        raise TimeoutError("an earlier key listing is still stuck in the backend")

    def _read_listing(self, batch: int, channel: _ListingChannel, async_read_elsewhere: bool) -> None:
        """The reading thread of :meth:`_listing_on_a_thread`: the call, then one batch per ask."""
        answers = channel.answers

        def advancing(entries: Iterator[Entry]) -> Iterator[Entry]:
            for entry in entries:
                channel.progress.advanced()
                yield entry

        listed: Iterator[Entry] | None = None
        try:
            returned = self.backend.list_keys()  # type: ignore[attr-defined]
            if async_read_elsewhere and isinstance(returned, AsyncIterable):
                answers.put(("async", returned))  # read on the event loop instead
                return
            listed = iter(returned)
            answers.put(("listed", None))
            entries = advancing(listed)
            while channel.asks.get():
                items = list(itertools.islice(entries, batch))
                answers.put(("batch", items) if items else ("end", None))
                if not items:
                    return
        except Exception as exc:
            answers.put(("error", exc))
        except BaseException as exc:
            # Off the main thread a SystemExit or KeyboardInterrupt is the backend's own
            # (errors.raised_by_a_plugin): let through, it would end this thread silently
            # and the reader would wait out the stall limit for an answer never sent.
            answers.put(("error", PluginBaseException(exc)))
        finally:
            close = getattr(listed, "close", None)  # a generator may hold a directory open
            if close is not None:
                try:
                    with plugin_code():
                        close()
                except Exception:
                    log.warning("%s: ending the key listing failed", self.state.name, exc_info=True)

    def _next_answer(self, channel: _ListingChannel) -> tuple[str, Any]:
        """The reading thread's next answer, waited for while the listing keeps moving."""

        def answer_within(timeout: float) -> tuple[str, Any] | None:
            try:
                return channel.answers.get(timeout=timeout)
            except queue.Empty:
                return None

        return self._while_listing_moves(channel.progress, answer_within)

    def _while_listing_moves(self, progress: _ListingProgress, within: Callable[[float], T | None]) -> T:
        """What ``within(timeout)`` gives (None: nothing in that time), waited for while the
        listing keeps moving: once it did not for ``listing_stall_timeout_s`` the stall is
        counted, logged and raised (TimeoutError).  Nothing came is told by None, never by
        an exception: the listing's own TimeoutError (a request to its peer that timed out)
        is its failure, not a wait to go on with."""
        progress.advanced()  # the wait starts the clock, not the reader's work before it
        while True:
            silent_for = progress.silent_for()
            if silent_for >= self.listing_stall_timeout_s:
                raise self._listing_stalled()
            answer = within(self.listing_stall_timeout_s - silent_for)
            if answer is not None:
                return answer
            # entries may have come meanwhile: the next round looks

    def _interrupt(self) -> None:
        interrupt = optional_method(self.backend, "interrupt")
        if interrupt is not None:
            try:
                interrupt()
            except Exception:
                log.exception("%s: interrupt failed", self.state.name)


class ThreadRunner(Runner):
    def __init__(self, state: AdapterState, backend: object, publish: Publish, workers: int) -> None:
        super().__init__(state, backend, publish)
        self.workers = max(1, workers)
        self._queues: dict[L2Op, HandOff[tuple[int, BatchOp] | None]] = {}
        self._threads: list[threading.Thread] = []

    def open(self, timeout: float) -> None:
        opener = optional_method(self.backend, "open")
        if opener is not None:
            opener()
        for op in L2Op:
            jobs: HandOff[tuple[int, BatchOp] | None] = HandOff()
            self._queues[op] = jobs
            for number in range(self.workers):
                thread = threading.Thread(
                    target=self._work,
                    args=(jobs, op is L2Op.STORE),
                    name=f"l2-{self.state.name}-{op.name.lower()}-{number}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)

    def _execute(self, op: BatchOp) -> Any:
        args = op.prepare()
        result: list[Any] | None = None
        try:
            result = call(self.state, self.backend, op.method, *args)
        finally:
            # Whatever escapes the call (a BaseException), what prepare took -- pins, write
            # claims, reserved capacity -- is given back; the task then fails as crashed.
            outcome = op.finish(result)
        return outcome

    def _work(self, jobs: HandOff[tuple[int, BatchOp] | None], background: bool = False) -> None:
        if background:
            # Write-back is background work: idle while it keeps up, nice 10 when the store
            # controller reports it behind (l2/background.py).  Linux applies both to the
            # one thread named.
            WRITE_BACK.enter()
        me: Worker[tuple[int, BatchOp] | None] = Worker()
        try:
            item = jobs.get(me)
            while item is not None:
                task_id, op = item
                ready = False
                try:
                    outcome = self._execute(op)
                    # Idle before the result wakes its waiter, who may submit the next
                    # task at once: that task is then this thread's (handoff.py).
                    jobs.ready(me)
                    ready = True
                    self.publish(task_id, op, outcome)
                except BaseException:  # never let one task kill the worker
                    self._crashed(task_id)
                item = jobs.next(me) if ready else jobs.get(me)
        finally:
            if background:
                WRITE_BACK.leave()

    def run(self, task_id: int, op: BatchOp) -> None:
        assert op.kind is not None
        self._queues[op.kind].put((task_id, op))

    def call_now(self, op: BatchOp) -> Any:
        return self._execute(op)

    def listing(self, batch: int) -> Iterator[list[Entry]]:
        return self._listing_on_a_thread(batch)

    def stop(self, deadline: float) -> None:
        # Tasks still queued never reach the backend; running ones may finish in time.
        dropped = 0
        for jobs in self._queues.values():
            while True:
                try:
                    item = jobs.get_nowait()
                except Empty:
                    break
                if item is not None and self.state.board.fail(item[0]):
                    dropped += 1
            for _ in range(self.workers):
                jobs.put(None)
        if dropped:
            # Counted as the close's other failed tasks are: failed here, they are no
            # longer pending when the adapter fails (and counts) what is left.
            self.state.count("tasks_failed_closed", dropped)
            log.warning(
                "%s: %d queued tasks failed by the close before reaching the backend",
                self.state.name,
                dropped,
            )
        self._interrupt()
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [thread.name for thread in self._threads if thread.is_alive()]
        if stuck:
            log.warning("%s: backend calls still running at the close deadline: %s", self.state.name, stuck)

    def close_backend(self, deadline: float) -> bool:
        """The backend's ``close`` on a thread of its own, waited for until ``deadline``:
        one stuck in storage (removing files on a hung mount) is left behind."""
        closer = optional_method(self.backend, "close")
        if closer is None:
            return True
        failure: list[BaseException] = []

        def close() -> None:
            try:
                closer()
            except BaseException as exc:  # raised again on the closing thread, as before
                failure.append(exc)

        thread = threading.Thread(target=close, name=f"l2-{self.state.name}-close", daemon=True)
        started = time.monotonic()
        thread.start()
        thread.join(max(0.0, deadline - started))
        if thread.is_alive():
            self._close_abandoned(time.monotonic() - started)
            return False
        if failure:
            raise failure[0]
        return True

    def threads(self) -> list[threading.Thread]:
        return list(self._threads)


class _ThreadedListing(Iterator[list[Entry]]):
    """The batches of a plain listing read on its own thread (``Runner._listing_on_a_thread``),
    each asked for and waited for with the runner's stall limit."""

    def __init__(self, runner: Runner, channel: _ListingChannel, reader: threading.Thread) -> None:
        self._runner = runner
        self._channel = channel
        self._asks = channel.asks
        self._reader = reader
        self._ended = False  # the reading thread ended, or is left stuck in the backend
        self._stopped = False

    def __next__(self) -> list[Entry]:
        if self._ended:
            raise StopIteration
        self._asks.put(True)
        try:
            kind, value = self._runner._next_answer(self._channel)
        except TimeoutError:
            self._ended = True  # stuck in the backend: never waited for again
            self._runner._stuck_listing = self._reader
            raise
        if kind == "batch":
            batch: list[Entry] = value
            return batch
        self._ended = True
        if kind == "error":
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stop reading: a thread idle between batches closes the backend's listing, and is
        waited for (bounded) so that the listing is ended when this returns."""
        if self._stopped:
            return
        self._stopped = True
        self._asks.put(False)
        if not self._ended:
            self._ended = True
            self._reader.join(self._runner.listing_stall_timeout_s)
            if self._reader.is_alive():  # closing the backend's listing hangs
                self._runner._stuck_listing = self._reader

    def __del__(self) -> None:
        # Dropped unfinished (a reader that stopped iterating): the thread still ends.
        if not self._stopped:
            self._asks.put(False)


class _Handoff:
    """Who undoes a prepared operation whose task was cancelled (by close).

    A heavy ``prepare`` runs in the loop's executor, and cancelling the task that awaits
    it does not stop it: it goes on to claim keys and reserve capacity for a call that
    will never be made.  Whichever side comes second -- the cancelled task or the
    executor thread finishing ``prepare`` -- undoes it, exactly once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = "pending"  # -> "preparing" -> "prepared"; or -> "abandoned"

    def prepare(self, op: BatchOp) -> tuple[Any, ...]:
        with self._lock:
            if self._state == "abandoned":  # cancelled before this started: nothing held
                raise asyncio.CancelledError
            self._state = "preparing"
        args = op.prepare()  # raising, it releases what it took (StoreOp.prepare)
        with self._lock:
            abandoned, self._state = self._state == "abandoned", "prepared"
        if abandoned:
            op.finish(None, call_returned=False)
        return args

    def abandon(self) -> bool:
        """Mark the task cancelled; True if the caller must finish (undo) ``op`` itself."""
        with self._lock:
            state, self._state = self._state, "abandoned"
        return state == "prepared"


class _LoopEnded(Exception):
    """Set on the future of a call its event loop was closed with (``_drop_left``)."""


class _Scheduled:
    """A call scheduled on the loop: its coroutine, and its task id if it is a ``run``."""

    __slots__ = ("coroutine", "task_id")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], task_id: int | None) -> None:
        self.coroutine = coroutine
        self.task_id = task_id


class _BlockingCall:
    """One ``call_now`` op on the loop, finished exactly once.

    Its caller may stop waiting (the future cancelled by close) while the task on the
    loop goes on to finish the op; whichever finishes first is the only finish, and the
    caller then takes its outcome.  A call its caller gave up on before it started
    prepares nothing."""

    def __init__(self, op: BatchOp) -> None:
        self.op = op
        self._lock = threading.Lock()
        self._state = "pending"  # -> "started"; or -> "abandoned"
        # Held across the op's finish: a second finisher waits for the first one's outcome
        # instead of taking a blank one while the first is still running it.
        self._finishing = threading.Lock()
        self._finished = False
        self._finish_error: Exception | None = None
        # Held until the task on the loop ended (finished the op, or its prepare raised).
        # A plain lock, not an Event: this is built on the request thread for every
        # blocking call, and an Event (a Condition in Python) costs that thread more.
        self._running = threading.Lock()
        self._running.acquire()
        self.outcome: Any = None

    def start(self) -> bool:
        """On the loop: False if the caller gave up on this call before it started."""
        with self._lock:
            if self._state == "abandoned":
                return False
            self._state = "started"
            return True

    def abandon(self) -> bool:
        """For the caller that gave up: True if the call had not started (never will)."""
        with self._lock:
            if self._state == "started":
                return False
            self._state = "abandoned"
            return True

    def finish(self, result: list[Any] | None, *, call_returned: bool = True) -> Any:
        """``op.finish`` -- the first time only; the outcome of that one after (what it
        raised, raised again: the op is never finished twice, even a buggy one)."""
        with self._finishing:
            if not self._finished:
                self._finished = True
                try:
                    self.outcome = self.op.finish(result, call_returned=call_returned)
                except Exception as exc:
                    self._finish_error = exc
                    raise
            elif self._finish_error is not None:
                raise self._finish_error
            return self.outcome

    def end(self) -> None:
        """On the loop: the task is over (it finished the op, or its prepare raised)."""
        self._running.release()

    def wait_ended(self, timeout: float) -> bool:
        """For the caller: True once the task on the loop is over, False after ``timeout``."""
        if not self._running.acquire(timeout=timeout):
            return False
        self._running.release()  # over for good: a later ask answers at once
        return True


class _ListingProgress:
    """When a backend's listing last gave an entry (or its reader last asked for one),
    read by the reader's thread to tell a stalled listing from a slow one."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def advanced(self) -> None:
        self._last = time.monotonic()  # one float store: no lock needed between the threads

    def silent_for(self) -> float:
        return time.monotonic() - self._last


class _ListingChannel:
    """Between a plain listing's reading thread and its reader: the reader's asks (True:
    the next batch; False: stop), the thread's answers, and when the listing last moved."""

    def __init__(self) -> None:
        self.progress = _ListingProgress()
        self.asks: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self.answers: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()


class LoopRunner(Runner):
    def __init__(self, state: AdapterState, backend: object, publish: Publish, concurrency: int) -> None:
        super().__init__(state, backend, publish)
        self._loop = asyncio.new_event_loop()
        # The serde work of size-changing chains runs in the loop's default executor: named
        # for the adapter, not asyncio's "asyncio_N" that no thread dump can attribute.
        self._loop.set_default_executor(
            concurrent.futures.ThreadPoolExecutor(thread_name_prefix=f"l2-{state.name}-serde")
        )
        self._thread = threading.Thread(target=self._serve, name=f"l2-{state.name}-loop", daemon=True)
        self._watch = LoopWatch(state, self._loop, self._thread)
        self._semaphore = asyncio.Semaphore(max(1, concurrency))
        self._opened: concurrent.futures.Future[None] | None = None
        #: every scheduled call not yet done, with its coroutine (and task id, for ``run``)
        self._futures: dict[concurrent.futures.Future[Any], _Scheduled] = {}
        #: every batch of an async listing asked of the loop and not yet read: failed by
        #: the loop's end as the calls are, never waited for by ``stop`` (a listing is
        #: its reader's to end: the start-up scan stops it between batches)
        self._listing_batches: dict[concurrent.futures.Future[Any], _Scheduled] = {}
        self._lock = threading.Lock()
        self._stopping = False  # set by ``stop`` with the list of futures it cancels
        self._loop_ended = False  # set once the loop is closed: nothing is scheduled on it
        #: set once ``close_backend`` ended: a loop still running then is left to itself
        self._closed = threading.Event()

    #: how often a caller waiting for a cancelled blocking call's finish checks that the
    #: loop's thread still runs and close did not give up on it (either never finishes it)
    _LOOP_CHECK_S: ClassVar[float] = 0.1

    # -- the loop ---------------------------------------------------------------------------

    def _serve(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            leftovers = asyncio.all_tasks(loop)
            for task in leftovers:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        except BaseException as exc:
            # A SystemExit raised by a callback of the backend's on the loop (asyncio lets
            # it through): the loop's thread ends with calls pending, failed below.  Counted:
            # every later operation of the adapter fails, and /metrics must say why.
            self.state.count("loop_ended_by_exception")
            log.error(
                "%s: the event loop ended by %s: %s; its pending calls fail",
                self.state.name,
                type(exc).__name__,
                exc,
            )
            raise
        finally:
            self._watch.end()
            with self._lock:
                self._loop_ended = True
                pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
                loop.close()
                left = list(self._futures.items()) + list(self._listing_batches.items())
            self._fail_unfinished_open()
            self._drop_left(left)
            self._end_pending_tasks(pending)

    def _schedule(self, coroutine: Any, task_id: int | None = None) -> concurrent.futures.Future[Any]:
        # One scheduled once ``stop`` took its list is cancelled at once, as ``stop`` would
        # have: registered first, else a task that starts on the loop before its future is
        # registered would escape ``stop``'s cancelling, and its caller would wait for a
        # loop that close gave up on.
        future, ended, stopping = self._scheduled_in(self._futures, coroutine, task_id)
        if not ended and stopping:
            future.cancel()
        return future

    def _schedule_listing_batch(self, batch: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """A listing's next batch scheduled on the loop and registered, as :meth:`_schedule`
        does with calls: a loop that ends (or has ended) fails it with ``_LoopEnded`` at
        once, where a future nobody registered would never be set and its reader would
        wait out the stall limit, the loop's end counted as a stall.  Never cancelled by
        ``stop``: a listing is its reader's to end."""
        future, _ended, _stopping = self._scheduled_in(self._listing_batches, batch)
        return future

    def _scheduled_in(
        self,
        registry: dict[concurrent.futures.Future[Any], _Scheduled],
        coroutine: Coroutine[Any, Any, T],
        task_id: int | None = None,
    ) -> tuple[concurrent.futures.Future[T], bool, bool]:
        """``coroutine`` scheduled on the loop and registered in ``registry`` in one step
        under the lock (the loop's end fails what is registered there), forgotten once
        done; with whether the loop had ended -- the coroutine then dropped, its future
        failed at once, as a closed loop refuses it -- and whether ``stop`` had begun."""
        scheduled = _Scheduled(coroutine, task_id)
        with self._lock:
            if self._loop_ended:
                future: concurrent.futures.Future[T] = concurrent.futures.Future()
            else:
                future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
                registry[future] = scheduled
            ended, stopping = self._loop_ended, self._stopping
        if ended:
            self._drop_left([(future, scheduled)])
        else:
            future.add_done_callback(functools.partial(self._forget, registry))
        return future, ended, stopping

    def _forget(
        self,
        registry: dict[concurrent.futures.Future[Any], _Scheduled],
        future: concurrent.futures.Future[Any],
    ) -> None:
        with self._lock:
            registry.pop(future, None)

    def _fail_unfinished_open(self) -> None:
        """Fail the backend's open the loop ended with (its thread ended by an exception):
        left pending, ``opened`` would answer "still opening" for as long as the adapter
        runs, and its start-up scan, waiting for the open, would never end."""
        opened = self._opened
        if opened is None or opened.done():
            return
        try:
            opened.set_exception(_LoopEnded(f"{self.state.name}: the event loop ended as the backend opened"))
        except concurrent.futures.InvalidStateError:
            pass  # set meanwhile: answered all the same

    def _drop_left(self, left: list[tuple[concurrent.futures.Future[Any], _Scheduled]]) -> None:
        """Fail the calls the loop was closed with, neither cancelled nor finished (its
        thread ended by an exception, or a call scheduled as it shut down): no task of
        theirs will ever run again, and their futures would never be set.  A started
        coroutine is closed (its ``GeneratorExit`` handling fails its task or finishes its
        blocking call and hands back what it held); a ``run`` task that never started is
        failed here (nothing prepared); a blocking caller, its future failed, finishes a
        call that never started itself."""
        for future, scheduled in left:
            if future.done():
                continue
            coroutine = scheduled.coroutine
            never_started = inspect.getcoroutinestate(coroutine) == inspect.CORO_CREATED
            try:
                coroutine.close()  # a started one handles its GeneratorExit; never awaited, no warning
            except Exception:
                # An op's finish raising (a bug): its caller gets that error from its own
                # finish (``_BlockingCall``), and the calls after it are answered all the same.
                log.exception("%s: closing a call left with the event loop raised", self.state.name)
            if never_started and scheduled.task_id is not None and self.state.board.fail(scheduled.task_id):
                self.state.count("tasks_failed_closed")
                self.state.burst.warn(
                    "tasks_closed_with_loop",
                    "%s: task %d dropped with the event loop before it started; failed",
                    self.state.name,
                    scheduled.task_id,
                )
            try:
                future.set_exception(_LoopEnded(f"{self.state.name}: the event loop ended"))
            except concurrent.futures.InvalidStateError:
                pass  # cancelled meanwhile by ``stop``: its caller is answered all the same

    def _end_pending_tasks(self, pending: list[asyncio.Task[Any]]) -> None:
        """End the tasks the loop was closed with (its thread ended by an exception, or a
        task the backend left behind), none of which will ever run again.  Each coroutine
        is closed now, on the loop's thread, rather than by the garbage collector at some
        later time on any thread: ours fail their task or call and hand back what they
        held (``_drop_left`` closed those it answered already: closing again is nothing).
        Their tasks, ended but never to be marked done by a loop that is gone, would each
        be logged as "Task was destroyed but it is pending!" when collected: one line
        names them all instead."""
        if not pending:
            return
        # Counted: the backend's own tasks among them (a connection's reader, a flush)
        # ended unfinished, which only this line and the count tell.
        self.state.count("tasks_closed_with_loop", len(pending))
        for task in pending:
            coroutine = task.get_coro()
            try:
                coroutine.close()
            except BaseException:
                # A coroutine whose cleanup raises, a SystemExit too (the backend's own, on
                # this thread that is never the main one): logged, and the others still end.
                log.exception("%s: closing a task left with the event loop raised", self.state.name)
            # asyncio's own flag for "do not report me as a leak": this one was ended above.
            task._log_destroy_pending = False  # type: ignore[attr-defined]
        log.warning(
            "%s: %d tasks still pending as the event loop ended were closed: %s",
            self.state.name,
            len(pending),
            ", ".join(sorted({getattr(task.get_coro(), "__qualname__", "?") for task in pending})),
        )

    async def _offload(self, function: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, function)

    # -- opening ------------------------------------------------------------------------------

    async def _open(self) -> None:
        opener = optional_method(self.backend, "open")
        if opener is not None:
            # A SystemExit or KeyboardInterrupt raised here would end the loop's thread
            # (asyncio lets them through) with no open failure counted, and every later
            # task would wait for a loop that is gone: the plugin's failure instead.
            with awaiting_plugin_code():
                outcome = opener()
                if inspect.isawaitable(outcome):
                    await outcome

    def open(self, timeout: float) -> None:
        self._thread.start()
        self._watch.start()
        self._opened = asyncio.run_coroutine_threadsafe(self._open(), self._loop)
        with self._lock:
            ended_already = self._loop_ended
        if ended_already:
            # The loop ended before the open's future was kept above: its end found none
            # to fail, and ``opened`` would answer "still opening" for good.  Failed here;
            # otherwise the loop's end, coming later, sees the future and fails it.
            self._fail_unfinished_open()
        if not self._open_over(timeout):
            log.warning("%s: the backend is still opening after %.0f s", self.state.name, timeout)
            return
        try:
            self._opened.result()
        except Exception as exc:
            self.state.count("open_failures")
            log.warning(
                "%s: the backend failed to open, every operation fails: %s: %s",
                self.state.name,
                type(exc).__name__,
                str(exc),  # not the exception: a kept record would keep its frames
            )

    def opened(self, timeout: float) -> bool | None:
        opened = self._opened
        if opened is None or not self._open_over(timeout):
            return None
        return not opened.cancelled() and opened.exception() is None

    def _open_over(self, timeout: float) -> bool:
        """Whether the backend's open ended within ``timeout``.  Asked of the future's
        state, never told by ``result(timeout)`` raising TimeoutError: since Python 3.11
        that is the builtin one, which an open that failed to reach its peer raises too."""
        assert self._opened is not None
        done, _ = concurrent.futures.wait([self._opened], timeout)
        return bool(done)

    async def _backend_ready(self) -> bool:
        assert self._opened is not None
        try:
            await asyncio.wrap_future(self._opened)
        except Exception as exc:
            self.state.backend_failed("open", exc)
            return False
        return True

    # -- operations ---------------------------------------------------------------------------

    async def _run(self, task_id: int, op: BatchOp) -> None:
        handoff = _Handoff()
        result: list[Any] | None = None
        closed_unfinished = False
        try:
            if await self._backend_ready():
                async with self._semaphore:
                    try:
                        if op.heavy_prepare:
                            args = await self._offload(lambda: handoff.prepare(op))
                        else:
                            args = handoff.prepare(op)
                        result = await call_async(self.state, self.backend, op.method, *args)
                    except GeneratorExit:
                        # Handled before the semaphore's release, which wakes the next
                        # waiter on the loop -- closed: that raises RuntimeError in its place.
                        closed_unfinished = True
                        self._closed_unfinished(task_id, op, handoff)
                        raise
        except asyncio.CancelledError:
            # Core cancels a task only as the adapter closes (``stop``): failed here first
            # and counted, as the close's other failed tasks are -- else it would count
            # only if the close's own sweep of pending tasks came before this ran.
            if self.state.board.fail(task_id) and self.state.closing.is_set():
                self.state.count("tasks_failed_closed")
            self._hand_back(task_id, op, handoff)
            raise
        except GeneratorExit:
            if not closed_unfinished:
                self._closed_unfinished(task_id, op, handoff)
            raise
        except Exception:  # a bug in an op: its task fails, as on worker threads, never hangs
            if closed_unfinished:
                return  # the closed loop refusing the semaphore's release: the close, handled
            # What prepare took (pins, a load's noting of layouts) is handed back, or its
            # keys stay pinned -- never evictable -- for as long as the adapter runs.
            self._crashed(task_id, lambda: self._hand_back(task_id, op, handoff, crash_counted=True))
            return

        def finish() -> None:
            self.publish(task_id, op, op.finish(result))

        try:
            if op.heavy_finish:
                # The executor finishes and publishes even if this task is cancelled while
                # it waits, so pins are never left behind.
                await self._offload(finish)
            else:
                finish()
        except Exception:
            self._crashed(task_id)

    def _hand_back(
        self, task_id: int, op: BatchOp, handoff: _Handoff, *, crash_counted: bool = False
    ) -> bool:
        """Undo what ``op``'s prepare took for a call whose answer will never be used, and
        publish the failed outcome; True if that was done here.  False when nothing was
        prepared, or ``prepare`` still runs in the executor (which undoes it as it ends).
        Synchronous: it also runs in a coroutine being closed, which can await nothing.
        ``crash_counted``: the task already counts as crashed, and a finish raising here
        is only logged (``tasks_crashed`` counts tasks, not the bugs one task met)."""
        if not handoff.abandon():
            return False
        try:
            self.publish(task_id, op, op.finish(None, call_returned=False))
        except Exception:  # the op's finish is buggy too: never in place of the exit under way
            if crash_counted:
                log.exception(
                    "%s: task %d crashed; handing back what it held raised too", self.state.name, task_id
                )
            else:
                self._crashed(task_id)
        return True

    def _closed_unfinished(self, task_id: int, op: BatchOp, handoff: _Handoff) -> None:
        """A task's coroutine closed before it ended, without being cancelled (its loop
        dropped with the task pending): Python throws GeneratorExit in, which is neither a
        cancellation nor an Exception.  The task is failed (counted as
        ``tasks_failed_closed`` unless the adapter's close failed it already), logged, and
        what its prepare took handed back."""
        if self.state.board.fail(task_id):
            self.state.count("tasks_failed_closed")
        # A loop dropped with many tasks pending closes them all at once: one line a burst.
        self.state.burst.warn(
            "tasks_closed_with_loop",
            "%s: task %d closed with the event loop before it ended; failed, what it held released",
            self.state.name,
            task_id,
        )
        self._hand_back(task_id, op, handoff)

    def run(self, task_id: int, op: BatchOp) -> None:
        self._schedule(self._run(task_id, op), task_id)

    async def _now(self, call: _BlockingCall) -> Any:
        if not call.start():
            raise asyncio.CancelledError  # its caller gave up before it started: nothing held
        try:
            op = call.op
            args = op.prepare()
            result: list[Any] | None = None
            returned = False
            try:
                if await self._backend_ready():
                    result = await call_async(self.state, self.backend, op.method, *args)
                returned = True
            finally:
                # Not returned: cancelled, or closed with its loop (GeneratorExit) while the
                # backend may still use the call's buffers.
                outcome = call.finish(result, call_returned=returned)
            return outcome
        finally:
            call.end()

    def call_now(self, op: BatchOp) -> Any:
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self.state.name}: a blocking call would stall the adapter's own event loop")
        call = _BlockingCall(op)
        try:
            return self._schedule(self._now(call)).result()
        except (concurrent.futures.CancelledError, _LoopEnded):
            return self._cancelled_outcome(call)

    def _cancelled_outcome(self, call: _BlockingCall) -> Any:
        """The outcome of a blocking call whose future was cancelled (close): cancelling
        the future does not wait for its task, which goes on to finish the op on the loop
        -- that one finish's outcome, waited for, never a second finish here (it would
        count the keys twice and answer "failed" for keys the first one deleted).  A
        call that never started, whose prepare raised, or whose loop ended without
        finishing it, is finished here (nothing prepared, or nothing else to hand it back)."""
        if not call.abandon():
            while not call.wait_ended(self._LOOP_CHECK_S) and self._loop_may_still_finish():
                pass  # the task is still finishing on the loop
        # The outcome of the loop's finish if it ran (waited for while it runs).  Else --
        # not started, its prepare raised, or its loop gone or given up on by close (held
        # by its backend) -- finished here, the only time: a late finish on the loop then
        # takes this one's outcome and changes nothing.
        return call.finish(None, call_returned=False)

    def _loop_may_still_finish(self) -> bool:
        """Whether a task on the loop may still end: not once the loop's thread ended, nor
        once ``close_backend`` gave up on it (a backend holding the loop's thread in a
        synchronous call that hangs: no cancellation lands, and a blocking caller waiting
        for it would wait for as long as that call hangs)."""
        return self._thread.is_alive() and not self._closed.is_set()

    def listing(self, batch: int) -> Iterator[list[Entry]]:
        if threading.current_thread() is self._thread:
            raise RuntimeError(f"{self.state.name}: listing keys would stall the adapter's own event loop")
        yield from self._listing_on_a_thread(batch, lambda listed: self._async_listing(listed, batch))

    def _async_listing(self, listed: AsyncIterable[Entry], batch: int) -> Iterator[list[Entry]]:
        """An asynchronous listing read on the loop, batch by batch, its stalls detected
        as the entries come (:meth:`_next_listed`)."""
        iterator = listed.__aiter__()

        progress = _ListingProgress()

        async def next_batch() -> tuple[list[Entry], bool]:
            items: list[Entry] = []
            try:
                while len(items) < batch:
                    with awaiting_plugin_code():  # a SystemExit here would end the loop's thread
                        items.append(await iterator.__anext__())
                    progress.advanced()
            except StopAsyncIteration:
                return items, True
            return items, False

        try:
            while True:
                items, exhausted = self._next_listed(next_batch(), progress)
                yield items
                if exhausted:
                    return
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None and self._loop.is_running():

                async def close_listing() -> None:
                    with awaiting_plugin_code():  # on the loop's thread, which it must not end
                        await aclose()

                try:
                    asyncio.run_coroutine_threadsafe(close_listing(), self._loop).result(5.0)
                except Exception:
                    log.debug("%s: closing the key listing failed", self.state.name, exc_info=True)

    def _next_listed(
        self, batch: Coroutine[Any, Any, tuple[list[Entry], bool]], progress: _ListingProgress
    ) -> tuple[list[Entry], bool]:
        """The listing's next batch, waited for while its entries keep coming: once none
        came for ``listing_stall_timeout_s`` the wait is cancelled (the caller's
        ``finally`` then closes the listing), counted and logged, and the listing fails:
        its reader treats it as any failed listing.  One whose loop ended (or had ended)
        fails at once, counted and logged as such (:meth:`_listing_lost_its_loop`)."""
        future = self._schedule_listing_batch(batch)

        def batch_within(timeout: float) -> tuple[list[Entry], bool] | None:
            done, _ = concurrent.futures.wait([future], timeout)
            return future.result() if done else None  # the listing's own error raised

        try:
            return self._while_listing_moves(progress, batch_within)
        except TimeoutError:
            future.cancel()
            raise
        except _LoopEnded:
            self._listing_lost_its_loop()
            raise

    def _listing_lost_its_loop(self) -> None:
        """Count (``listings_failed_loop_ended``) and log an async listing failed because
        the event loop it reads on ended: its reader fails it as any failed listing."""
        self.state.count("listings_failed_loop_ended")
        self.state.burst.warn(
            "listings_failed_loop_ended",
            "%s: a key listing failed: the adapter's event loop it reads on has ended",
            self.state.name,
        )

    # -- closing --------------------------------------------------------------------------------

    def stop(self, deadline: float) -> None:
        self._interrupt()
        with self._lock:
            self._stopping = True
            futures = list(self._futures)
        if not futures:
            return
        _done, running = concurrent.futures.wait(futures, timeout=max(0.0, deadline - time.monotonic()))
        if running:
            log.warning(
                "%s: %d backend calls still running at the close deadline; cancelled",
                self.state.name,
                len(running),
            )
        for future in running:
            future.cancel()

    def close_backend(self, deadline: float) -> bool:
        closer = optional_method(self.backend, "close")
        returned = True

        async def close() -> None:
            if closer is not None:
                outcome = closer()
                if inspect.isawaitable(outcome):
                    await outcome

        try:
            future = self._on_the_running_loop(close())
            if future is not None:
                waited = max(0.1, deadline - time.monotonic())
                # Told by the future's state, not by result(waited) raising TimeoutError:
                # a close that returned with a TimeoutError of its own failed, not hung.
                if concurrent.futures.wait([future], waited).done:
                    future.result()  # what the backend's close raised goes to the caller
                else:
                    future.cancel()
                    self._close_abandoned(waited)
                    returned = False
            else:
                asyncio.run(close())
        finally:
            try:
                self._end_loop(deadline)
            finally:
                self._watch.end()
                self._closed.set()
        return returned

    def _on_the_running_loop(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T] | None:
        """``coroutine`` scheduled on the loop, or None (closed, never awaited) when the loop
        does not run: its thread never started, ended, or is ending after the loop ended
        by an exception -- alive, answering the calls left on a loop already closed, which
        would refuse the coroutine with RuntimeError."""
        with self._lock:
            if self._thread.is_alive() and not self._loop_ended:
                return asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        coroutine.close()
        return None

    def _end_loop(self, deadline: float) -> None:
        """Stop the loop and wait for its thread until ``deadline`` (then left running)."""
        with self._lock:
            if self._thread.is_alive() and not self._loop_ended:
                self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread.is_alive():
            self._thread.join(max(0.1, deadline - time.monotonic()))
        elif not self._loop.is_closed():
            self._loop.close()
