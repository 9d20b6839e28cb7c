"""A split copy whose calling thread leaves early (a signal handler's exception while it
waits for the helper) returns only once the helper has stopped copying: the caller goes
on to give the memory back (a store aborts its reservation, a retrieve releases its
extents, a closed client unmaps the arena), and a copy into or out of it after that would
write into another writer's object or read a reused extent."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.wire import copies
from lmcache_tiers.wire.copies import SplitCopier

PIECE = 1 << 20
PIECES = 8


class _Interrupted(copies._Job):
    """A job whose first wait for the helper is cut short, as by a signal handler's
    exception; ``waiting_again`` is set when anything waits on it after that."""

    interrupted = False
    waiting_again: threading.Event

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        job = self
        real_wait = self.settled.wait

        def wait(timeout: float | None = None) -> bool:
            if not job.interrupted:
                job.interrupted = True
                raise KeyboardInterrupt
            _Interrupted.waiting_again.set()
            return real_wait(timeout)

        self.settled.wait = wait  # type: ignore[method-assign]


def test_the_caller_cut_short_returns_after_the_helper_stopped_copying(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    source = np.random.default_rng(5).integers(0, 256, PIECES * PIECE, dtype=np.uint8)
    target = np.zeros_like(source)
    pieces = [
        (target[low : low + PIECE], source[low : low + PIECE], low // PIECE)
        for low in range(0, source.nbytes, PIECE)
    ]
    helper_copying = threading.Event()
    helper_may_go_on = threading.Event()
    returned = threading.Event()
    waiting_again = threading.Event()
    monkeypatch.setattr(_Interrupted, "waiting_again", waiting_again, raising=False)
    monkeypatch.setattr(copies, "_Job", _Interrupted)

    def prepare(block: int) -> None:
        if threading.current_thread().name == "shm-copy":
            helper_copying.set()
            assert helper_may_go_on.wait(30)
        else:
            assert helper_copying.wait(30)  # the helper holds a piece before the caller goes on

    copier = SplitCopier()
    outcome: dict[str, Any] = {}

    def caller() -> None:
        try:
            copier.run(pieces, prepare)
        except KeyboardInterrupt:
            outcome["interrupted"] = True
        outcome["at_return"] = target.copy()
        returned.set()

    thread = threading.Thread(target=caller)
    thread.start()
    # The caller either returned or waits for the helper still: only then may it go on.
    while not (returned.wait(0.01) or waiting_again.is_set()):
        assert thread.is_alive()
    helper_may_go_on.set()
    thread.join(30)
    copier.stop()  # after the helper's piece
    assert outcome["interrupted"]
    assert np.array_equal(outcome["at_return"], target), "the helper copied after the caller returned"
