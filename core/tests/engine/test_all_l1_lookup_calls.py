"""What an all-L1 lookup runs: every LOOKUP of a prompt L1 holds comes this way, so what it
calls on every request is what it needs and no more -- judged by the Python calls it makes,
not by a clock.  And the policy it tells of its hits still has its failures counted."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from engine_support import keys_of, mock, store

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.storage import StorageManager

Engine = Callable[..., StorageManager]
SIZE = 64 * 1024


def python_calls(work: Callable[[], Any]) -> list[str]:
    """The qualified names of the Python functions ``work()`` calls, in order."""
    called: list[str] = []

    def note(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            called.append(frame.f_code.co_qualname)

    sys.setprofile(note)
    try:
        work()
    finally:
        sys.setprofile(None)
    return called


@pytest.mark.parametrize("adapters", [0, 1], ids=["l1-only", "with-l2"])
def test_a_repeated_all_l1_lookup_calls_nothing_it_does_not_need(engine: Engine, adapters: int) -> None:
    """The lookup an engine repeats for a waiting prompt: no read-lock deadline rounded
    afresh (the same for a grid cell), no count of the distinct keys (a prefix that
    every key hit holds each once), no guard entered and left around the eviction
    policy's notice (a plain ``try`` costs nothing until it raises), no open check or
    inner begin called."""
    storage = engine([mock()] * adapters)
    keys = keys_of(70, 16)
    store(storage, keys, SIZE)
    assert storage.flush(10)
    storage.release(storage.start_prefetch(keys)[1] or [])  # the first one remembers its keys

    outcome: list[tuple[int, list[ObjectKey] | None]] = []
    called = python_calls(lambda: outcome.append(storage.start_prefetch(keys)))
    if "read_lock_deadline" in called:
        # The clock crossed into the next grid cell (seconds long) since the first lookup:
        # that one rounds once; the next, right after, must not.
        storage.release(keys, 1)
        outcome.clear()
        called = python_calls(lambda: outcome.append(storage.start_prefetch(keys)))

    assert outcome[0][1] == keys
    unneeded = {
        "read_lock_deadline",
        "unique_length",
        "_PluginCode.__enter__",
        "_PluginCode.__exit__",
        "StorageManager._check_open",
        "PrefetchController._begin",
    }
    assert unneeded.isdisjoint(called), sorted(unneeded.intersection(called))
    # What it does need: the policy hears of the hits, and the lookup is counted.
    assert "LRUEvictionPolicy.on_keys_read" in called
    assert "EngineStats.add_lookup" in called
    requests = storage.status()["requests"]
    lookups = requests["lookups"]
    assert lookups in (2, 3)
    assert (requests["lookup_keys"], requests["l1_hit_chunks"]) == (16 * lookups, 16 * lookups)
    storage.release(keys, 1)
    assert storage.l1.stats().read_locks == 0


class PluginAbort(BaseException):
    """A plugin's own exception that derives from BaseException."""


@pytest.mark.parametrize(
    "error", [ValueError("policy bug"), KeyboardInterrupt(), PluginAbort("policy bug")], ids=type
)
def test_an_eviction_policy_failing_on_a_lookups_hits_is_counted_and_the_lookup_answered(
    engine: Engine, error: BaseException
) -> None:
    """Off the main thread (a front end's), whatever the policy raises there is its
    failure: counted, and the lookup still answers with the prefix it locked."""
    storage = engine([])
    keys = keys_of(71, 3)
    store(storage, keys, SIZE)
    policy = storage.l1_eviction.policy

    def raising(read: Sequence[ObjectKey]) -> None:
        raise error

    policy.on_keys_read = raising  # type: ignore[method-assign]
    outcome: list[Any] = []

    def lookup() -> None:
        try:
            outcome.append(storage.start_prefetch(keys)[1])
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=lookup)
    thread.start()
    thread.join(30)
    assert outcome == [keys]
    assert storage.failures()["l1_eviction_policy_error"] == 1
    storage.release(keys)


def test_a_ctrl_c_on_the_main_thread_during_a_lookups_notice_goes_up(engine: Engine) -> None:
    """On the main thread a KeyboardInterrupt may be the operator's: it is not taken for
    the policy's failure, and goes up as it is."""
    storage = engine([])
    keys = keys_of(72, 2)
    store(storage, keys, SIZE)

    def interrupted(read: Sequence[ObjectKey]) -> None:
        raise KeyboardInterrupt

    storage.l1_eviction.policy.on_keys_read = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        storage.start_prefetch(keys)
    assert "l1_eviction_policy_error" not in storage.failures()
    storage.release(keys)
