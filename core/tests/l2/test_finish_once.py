"""An op's ``finish`` runs exactly once on every path of an event loop's task: what its
``prepare`` took (pins, a load's registration for noting layouts) is always handed back,
never twice, whether the task ends normally, raises, is cancelled or is closed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from l2_backends import AsyncDictBackend, open_dict, wait_until

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.l2.ops import DeleteOp, LoadOp
from lmcache_tiers.l2.runners import LoopRunner, _BlockingCall
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys

SIZE = 1000


def stored_adapter(adapters: list[BackendAdapter]) -> tuple[BackendAdapter, BlockingAdapterClient, list[Any]]:
    adapter = open_dict(AsyncDictBackend)
    adapters.append(adapter)
    keys = make_keys(1)
    client = BlockingAdapterClient(adapter, timeout=10.0)
    assert client.store(keys, [memoryview(bytes(SIZE))]) == [True]
    return adapter, client, keys


def nothing_held(adapter: BackendAdapter) -> bool:
    state = adapter.state
    return not state.pins.snapshot() and not state._loading


class BrokenArguments:
    """Call arguments whose unpacking raises: an op's bug after its ``prepare`` took pins."""

    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("a bug in an op, after its prepare")


def test_an_op_raising_after_prepare_hands_back_what_prepare_took(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, client, keys = stored_adapter(adapters)
    prepare = LoadOp.prepare

    def prepare_then_break(op: LoadOp) -> Any:
        prepare(op)
        return BrokenArguments()

    monkeypatch.setattr(LoadOp, "prepare", prepare_then_break)
    assert client.load(keys, [memoryview(bytearray(SIZE))]) == [False]
    monkeypatch.undo()
    assert adapter.stats().get("tasks_crashed") == 1
    assert nothing_held(adapter), "the load's pin and noting registration were handed back"
    # The key is evictable again: a delete claims it.
    assert adapter.delete(keys) == [True]


class NeverAnswering:
    """A coroutine backend whose calls wait for an answer that never comes."""

    async def get_many_into(self, keys: Any, buffers: Any) -> Any:
        await asyncio.get_running_loop().create_future()

    async def delete_many(self, keys: Any) -> Any:
        await asyncio.get_running_loop().create_future()


def idle_runner(adapter: BackendAdapter, published: list[Any], backend: object | None = None) -> LoopRunner:
    """A loop runner over ``backend`` (one never answering by default), its open done."""
    backend = NeverAnswering() if backend is None else backend
    runner = LoopRunner(adapter.state, backend, lambda _t, _op, result: published.append(result), 1)
    opened: concurrent.futures.Future[None] = concurrent.futures.Future()
    opened.set_result(None)
    runner._opened = opened
    return runner


def run_then_drop_their_loop(runner: LoopRunner, tasks: dict[int, LoadOp]) -> list[BaseException | None]:
    """Run the tasks on a loop until they await the backend, then drop the loop and close
    their coroutines (off the main thread, as the adapter's loop runs): what each close
    raised, None for none."""
    closing: list[BaseException | None] = []

    def run_then_drop() -> None:
        loop = asyncio.new_event_loop()
        coroutines = [runner._run(task_id, op) for task_id, op in tasks.items()]
        running = [loop.create_task(coroutine) for coroutine in coroutines]
        for _ in range(5):
            loop.run_until_complete(asyncio.sleep(0))
        assert not any(task.done() for task in running), "the loads await the backend"
        loop.close()
        for coroutine in coroutines:
            try:
                coroutine.close()
            except BaseException as exc:
                closing.append(exc)
            else:
                closing.append(None)

    worker = threading.Thread(target=run_then_drop)
    worker.start()
    worker.join()
    runner._loop.close()
    return closing


def test_a_task_closed_without_being_cancelled_hands_back_and_fails(adapters: list[BackendAdapter]) -> None:
    """A task's coroutine closed as it awaits the backend (its loop dropped with it
    pending) gets GeneratorExit, neither a cancellation nor an Exception."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    runner = idle_runner(adapter, [])
    task_id = state.board.new_task(L2Op.LOAD, 1)
    op = LoadOp(state, keys, [memoryview(bytearray(SIZE))])
    assert run_then_drop_their_loop(runner, {task_id: op}) == [None]
    assert nothing_held(adapter), "the load's pin and noting registration were handed back"
    assert task_id in state.board.pop(L2Op.LOAD), "the task was completed, not left waiting"


def test_tasks_closed_with_their_loop_are_counted_each_and_logged_in_a_burst(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    """A loop dropped with many tasks pending: each is counted, the log is not a line each."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    runner = idle_runner(adapter, [])
    tasks = {
        state.board.new_task(L2Op.LOAD, 1): LoadOp(state, keys, [memoryview(bytearray(SIZE))])
        for _ in range(20)
    }
    with caplog.at_level(logging.WARNING):
        assert run_then_drop_their_loop(runner, tasks) == [None] * 20
    assert adapter.stats().get("tasks_failed_closed") == 20
    assert nothing_held(adapter)
    lines = [record for record in caplog.records if "closed with the event loop" in record.getMessage()]
    assert 1 <= len(lines) <= 2, [record.getMessage() for record in lines]


def test_a_blocking_call_cancelled_by_close_finishes_its_op_once(adapters: list[BackendAdapter]) -> None:
    """``call_now`` whose call is cancelled (the adapter closing) gets the outcome of the
    one finish the loop ran, never a second one of its own."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    runner = idle_runner(adapter, [])
    runner._thread.start()
    finishes: list[Any] = []
    op = DeleteOp(state, keys)
    finish = op.finish

    def counted_finish(io_result: Any, *, call_returned: bool = True) -> Any:
        finishes.append(io_result)
        return finish(io_result, call_returned=call_returned)

    op.finish = counted_finish  # type: ignore[method-assign]
    outcome: list[Any] = []
    caller = threading.Thread(target=lambda: outcome.append(runner.call_now(op)))
    caller.start()
    wait_until(state.pins.deleting, "the delete to await the backend, its key claimed")
    state.closing.set()
    runner.stop(0.0)
    caller.join(10.0)
    assert outcome == [[False]]
    runner.close_backend(0.0)
    assert len(finishes) == 1, "finished exactly once"
    assert not state.pins.deleting()


class BlockingItsLoop:
    """A coroutine backend whose delete makes a synchronous call that hangs (a read on a
    hung mount inside ``async def``): its loop's thread is held, no cancellation lands."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    async def delete_many(self, keys: Any) -> Any:
        self.entered.set()
        self.release.wait()
        return [True] * len(keys)


def test_a_blocking_call_whose_loop_is_held_returns_once_the_adapter_closed(
    adapters: list[BackendAdapter],
) -> None:
    """Close gives up on a loop held by its backend; the blocking caller then gets the
    failed outcome instead of waiting for that loop for as long as it is held."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    backend = BlockingItsLoop()
    runner = idle_runner(adapter, [], backend)
    runner._thread.start()
    outcome: list[Any] = []
    caller = threading.Thread(
        target=lambda: outcome.append(runner.call_now(DeleteOp(state, keys))), daemon=True
    )
    caller.start()
    try:
        assert backend.entered.wait(10.0)
        state.closing.set()
        runner.stop(0.0)
        assert runner.close_backend(0.0) is False, "the held loop's close was abandoned"
        caller.join(10.0)
        assert not caller.is_alive(), "the caller still waits for a loop close gave up on"
        assert outcome == [[False]]
        assert not state.pins.deleting(), "the delete's claim was handed back"
    finally:
        backend.release.set()
        runner._thread.join(10.0)
    assert outcome == [[False]], "the loop's late finish did not change the caller's outcome"


def test_a_blocking_call_made_after_stop_is_answered_without_its_held_loop(
    adapters: list[BackendAdapter],
) -> None:
    """A call scheduled once ``stop`` took its list of futures to cancel is cancelled at
    once: its caller is answered although the loop, held by the backend, never runs it
    (before, such a call -- one whose task started before its future was registered, too
    -- was never cancelled, and its caller waited for as long as the loop was held)."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    backend = BlockingItsLoop()
    runner = idle_runner(adapter, [], backend)
    runner._thread.start()
    holder = threading.Thread(target=lambda: runner.call_now(DeleteOp(state, keys)), daemon=True)
    holder.start()
    outcome: list[Any] = []
    try:
        assert backend.entered.wait(10.0)
        state.closing.set()
        runner.stop(0.0)
        late = threading.Thread(
            target=lambda: outcome.append(runner.call_now(DeleteOp(state, make_keys(1)))), daemon=True
        )
        late.start()
        late.join(10.0)
        assert not late.is_alive(), "the call made after stop still waits for the held loop"
        assert outcome == [[False]]
    finally:
        backend.release.set()
        holder.join(10.0)
        runner._loop.call_soon_threadsafe(runner._loop.stop)  # stop never stopped it
        runner._thread.join(10.0)


def test_a_crashed_task_whose_finish_raises_too_is_one_crashed_task(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Handing back after a crash runs the op's finish; that raising as well is logged,
    and the task still counts once in ``tasks_crashed`` (a count of tasks)."""
    adapter, client, keys = stored_adapter(adapters)
    prepare = LoadOp.prepare

    def prepare_then_break(op: LoadOp) -> Any:
        prepare(op)
        return BrokenArguments()

    def broken_finish(op: LoadOp, io_result: Any, *, call_returned: bool = True) -> Any:
        raise RuntimeError("a bug in the op's finish too")

    monkeypatch.setattr(LoadOp, "prepare", prepare_then_break)
    monkeypatch.setattr(LoadOp, "finish", broken_finish)
    assert client.load(keys, [memoryview(bytearray(SIZE))]) == [False]
    monkeypatch.undo()
    assert adapter.stats().get("tasks_crashed") == 1


class SlowFinish:
    """An op whose finish waits to be let go, for a second finisher to come meanwhile."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.finishes = 0

    def finish(self, io_result: Any, *, call_returned: bool = True) -> Any:
        self.finishes += 1
        self.entered.set()
        self.go.wait()
        return ["the one outcome"]


def test_a_second_finisher_gets_the_first_finish_outcome_not_a_blank() -> None:
    """The caller giving up (close gave up on the loop) while the loop is still inside
    the op's finish takes that finish's outcome once it is there -- never None."""
    op = SlowFinish()
    call = _BlockingCall(op)  # type: ignore[arg-type]
    outcomes: list[Any] = []
    first = threading.Thread(target=lambda: outcomes.append(call.finish([True])))
    first.start()
    assert op.entered.wait(10.0)
    second = threading.Thread(target=lambda: outcomes.append(call.finish(None, call_returned=False)))
    second.start()
    op.go.set()
    first.join(10.0)
    second.join(10.0)
    assert outcomes == [["the one outcome"], ["the one outcome"]]
    assert op.finishes == 1


class EndingItsLoop:
    """A coroutine backend whose delete leaves a callback on its loop that raises
    SystemExit (a client library's callback calling ``sys.exit``): the loop's thread ends
    with the delete pending, its task neither cancelled nor finished."""

    async def delete_many(self, keys: Any) -> Any:
        loop = asyncio.get_running_loop()
        loop.call_soon(sys.exit, "a client library's callback")
        await loop.create_future()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_blocking_call_whose_loop_ended_under_it_gets_the_failed_outcome(
    adapters: list[BackendAdapter],
) -> None:
    """The loop's thread ends with a blocking call pending (closed, not cancelled): the
    caller gets the failed outcome and the delete's claim is handed back, instead of
    waiting for a future nobody will ever set."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    runner = idle_runner(adapter, [], EndingItsLoop())
    runner._thread.start()
    outcome: list[Any] = []
    caller = threading.Thread(
        target=lambda: outcome.append(runner.call_now(DeleteOp(state, keys))), daemon=True
    )
    caller.start()
    caller.join(10.0)
    assert not caller.is_alive(), "the caller still waits for a loop that ended"
    assert outcome == [[False]]
    assert not state.pins.deleting(), "the delete's claim was handed back"
    # A call made once the loop is gone is answered too, not refused with RuntimeError.
    assert runner.call_now(DeleteOp(state, make_keys(1))) == [False]


def delete_left_by_its_loop(
    adapters: list[BackendAdapter],
) -> tuple[BackendAdapter, LoopRunner, int, list[Any]]:
    """A delete task run on a loop whose thread then ends under it (``EndingItsLoop``),
    the thread joined: the adapter, the runner, the task's id and the deleted keys."""
    adapter, _client, keys = stored_adapter(adapters)
    runner = idle_runner(adapter, [], EndingItsLoop())
    runner._thread.start()
    task_id = adapter.state.board.new_task(L2Op.LOAD, 1)
    runner.run(task_id, DeleteOp(adapter.state, keys))
    runner._thread.join(10.0)
    assert not runner._thread.is_alive()
    return adapter, runner, task_id, keys


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_task_whose_loop_ended_under_it_is_failed_and_hands_back(adapters: list[BackendAdapter]) -> None:
    """A background task pending on a loop whose thread ended is failed on the board
    (counted as closed with its loop) and what its prepare took is handed back."""
    adapter, runner, delete_task, keys = delete_left_by_its_loop(adapters)
    state = adapter.state
    assert delete_task in state.board.pop(L2Op.LOAD), "the task was completed, not left waiting"
    assert not state.pins.deleting(), "the delete's claim was handed back"
    later = state.board.new_task(L2Op.LOAD, 1)
    runner.run(later, LoadOp(state, keys, [memoryview(bytearray(SIZE))]))
    assert later in state.board.pop(L2Op.LOAD), "a task run once the loop is gone is failed at once"
    assert nothing_held(adapter)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tasks_failed_with_their_loop_are_not_reported_destroyed_pending(
    adapters: list[BackendAdapter],
) -> None:
    """The asyncio tasks of calls the loop was closed with are ended with it (each failed
    and counted already): finalized, none reports "Task was destroyed but it is pending!"
    to the loop, which asyncio logs as an ERROR for each."""
    adapter, runner, delete_task, _keys = delete_left_by_its_loop(adapters)
    state = adapter.state
    left = [task for task in asyncio.all_tasks(runner._loop) if not task.done()]
    assert left, "the delete's task was left by the loop"
    reported: list[str] = []
    runner._loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    for task in left:
        task.__del__()  # what the garbage collector runs: deterministic here
    assert reported == []
    assert delete_task in state.board.pop(L2Op.LOAD)
    assert nothing_held(adapter)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_call_whose_finish_raises_as_its_loop_ends_answers_the_others(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blocking call whose op's finish raises (a bug) as its loop ends under it does not
    stop the loop's end from answering the calls left after it: the caller gets the op's
    error, and the task scheduled after it is failed, not left waiting for ever."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state

    def broken_finish(op: DeleteOp, result: Any, *, call_returned: bool = True) -> Any:
        raise RuntimeError("a bug in an op's finish")

    monkeypatch.setattr(DeleteOp, "finish", broken_finish)
    runner = idle_runner(adapter, [], EndingItsLoop())
    answers: list[str] = []

    def call() -> None:
        try:
            runner.call_now(DeleteOp(state, keys))
        except RuntimeError as exc:
            answers.append(str(exc))

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    wait_until(lambda: len(runner._futures) == 1, "the blocking call scheduled first")
    task_after = state.board.new_task(L2Op.LOAD, 1)
    runner.run(task_after, DeleteOp(state, make_keys(1, start=10)))
    runner._thread.start()
    caller.join(10.0)
    runner._thread.join(10.0)
    assert not caller.is_alive(), "the caller still waits for a loop that ended"
    assert answers == ["a bug in an op's finish"]
    assert task_after in state.board.pop(L2Op.LOAD), "the task after it was failed, not left waiting"


class EndingItsLoopWhileOpening:
    """A coroutine backend whose open leaves a callback on its loop that raises SystemExit
    (a client library's callback calling ``sys.exit``): the loop's thread ends with the
    open pending."""

    async def open(self) -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(sys.exit, "a client library's callback")
        await loop.create_future()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_open_whose_loop_ended_under_it_is_a_failed_open(adapters: list[BackendAdapter]) -> None:
    """The loop's thread ends while the backend opens: the open is answered as failed,
    never "still opening" for as long as the adapter runs (its start-up scan, waiting for
    the open, would never end)."""
    adapter = open_dict(AsyncDictBackend)
    adapters.append(adapter)
    runner = LoopRunner(adapter.state, EndingItsLoopWhileOpening(), lambda *_: None, 1)
    runner.open(0.0)  # gives up waiting at once: the loop's end answers it later
    runner._thread.join(10.0)
    assert not runner._thread.is_alive()
    assert runner.opened(1.0) is False


class EndingItsLoopClosable(EndingItsLoop):
    """``EndingItsLoop`` with a close that notes it ran (flushing, removing its files)."""

    def __init__(self) -> None:
        self.closed = threading.Event()

    def close(self) -> None:
        self.closed.set()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_close_while_the_ended_loop_answers_its_calls_still_closes_the_backend(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The adapter closes while the thread of a loop that ended is still answering the
    calls left on it (the loop closed, the thread alive): the backend's close runs all
    the same, and no RuntimeError about a closed loop takes its place."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    answering, answer = threading.Event(), threading.Event()
    finish = DeleteOp.finish

    def slow_hand_back(op: DeleteOp, result: Any, *, call_returned: bool = True) -> Any:
        if not call_returned:  # the loop's end handing back what the task held
            answering.set()
            answer.wait(10.0)
        return finish(op, result, call_returned=call_returned)

    monkeypatch.setattr(DeleteOp, "finish", slow_hand_back)
    backend = EndingItsLoopClosable()
    runner = idle_runner(adapter, [], backend)
    runner._thread.start()
    runner.run(state.board.new_task(L2Op.LOAD, 1), DeleteOp(state, keys))
    assert answering.wait(10.0), "the loop ended and answers the task left on it"
    try:
        # A short deadline: the close then waits for the loop's thread, held here, until it.
        assert runner.close_backend(time.monotonic() + 0.5) is True
    finally:
        answer.set()
        runner._thread.join(10.0)
    assert backend.closed.is_set()


class LeavingTasksThatExitOnClose:
    """A coroutine backend that starts two tasks of its own, each exiting (SystemExit) as
    its coroutine is closed, then ends its loop as ``EndingItsLoop`` does."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    async def delete_many(self, keys: Any) -> Any:
        loop = asyncio.get_running_loop()

        async def exiting_on_close() -> None:
            try:
                await loop.create_future()
            finally:
                sys.exit("a client library's task exiting as it is closed")

        self.tasks = [loop.create_task(exiting_on_close()) for _ in range(2)]
        loop.call_soon(sys.exit, "a client library's callback")
        await loop.create_future()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_backends_task_exiting_as_it_is_closed_does_not_leave_the_others_open(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    """The loop's end closes every task left on it: one of the backend's whose cleanup
    raises SystemExit is logged, and the tasks after it are closed all the same, named in
    the one WARNING (never left to the garbage collector, each an asyncio ERROR)."""
    adapter, _client, keys = stored_adapter(adapters)
    state = adapter.state
    backend = LeavingTasksThatExitOnClose()
    runner = idle_runner(adapter, [], backend)
    runner._thread.start()
    runner.run(state.board.new_task(L2Op.LOAD, 1), DeleteOp(state, keys))
    runner._thread.join(10.0)
    assert not runner._thread.is_alive()
    assert len(backend.tasks) == 2
    states = [inspect.getcoroutinestate(task.get_coro()) for task in backend.tasks]
    assert states == [inspect.CORO_CLOSED] * 2
    assert "tasks still pending as the event loop ended were closed" in caplog.text
