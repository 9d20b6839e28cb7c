"""A reply that cannot be sent gives back what it handed its client.

STORE_RESERVE hands over reservations, a LOOKUP answered with hits (at once, or after its
wait) and a RETRIEVE read locks, a LOOKUP answered while its prefetch runs the handle of
that prefetch: the client learns of each from the reply alone.  When the reply cannot go
(the client disconnected while it was handled, or stopped reading its replies:
``RouterLoop.send`` answers False and counts ``reply_dropped``), nobody releases, commits
or collects them.  They used to stay until their TTLs -- a reservation write-locked, then
fenced, and the client's own later stores of its keys refused meanwhile.  The failed send
is injected (the send answers as it does for a client that is gone): no timing.

A client that gave up on such a request may release the keys (a timed-out RETRIEVE does):
what was given back must not go back a second time, another client's lock in its place.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import pytest
from lmcache_plugin_frontend_native.sessions import Session
from native_keys import keys_of, stats_of

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

CHUNK = 256
MOCK_L2 = json.dumps({"type": "mock", "max_size_gb": 0.1})
#: an L2 whose lookups and loads each take 0.3 s: a LOOKUP of its keys finds its prefetch running
SLOW_L2 = json.dumps(
    {
        "type": "fault_inject",
        "inner": {"type": "mock", "max_size_gb": 0.1},
        "delay_s": 0.3,
        "delay_ops": ["lookup", "load"],
    }
)


#: how long a client whose reply the test dropped waits, on close, for that reply (its
#: ``cleanup_timeout``; 2 s by default): it never comes, so the wait only ever ends here
DROPPED_REPLY_WAIT_S = 0.2


def drop_next_reply(server: TiersServer, kind: type[p.Reply], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The next reply of type ``kind`` is not sent, as to a client that is gone; returns the
    list the dropped reply's frames are put in."""
    router: Any = server.frontends[0].rpc.router  # type: ignore[attr-defined]
    send = router.send
    dropped: list[Any] = []

    def failing_send(frames: Any) -> bool:
        if not dropped and type(p.reply_decoder.decode(frames[1])) is kind:
            dropped.append(frames)
            return False  # what RouterLoop.send answers when the client is gone
        return bool(send(frames))

    monkeypatch.setattr(router, "send", failing_send)
    return dropped


def unanswered(client: Client, request: p._Request, dropped: list[Any]) -> bytes:
    """Send ``request`` and give it up, as a timeout does; a PING after it is answered, so the
    server handled it (and its pool work: the client's requests are answered in order only
    for those served at once, so the caller's request must be one the loop answers, or
    already dropped).  Returns the routing identity the reply was dropped for."""
    with client._lock:
        client._start(request, (), time.monotonic() + 30)
        client._give_up(request)
    deadline = time.monotonic() + 30
    while not dropped:  # a request the pool answers is dropped once its work is over
        assert time.monotonic() < deadline, "the reply was never dropped"
        client.ping()
    client.ping()
    frames = dropped[0]
    assert p.reply_decoder.decode(frames[1]).req_id == request.req_id
    return bytes(frames[0])


def stored(server: TiersServer, client: Client, count: int) -> list[ObjectKey]:
    keys = keys_of(count)
    assert client.store(keys, [os.urandom(CHUNK) for _ in keys]) == count
    return keys


def given_back_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if "could not be sent" in record.getMessage()]


