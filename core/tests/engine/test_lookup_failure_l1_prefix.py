"""A lookup that fails before its request is queued gives back the read locks it took on
its L1 prefix.  Its caller gets the exception, never the locked prefix, so it cannot
release them; held, they would pin those objects in L1 until the lock TTL reaped them,
counted as ``l1_lock_expired`` (a client's fault) and logged as one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_support import keys_of, mock, store, store_in_l2_only

from lmcache_tiers.controllers.prefetch import PROBE_MIN_KEYS
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.storage import StorageManager

Engine = Callable[..., StorageManager]
SIZE = 16 * 1024
IN_L1 = 2


class Interrupted(BaseException):
    """An interrupt raised through an adapter's call (not an ``Exception``)."""


def broken(*args: object) -> None:
    raise Interrupted


def queue_broke(*args: object) -> None:
    raise RuntimeError("queue broke")


@pytest.mark.parametrize(
    ("where", "past_l1"),
    [
        # the first question about the first key past L1's prefix (a long lookup)
        ("probe-interrupted", PROBE_MIN_KEYS),
        # the whole lookup answered at once, then queuing it fails
        ("queue-broke", 2),
    ],
)
def test_a_lookup_that_fails_before_it_is_queued_releases_its_l1_prefix(
    engine: Engine, monkeypatch: pytest.MonkeyPatch, where: str, past_l1: int
) -> None:
    storage = engine([mock()])
    adapter = storage.adapters[0]
    assert isinstance(adapter, BackendAdapter)
    prompt = keys_of(81, IN_L1 + past_l1)
    store_in_l2_only(storage, prompt[IN_L1:], SIZE)
    store(storage, prompt[:IN_L1], SIZE)
    assert storage.flush(10)  # their L2 stores' locks are gone
    assert storage.l1.stats().read_locks == 0
    if where == "probe-interrupted":
        monkeypatch.setattr(adapter, "lookup_and_lock_now", broken)
    else:
        monkeypatch.setattr(storage.prefetch._handles, "enqueue", queue_broke)

    with pytest.raises((Interrupted, RuntimeError)):
        storage.start_prefetch(prompt, readers=2)

    assert storage.l1.stats().read_locks == 0, "the L1 prefix is still read-locked"
    assert adapter.pinned_keys() == {}
    # The same lookup, once nothing breaks, locks its L1 prefix and releases it whole.
    monkeypatch.undo()
    handle, locked = storage.start_prefetch(prompt)
    hits = len(locked) if locked is not None else storage.wait_prefetch(handle, 10)
    assert hits == len(prompt)
    storage.release(prompt)
    assert storage.flush(10)
    assert storage.l1.stats().read_locks == 0
