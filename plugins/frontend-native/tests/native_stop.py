"""What the native front end's tests of requests ending at a stop share: a raw socket,
the replies the server sends, and pool work let go only once the loop has turned for the
last time."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

#: how long a stalled pool request waits for the test at most (the test never relies on it)
STALL_LIMIT_S = 60.0


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting: {what}")
        time.sleep(0.01)


@contextlib.contextmanager
def dealer(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    """A raw socket to the server: it sends requests without waiting for their replies."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 20_000)
    try:
        sock.connect(endpoint)
        yield sock
    finally:
        sock.close()
        context.term()


def replies_to(frontend: Any, monkeypatch: pytest.MonkeyPatch, request: int) -> list[p.Reply]:
    """The replies the front end sends to ``request`` (filled in as they are sent)."""
    sent: list[p.Reply] = []
    send = frontend.rpc.router.send

    def recording(frames: list[Any]) -> bool:
        reply = p.reply_decoder.decode(bytes(frames[1]))
        if reply.req_id == request:
            sent.append(reply)
        return bool(send(frames))

    monkeypatch.setattr(frontend.rpc.router, "send", recording)
    return sent


def let_go_after_the_last_turn(server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event the test's stalled pool request waits on, set only once the loop has
    turned for the last time (the stop shuts the pool down next): the request ends then,
    its completion queued but never handled by the loop, before the stop looks at what
    is left in flight."""
    router = server.frontends[0].rpc.router
    go_on = threading.Event()
    shutdown = router._pool.shutdown

    def let_go_then_shut_down(*args: Any, **kwargs: Any) -> None:
        go_on.set()
        wait_for(lambda: len(router._completions) == 1, "the stalled request never ended")
        shutdown(*args, **kwargs)

    monkeypatch.setattr(router._pool, "shutdown", let_go_then_shut_down)
    return go_on
