"""Every request the pool runs -- inline RETRIEVE, CLEAR, WAIT_PREFETCH_STATUS, a LOOKUP
that waits -- is answered, counted and logged once however it ends: a forced stop never
handles a completion queued after the loop's last turn, so the stop answers those itself,
and a completion handled after that (at a drain deadline) sends and counts nothing again."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import zmq
from native_keys import keys_of
from native_stop import STALL_LIMIT_S, dealer, let_go_after_the_last_turn, replies_to, wait_for

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

CHUNK = 4096
REQUEST = 60
#: the storage handle a prefetch that has to go to L2 is given in these tests
HANDLE = 7


@dataclass(frozen=True)
class Kind:
    """How to make one kind of pool request stall until the stop, then end; and the
    reply it gets when it ends well."""

    #: patches the storage call the request stalls in; ``end`` then raises or returns
    stall: Callable[[TiersServer, pytest.MonkeyPatch, Callable[[], Any]], None]
    #: sends the request (numbered REQUEST) on the socket
    send: Callable[[TiersServer, zmq.Socket[bytes], list[ObjectKey]], None]
    ended_well: type[p._Reply]


def _store(server: TiersServer, sock: zmq.Socket[bytes], keys: list[ObjectKey]) -> None:
    header = p.encoder.encode(p.StoreInline(1, "", keys))
    sock.send_multipart([header, *(b"x" * CHUNK for _ in keys)])
    (reply,) = sock.recv_multipart()
    assert isinstance(p.reply_decoder.decode(reply), p.StoreReply)


def _stall_retrieve(server: TiersServer, monkeypatch: pytest.MonkeyPatch, end: Callable[[], Any]) -> None:
    storage = server.storage
    lend = storage.lend

    def stalled(obj: Any, *, fill: bool = False) -> Any:
        if not fill:
            end()
        return lend(obj, fill=fill)

    monkeypatch.setattr(storage, "lend", stalled)


def _send_retrieve(server: TiersServer, sock: zmq.Socket[bytes], keys: list[ObjectKey]) -> None:
    sock.send(p.encoder.encode(p.Retrieve(REQUEST, "", keys, inline=True)))


def _stall_clear(server: TiersServer, monkeypatch: pytest.MonkeyPatch, end: Callable[[], Any]) -> None:
    storage = server.storage
    clear = storage.clear

    def stalled(*, force: bool = False) -> int:
        end()
        return clear(force=force)

    monkeypatch.setattr(storage, "clear", stalled)


def _send_clear(server: TiersServer, sock: zmq.Socket[bytes], keys: list[ObjectKey]) -> None:
    sock.send(p.encoder.encode(p.Clear(REQUEST, "")))


def _stall_prefetch(server: TiersServer, monkeypatch: pytest.MonkeyPatch, end: Callable[[], Any]) -> None:
    """A LOOKUP's prefetch goes to L2 and finishes (no hits) only once ``end`` returns."""
    storage = server.storage

    def wait(handle: int, timeout: float) -> int:
        end()
        return 0

    monkeypatch.setattr(storage, "start_prefetch", lambda keys, **options: (HANDLE, None))
    monkeypatch.setattr(storage, "query_prefetch", lambda handle: None)
    monkeypatch.setattr(storage, "wait_prefetch", wait)
    monkeypatch.setattr(storage, "discard_prefetch", lambda handle: None)


def _send_wait(server: TiersServer, sock: zmq.Socket[bytes], keys: list[ObjectKey]) -> None:
    sock.send(p.encoder.encode(p.Lookup(REQUEST - 1, "", keys)))
    (header,) = sock.recv_multipart()
    lookup = p.reply_decoder.decode(header)
    assert isinstance(lookup, p.LookupReply) and lookup.hits is None
    sock.send(p.encoder.encode(p.WaitPrefetchStatus(REQUEST, "", lookup.handle, 30.0)))


def _send_lookup_waiting(server: TiersServer, sock: zmq.Socket[bytes], keys: list[ObjectKey]) -> None:
    sock.send(p.encoder.encode(p.Lookup(REQUEST, "", keys, wait_s=30.0)))


KINDS = {
    "retrieve_inline": Kind(_stall_retrieve, _send_retrieve, p.RetrieveReply),
    "clear": Kind(_stall_clear, _send_clear, p.ClearReply),
    "wait_prefetch": Kind(_stall_prefetch, _send_wait, p.PrefetchStatusReply),
    "lookup_wait": Kind(_stall_prefetch, _send_lookup_waiting, p.LookupReply),
}


