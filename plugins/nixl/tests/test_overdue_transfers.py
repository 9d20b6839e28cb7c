"""A transfer past its deadline is counted for /metrics, not only logged.

It is still waited for (its memory cannot be given back while the kernel may still move
it), so a stalled device holds it for good: ``transfers_past_deadline`` counts such
transfers and ``transfers_stuck`` says how many wait past their deadline now -- what an
operator alerts on.  The stall is real: a READ through NIXL's POSIX AIO from a FIFO nobody
writes to, released (by writing to it) only once the gauge showed the transfer stuck.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_nixl import runtime as runtime_module
from lmcache_plugin_nixl.runtime import NixlRuntime, NixlTransferError, OverdueTransfers
from nixl_helpers import Arena, client, dynamic_config, open_dynamic, open_pool, pool_config, scratch_dir
from stalled_fifo import stalled_read

from lmcache_tiers.testing.l2 import make_keys, pattern


def test_a_transfer_past_its_deadline_is_counted_and_shown_stuck_until_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_module, "TRANSFER_TIMEOUT_S", 0.0)  # past it at the first look
    with stalled_read(tmp_path) as stalled:
        overdue = OverdueTransfers()
        seen_stuck: list[dict[str, int]] = []
        check = stalled.runtime._transfer_state

        def state_once_seen_stuck(handle: Any) -> str:
            # The storage answers only once the wait reported the transfer stuck.
            if not seen_stuck and overdue.stats()["transfers_stuck"]:
                seen_stuck.append(overdue.stats())
                os.write(stalled.fd, b"late" * 1024)
            return check(handle)

        monkeypatch.setattr(stalled.runtime, "_transfer_state", state_once_seen_stuck)
        try:
            stalled.runtime.transfer_many("POSIX", "READ", [stalled.request], "FILE", overdue=overdue)
        except NixlTransferError:
            pass  # how the READ ended does not matter here: that it was counted does
        assert seen_stuck == [{"transfers_past_deadline": 1, "transfers_stuck": 1}]
        assert overdue.stats() == {"transfers_past_deadline": 1, "transfers_stuck": 0}, (
            "one transfer past its deadline, counted once however many periods; none stuck now"
        )


# nixl_store_dynamic loads with preadv on buffered POSIX (plainreads.py), not through NIXL:
# only its stores can wait on a NIXL transfer there.
@pytest.mark.parametrize(
    ("adapter_kind", "operation"),
    [("nixl_store", "WRITE"), ("nixl_store", "READ"), ("nixl_store_dynamic", "WRITE")],
)
def test_the_adapter_stats_show_a_transfer_past_its_deadline(
    adapter_kind: str, operation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What /metrics and /status carry: the adapter's stats(), not the runtime's counter.  The
    transfer's state reads "still running" until the adapter's stats showed it stuck."""
    arena = Arena()
    keys = make_keys(1)
    payload = pattern(41, 64 << 10)
    with scratch_dir() as directory:
        if adapter_kind == "nixl_store":
            adapter = open_pool(pool_config(directory, pool_size=2), arena.view)
        else:
            adapter = open_dynamic(dynamic_config(directory), arena.view)
        try:
            if operation == "READ":
                assert client(adapter).store(keys, [arena.filled(payload)]) == [True]
            before = adapter.stats()
            assert (before["transfers_past_deadline"], before["transfers_stuck"]) == (0, 0)
            release = _stall_transfers_until_released(monkeypatch)
            call = _in_thread(adapter, operation, keys, arena, payload)
            seen = _stats_once_stuck(adapter)
            release()
            call.join(60)
            assert not call.is_alive()
            assert (seen["transfers_past_deadline"], seen["transfers_stuck"]) == (1, 1)
            after = adapter.stats()
            assert (after["transfers_past_deadline"], after["transfers_stuck"]) == (1, 0), (
                "counted once; no transfer waits past its deadline once it ended"
            )
        finally:
            adapter.close()


def _stall_transfers_until_released(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """Every NIXL request of the shared runtime (the adapters') reads as still running, when
    posted and when polled, until the returned function is called (the request itself is
    real and posted).  Until then the deadline is passed at the first look past the spins;
    the transfers posted after have the real one again (a store's header write follows its
    payload's)."""
    real_timeout = runtime_module.TRANSFER_TIMEOUT_S
    monkeypatch.setattr(runtime_module, "TRANSFER_TIMEOUT_S", 0.0)
    runtime = NixlRuntime.shared()
    check = runtime._transfer_state
    released = threading.Event()
    monkeypatch.setattr(runtime, "agent", _AgentAnsweringLate(runtime.agent, released))

    def stalled_until_released(handle: Any) -> str:
        if not released.is_set():
            released.wait(0.01)  # the storage has not answered yet
            return "PROC"
        return check(handle)

    monkeypatch.setattr(runtime, "_transfer_state", stalled_until_released)

    def release() -> None:
        monkeypatch.setattr(runtime_module, "TRANSFER_TIMEOUT_S", real_timeout)
        released.set()

    return release


def _in_thread(adapter: Any, operation: str, keys: list[Any], arena: Any, payload: bytes) -> threading.Thread:
    def run() -> None:
        if operation == "WRITE":
            client(adapter).store(keys, [arena.filled(payload)])
        else:
            client(adapter).load(keys, [arena.take(len(payload))])

    call = threading.Thread(target=run, name=f"stalled-{operation}")
    call.start()
    return call


def _stats_once_stuck(adapter: Any) -> dict[str, int]:
    """The adapter's stats once they show a transfer stuck (bounded: 60 s, then the last)."""
    stats = adapter.stats()
    for _ in range(6000):
        if stats["transfers_stuck"]:
            break
        threading.Event().wait(0.01)
        stats = adapter.stats()
    return stats


class _AgentAnsweringLate:
    """The NIXL agent, but a request just posted reads as still running until ``released``:
    a request posted to a slow device (a buffered POSIX write is often done at posting)."""

    def __init__(self, agent: Any, released: threading.Event) -> None:
        self._agent = agent
        self._released = released

    def transfer(self, handle: Any) -> Any:
        state = self._agent.transfer(handle)
        return "PROC" if state == "DONE" and not self._released.is_set() else state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)