def test_a_reservation_whose_slots_never_reached_its_client_is_given_back(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    keys = keys_of(2)
    dropped = drop_next_reply(server, p.StoreReserveReply, monkeypatch)
    with Client(server.endpoint, timeout=30, cleanup_timeout=DROPPED_REPLY_WAIT_S) as client:
        assert client.uses_shm
        identity = unanswered(client, p.StoreReserve(0, "", keys, [CHUNK, CHUNK]), dropped)
        l1 = server.storage.l1.stats()
        assert l1.write_locked == 0 and l1.objects == 0
        assert stats_of(server).store_keys_refused["reply_dropped"] == 2
        session = server.frontends[0].handlers.sessions.peek(identity)  # type: ignore[attr-defined]
        assert session is not None and not session.writes and not session.fenced
        [line] = given_back_lines(caplog)
        assert "2 reservations were given back" in line
        # Nothing is aborted twice: the client's abort of those keys finds none of its own.
        aborted = stats_of(server).store_keys_skipped["aborted"]
        with client._lock:
            reply = client._call(p.StoreAbort(0, "", keys), p.StoreReply)
        assert reply.done == [False, False]
        assert stats_of(server).store_keys_skipped["aborted"] == aborted
        # The keys are free for the next store, this client's own among them.
        data = [os.urandom(CHUNK) for _ in keys]
        assert client.store(keys, data) == 2
        targets = [bytearray(CHUNK) for _ in keys]
        assert client.retrieve_into(keys, targets) == 2
        assert [bytes(target) for target in targets] == data


@pytest.mark.parametrize("kind", [p.Lookup, p.Retrieve], ids=["lookup", "retrieve"])
def test_read_locks_whose_reply_never_reached_its_client_are_given_back(
    server: TiersServer,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: type[p.Lookup] | type[p.Retrieve],
) -> None:
    caplog.set_level(logging.WARNING)
    with (
        Client(server.endpoint, timeout=30, cleanup_timeout=DROPPED_REPLY_WAIT_S) as client,
        Client(server.endpoint, timeout=30) as other,
    ):
        keys = stored(server, client, 2)
        assert other.lookup(keys) == 2  # another client's locks, which must stay
        assert client.lookup(keys) == 2  # this client's own, which its RELEASE gives back
        assert server.storage.l1.stats().read_locks == 4
        dropped = drop_next_reply(server, p.LookupReply if kind is p.Lookup else p.RetrieveReply, monkeypatch)
        unanswered(client, kind(0, "", keys), dropped)  # a LOOKUP with no wait: answered at once
        assert server.storage.l1.stats().read_locks == 4
        [line] = given_back_lines(caplog)
        assert f"a {kind.__name__.upper()} reply could not be sent" in line
        assert "read locks on 2 keys were given back" in line
        # The client gives up on the request and releases its keys: its lookup's locks go,
        # the dropped reply's are not released a second time (the other client's instead).
        assert client.release(keys) == 2
        assert server.storage.l1.stats().read_locks == 2
        assert other.release(keys) == 2
        assert server.storage.l1.stats().read_locks == 0


def test_a_prefetch_result_whose_reply_never_reached_its_client_is_given_back(
    make_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    server = make_server(adapters=[MOCK_L2])
    with Client(server.endpoint, timeout=30, cleanup_timeout=DROPPED_REPLY_WAIT_S) as client:
        assert "lookup_wait" in client.server_features
        keys = stored(server, client, 2)
        assert server.storage.flush(timeout=30)
        assert client.clear() == 2  # in L2 only: a LOOKUP waits for its prefetch on the pool
        dropped = drop_next_reply(server, p.LookupReply, monkeypatch)
        identity = unanswered(client, p.Lookup(0, "", keys, 30.0), dropped)
        assert p.reply_decoder.decode(dropped[0][1]).hits == 2
        assert server.storage.l1.stats().read_locks == 0
        session = server.frontends[0].handlers.sessions.peek(identity)  # type: ignore[attr-defined]
        assert session.locked_keys == 0 and not session.prefetches
        [line] = given_back_lines(caplog)
        assert "a prefetch result reply could not be sent" in line
        assert client.release(keys) == 0  # nothing of its own is left to release


def test_a_running_prefetch_whose_handle_never_reached_its_client_is_given_back(
    make_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    server = make_server(adapters=[SLOW_L2])
    with Client(server.endpoint, timeout=30, cleanup_timeout=DROPPED_REPLY_WAIT_S) as client:
        keys = stored(server, client, 2)
        assert server.storage.flush(timeout=30)
        assert client.clear() == 2
        dropped = drop_next_reply(server, p.LookupReply, monkeypatch)
        identity = unanswered(client, p.Lookup(0, "", keys), dropped)  # no wait: the handle at once
        assert p.reply_decoder.decode(dropped[0][1]).hits is None
        session = server.frontends[0].handlers.sessions.peek(identity)  # type: ignore[attr-defined]
        assert not session.prefetches  # no one could collect it: not kept until the result TTL
        [line] = given_back_lines(caplog)
        assert "the prefetch was given back" in line


def test_only_the_locks_of_the_unsent_reply_are_forgotten() -> None:
    first, second, never = keys_of(3)
    session = Session(b"client", 0.0)
    session.add_read_locks([first, second], 10.0, distinct=True)  # a LOOKUP's
    session.add_read_locks([first, second], 20.0)  # a RETRIEVE's
    session.add_read_locks([first], 20.0)  # another RETRIEVE's
    assert session.take_read_lock_at([first, second, never], 20.0) == [first, second]
    assert session.lock_deadlines == {first: {10.0: 1, 20.0: 1}, second: {10.0: 1}}
    assert session.take_read_lock_at([second], 30.0) == []  # none expires then
    assert session.take_read_lock_at([second], 10.0) == [second]
    assert session.lock_deadlines == {first: {10.0: 1, 20.0: 1}}
    assert session.locked_keys == 1
