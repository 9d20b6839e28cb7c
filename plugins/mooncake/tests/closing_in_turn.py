"""Closing the adapters tests leave open a few at a time, each as its Mooncake client wakes.

A Mooncake client's close waits for a thread of the client that wakes once a second,
counted from the client's set-up, and its binding holds the GIL all the while: closes
cannot overlap, and an adapter closed at the end of a test that ran 0.1 s holds the
process for 0.9 s.  Kept open until a few are waiting, the adapters are closed in the
order their clients wake next: one wait of at most a second or so closes them all.

Only adapters on a pool that outlives the tests (``mooncake_pool``) may wait: one on a
test's own cluster is closed with its test, before the cluster is killed.  Every adapter
is closed by the end of its module, and a close that fails names the test that opened it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> None: ...


#: adapters waiting before they are closed; more add threads (about 45 a client) for little
BATCH = 4
#: a close this long before a client's next wake still finds it asleep (the wake drifts)
_MARGIN_S = 0.1


AdapterT = TypeVar("AdapterT", bound=Closable)


class NotedAsOpened(list[AdapterT]):
    """A test's list of the adapters it opened, each noted as it is appended (right after
    it opened); one added otherwise (``+=``) is closed as its test ends."""

    def __init__(self, closing: ClosingInTurn) -> None:
        super().__init__()
        self._closing = closing

    def append(self, adapter: AdapterT) -> None:
        self._closing.opened(adapter)
        super().append(adapter)


class ClosingInTurn:
    """Adapters noted when they open (``opened``), closed a batch at a time once their
    tests are done (``done``), in the order their clients wake next."""

    def __init__(self, batch: int = BATCH) -> None:
        self.batch = batch
        self._opened_at: dict[int, float] = {}
        self._waiting: list[tuple[float, Closable, str]] = []

    def opened(self, adapter: Closable) -> None:
        self._opened_at[id(adapter)] = time.monotonic()

    def done(self, adapters: Iterable[Closable], test: str) -> None:
        """The test that opened ``adapters`` ended: close those of unknown wake at once,
        the others when ``batch`` are waiting."""
        for adapter in adapters:
            opened_at = self._opened_at.pop(id(adapter), None)
            if opened_at is None:
                _close(adapter, test)
            else:
                self._waiting.append((opened_at, adapter, test))
        if len(self._waiting) >= self.batch:
            self.close_all()

    def close_all(self) -> None:
        """Close every waiting adapter, the one whose client wakes soonest first."""
        failures: list[BaseException] = []
        while self._waiting:
            now = time.monotonic()
            self._waiting.sort(key=lambda waiting: (waiting[0] - now - _MARGIN_S) % 1.0)
            _, adapter, test = self._waiting.pop(0)
            try:
                _close(adapter, test)
            except AssertionError as exc:  # the others are closed all the same
                failures.append(exc)
        if failures:
            raise failures[0]


def _close(adapter: Closable, test: str) -> None:
    try:
        adapter.close()
    except Exception as exc:
        raise AssertionError(f"closing an adapter {test} opened failed: {exc!r}") from exc