@pytest.mark.parametrize("force", [True, False], ids=["forced", "drain_deadline"])
@pytest.mark.parametrize("fails", [True, False], ids=["fails", "finishes"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_pool_request_ending_as_the_stop_comes_is_answered_counted_and_logged_once(
    make_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    fails: bool,
    force: bool,
) -> None:
    """The request stalls in the pool until the loop's last turn, then fails (or ends
    well): a forced stop never handles its completion, so the stop refuses it with its
    error (counted, logged with the request) or sends its reply.  At a drain deadline
    the completion is handled after that, and sends and counts nothing again."""
    server = make_server(frontends=[{"type": "native", "pool_workers": 1}], shutdown_timeout_s=0.2)
    frontend, how = server.frontends[0], KINDS[kind]
    keys = keys_of(4)
    sent = replies_to(frontend, monkeypatch, REQUEST)
    with dealer(server.endpoint) as sock:
        _store(server, sock, keys)
        go_on = let_go_after_the_last_turn(server, monkeypatch)

        started = threading.Event()

        def end() -> None:
            started.set()
            go_on.wait(STALL_LIMIT_S)  # still running when the stop comes
            if fails:
                raise RuntimeError("the pool request broke")

        how.stall(server, monkeypatch, end)
        how.send(server, sock, keys)
        # Not router.in_pool, which counts the request from its hand-off: a stop coming
        # before a pool thread takes it cancels it unstarted, and it never ends.
        wait_for(started.is_set, "the request running on the pool")
        frontend.stop(force=force)
        assert frontend.join(30)
        stats = frontend.stats()
        if fails:
            assert [(type(reply), getattr(reply, "code", None)) for reply in sent] == [
                (p.ErrorReply, p.ErrorCode.INTERNAL.value)
            ]
            assert stats.failures["internal"] == 1
            assert any(f"request {REQUEST} " in record.getMessage() for record in caplog.records)
        else:
            assert [type(reply) for reply in sent] == [how.ended_well]
            assert stats.failures["internal"] == 0
        assert stats.failures["shutting_down"] == 0
        frames = sock.recv_multipart()
    reply = p.reply_decoder.decode(frames[0])
    assert reply.req_id == REQUEST and type(reply) is type(sent[0])
    if kind == "retrieve_inline" and not fails:
        assert frames[1:] == [b"x" * CHUNK] * 4
        assert stats.retrieves == 1
    assert server.storage.status()["l1"]["read_locks"] == 0


def _stall_store(server: TiersServer, monkeypatch: pytest.MonkeyPatch, end: Callable[[], Any]) -> None:
    storage = server.storage
    lend = storage.lend

    def stalled(obj: Any, *, fill: bool = False) -> Any:
        if fill:
            end()
        return lend(obj, fill=fill)

    monkeypatch.setattr(storage, "lend", stalled)


def _send_store(server: TiersServer, sock: zmq.Socket[bytes], keys: list[ObjectKey]) -> None:
    fresh = keys_of(len(keys))  # not stored yet: the store copies, and stalls there
    header = p.encoder.encode(p.StoreInline(REQUEST, "", fresh))
    sock.send_multipart([header, *(b"y" * CHUNK for _ in fresh)])


#: with a STORE_INLINE, whose keys are counted as refused too when it is given up
GIVEN_UP_KINDS = {**KINDS, "store_inline": Kind(_stall_store, _send_store, p.StoreReply)}


def let_go_once_answered(server: TiersServer, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """An event the test's stalled pool request waits on, set only once the stop has
    given up on it and answered it (the stop gives back what clients hold next): the
    request ends then, its completion queued before the loop ends -- handled while the
    last replies land after a drain, never after a forced stop."""
    frontend = server.frontends[0]
    router, handlers = frontend.rpc.router, frontend.handlers
    go_on = threading.Event()
    release_everything = handlers.release_everything

    def let_go_then_release() -> None:
        go_on.set()
        wait_for(lambda: len(router._completions) == 1, "the stalled request never ended")
        release_everything()

    monkeypatch.setattr(handlers, "release_everything", let_go_then_release)
    return go_on


@pytest.mark.parametrize("force", [True, False], ids=["forced", "drain_deadline"])
@pytest.mark.parametrize("kind", list(GIVEN_UP_KINDS))
def test_a_pool_request_still_running_at_the_stop_is_answered_shutting_down_once(
    make_server: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: str,
    force: bool,
) -> None:
    """Given up (the stop does not wait for it), it is answered SHUTTING_DOWN at once --
    its client does not wait for its own timeout -- and counted once as refused, a
    store's keys too, and said in the stop's line.  Its work ends later: it gives back
    what it holds and sends nothing (after a drain its completion is handled while the
    last replies land: no second reply, none to a request reusing the id)."""
    server = make_server(frontends=[{"type": "native", "pool_workers": 1}], shutdown_timeout_s=0.2)
    frontend, how = server.frontends[0], GIVEN_UP_KINDS[kind]
    storage = server.storage
    keys = keys_of(4)
    sent = replies_to(frontend, monkeypatch, REQUEST)
    with dealer(server.endpoint) as sock:
        _store(server, sock, keys)
        go_on = let_go_once_answered(server, monkeypatch)
        started = threading.Event()

        def end() -> bool:
            started.set()
            return go_on.wait(STALL_LIMIT_S)

        how.stall(server, monkeypatch, end)
        how.send(server, sock, keys)
        wait_for(started.is_set, "the request running on the pool")  # as above
        frontend.stop(force=force)
        assert frontend.join(30)
        frames = sock.recv_multipart()
    reply = p.reply_decoder.decode(frames[0])
    assert isinstance(reply, p.ErrorReply) and reply.req_id == REQUEST, reply
    assert reply.code == p.ErrorCode.SHUTTING_DOWN.value and frames[1:] == []
    if not force:  # the late completion was handled, and sent nothing
        assert frontend.rpc.router.in_pool == 0
    assert [type(reply) for reply in sent] == [p.ErrorReply]
    stats = frontend.stats()
    assert stats.failures["shutting_down"] == 1
    assert stats.store_keys_refused["shutting_down"] == (4 if kind == "store_inline" else 0)
    assert sum(stats.store_keys_refused.values()) == stats.store_keys_refused["shutting_down"]
    lines = [r.getMessage() for r in caplog.records if "given up at the stop" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("1 pool requests given up at the stop")
    assert f"{int(kind == 'store_inline')} of them STORE_INLINEs" in lines[0]
    # What the late work held is given back, and a given-up store made nothing visible
    # (a late CLEAR still clears: it was not a store).
    l1 = storage.status()["l1"]
    assert (l1["read_locks"], l1["write_locked"]) == (0, 0)
    assert l1["objects"] == (0 if kind == "clear" else 4)
