"""A Mooncake call asked after the adapter closed its deadline pool -- by a probe or a
start-up listing still running when the close went past them -- is refused at once.
Queued, no thread would ever run it: it would wait out its deadline, then count as a
call given up inside Mooncake that never ends, and the process would wait for it at exit
(``exit_wait_s``), warning of a call that was never made."""

from __future__ import annotations

import threading

import pytest
from lmcache_plugin_mooncake.calls import CallPool, PoolClosed


def test_a_call_asked_of_a_closed_pool_is_refused_and_nothing_waits_for_it_at_exit() -> None:
    pool = CallPool("closed", 1, exit_wait_s=10)
    pool.close()
    ran: list[int] = []
    late: list[int] = []
    with pytest.raises(PoolClosed, match="probe not made"):
        pool.run("probe", 0.2, ran.append, 1, on_late=lambda: late.append(1))
    assert ran == [] and late == []
    waiting = [
        thread.name for thread in threading.enumerate() if thread.name == "mooncake-closed-given-up-calls"
    ]
    assert waiting == [], "the process would wait at exit for a call never made"
