"""An adapter's event loop that ends by an exception (a callback of the backend's raising
SystemExit on it) is counted on /metrics with the tasks closed with it; one stopped by
close is not."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from l2_backends import WAIT_BOUND_S, AsyncDictBackend, end_the_loop, keys_of, open_dict, running_loop_runner

from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.interface import L2Op
from lmcache_tiers.l2.ops import DeleteOp
from lmcache_tiers.l2.runners import LoopRunner

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


class DeleteThatEndsItsLoop:
    """A coroutine backend whose delete ends its loop with the delete pending."""

    async def delete_many(self, keys: Any) -> Any:
        end_the_loop()
        await asyncio.get_running_loop().create_future()


class LeavingTasksThenEndingItsLoop:
    """A coroutine backend whose delete starts two tasks of its own, then ends its loop:
    three tasks are pending as it ends (the delete's and the backend's two)."""

    async def delete_many(self, keys: Any) -> Any:
        loop = asyncio.get_running_loop()
        self.tasks = [loop.create_task(asyncio.sleep(3600)) for _ in range(2)]
        end_the_loop()
        await loop.create_future()


def test_a_loop_ended_by_an_exception_is_counted_with_its_tasks(
    adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    adapter, runner = running_loop_runner(adapters, DeleteThatEndsItsLoop())
    runner.run(adapter.state.board.new_task(L2Op.LOAD, 1), DeleteOp(adapter.state, keys_of("k", 1)))
    runner._thread.join(WAIT_BOUND_S)
    assert not runner._thread.is_alive()
    stats = adapter.stats()
    assert stats["loop_ended_by_exception"] == 1
    assert stats["tasks_closed_with_loop"] == 1, "the delete's task"
    assert any("event loop ended by SystemExit" in r.getMessage() for r in caplog.records)


def test_the_backend_tasks_closed_with_an_ended_loop_are_counted(adapters: list[BackendAdapter]) -> None:
    adapter, runner = running_loop_runner(adapters, LeavingTasksThenEndingItsLoop())
    runner.run(adapter.state.board.new_task(L2Op.LOAD, 1), DeleteOp(adapter.state, keys_of("k", 1)))
    runner._thread.join(WAIT_BOUND_S)
    assert not runner._thread.is_alive()
    stats = adapter.stats()
    assert stats["loop_ended_by_exception"] == 1
    assert stats["tasks_closed_with_loop"] == 3, "the delete's task and the backend's two"


def test_a_loop_stopped_by_close_is_not_counted_as_ended(adapters: list[BackendAdapter]) -> None:
    adapter = open_dict(AsyncDictBackend)
    adapter.close()
    stats = adapter.stats()
    assert stats.get("loop_ended_by_exception", 0) == 0
    assert stats.get("tasks_closed_with_loop", 0) == 0


class OpenThatEndsItsLoop:
    """A coroutine backend whose open ends its loop with the open pending."""

    async def open(self) -> None:
        end_the_loop()
        await asyncio.get_running_loop().create_future()


def test_an_open_whose_loop_ends_before_open_returns_is_a_failed_open(
    adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loop may end before the thread that scheduled the open has kept the open's
    future: the open is failed all the same, never "still opening" for as long as the
    adapter runs (its start-up scan, waiting for the open, would never end).  The
    scheduling thread is held here until the loop's thread has ended, which the
    scheduler may do on its own whenever the loop's thread runs first."""
    adapter = open_dict(AsyncDictBackend)
    adapters.append(adapter)
    runner = LoopRunner(adapter.state, OpenThatEndsItsLoop(), lambda *_: None, 1)
    schedule = asyncio.run_coroutine_threadsafe

    def schedule_then_let_the_loop_end(coroutine: Any, loop: asyncio.AbstractEventLoop) -> Any:
        future = schedule(coroutine, loop)
        runner._thread.join(WAIT_BOUND_S)
        return future

    monkeypatch.setattr(asyncio, "run_coroutine_threadsafe", schedule_then_let_the_loop_end)
    runner.open(0.0)
    monkeypatch.undo()
    assert not runner._thread.is_alive()
    assert runner.opened(1.0) is False
