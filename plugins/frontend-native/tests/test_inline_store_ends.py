"""A STORE_INLINE runs on the pool: its keys are counted once however it ends -- finished,
refused, still copying when the stop's drain gives up on it, or never started (cancelled
from the pool's queue) -- and never again if it finishes after the stop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import zmq
from native_keys import keys_accounted, keys_of
from native_stop import STALL_LIMIT_S, dealer, let_go_after_the_last_turn, replies_to, wait_for

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.wire import protocol as p

CHUNK = 4096


def _send_inline_store(sock: zmq.Socket[bytes], request: int) -> None:
    """A STORE_INLINE of four chunks, not waiting for its reply."""
    keys = keys_of(4)
    header = p.encoder.encode(p.StoreInline(request, "", keys))
    sock.send_multipart([header, *(bytes([request]) * CHUNK for _ in keys)])


def test_inline_stores_the_drain_gives_up_on_count_their_keys_once(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One pool thread: the first store stalls in its copy, the second waits in the queue.
    server = make_server(frontends=[{"type": "native", "pool_workers": 1}], shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    lend = storage.lend
    go_on = threading.Event()

    def stalled(obj: Any, *, fill: bool = False) -> Any:
        if fill:
            go_on.wait(STALL_LIMIT_S)  # a copy slower than the drain
        return lend(obj, fill=fill)

    monkeypatch.setattr(storage, "lend", stalled)
    with dealer(server.endpoint) as sock:
        _send_inline_store(sock, 20)
        _send_inline_store(sock, 21)
        wait_for(
            lambda: frontend.rpc.router.in_pool == 2 and storage.status()["l1"]["write_locked"] == 4,
            "the first store copying, the second queued",
        )
        frontend.stop()
        assert frontend.join(30)
    stats = frontend.stats()
    assert stats.store_keys_refused["shutting_down"] == 8
    assert stats.failures["shutting_down"] == 2
    assert keys_accounted(server) == 8
    # The copy the drain gave up on finishes now: its reservations are given back, not
    # made visible (its keys were counted as refused), and nothing is counted again.
    go_on.set()
    wait_for(
        lambda: storage.status()["l1"]["write_locked"] == 0, "the late copy never gave its reservations back"
    )
    assert storage.status()["l1"]["objects"] == 0
    assert keys_accounted(server) == 8


def test_an_inline_store_whose_commit_raises_gives_its_reservations_back(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(frontends=[{"type": "native"}])
    storage = server.storage

    def broken(reserved: Any, *, to_l2: bool = True) -> list[ObjectKey]:
        raise RuntimeError("the commit broke")

    monkeypatch.setattr(storage, "commit_reserved", broken)
    with dealer(server.endpoint) as sock:
        _send_inline_store(sock, 30)
        (header,) = sock.recv_multipart()
    reply = p.reply_decoder.decode(header)
    assert isinstance(reply, p.ErrorReply) and reply.code == p.ErrorCode.INTERNAL.value
    # Refused whole, its keys counted under the error's code, and not left write-locked
    # until the write TTL.
    assert server.frontends[0].stats().store_keys_refused["internal"] == 4
    assert storage.status()["l1"]["write_locked"] == 0
    assert keys_accounted(server) == 4


def _copy_ends_as_the_stop_gives_up(
    server: TiersServer, monkeypatch: pytest.MonkeyPatch, *, fails: bool = True
) -> None:
    """Inline copies stall until the stop, then fail (or finish) after the loop's last
    turn: the store's completion is queued, never handled by the loop, when the stop
    looks at it."""
    storage = server.storage
    lend = storage.lend
    go_on = let_go_after_the_last_turn(server, monkeypatch)

    def stalled_then_broken(obj: Any, *, fill: bool = False) -> Any:
        go_on.wait(STALL_LIMIT_S)  # still copying when the stop comes
        if fails:
            raise RuntimeError("the copy broke")
        return lend(obj, fill=fill)

    monkeypatch.setattr(storage, "lend", stalled_then_broken)


@pytest.mark.parametrize("force", [True, False], ids=["forced", "drain_deadline"])
def test_an_inline_store_failing_as_the_stop_comes_is_counted_logged_and_answered_once(
    make_server: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, force: bool
) -> None:
    """A forced stop never handles the failed store's completion: the stop counts its
    error (and its keys under the error's code), logs it with the request and answers the
    client.  At a drain deadline the completion is handled after that: nothing twice."""
    server = make_server(frontends=[{"type": "native", "pool_workers": 1}], shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    _copy_ends_as_the_stop_gives_up(server, monkeypatch)
    sent = replies_to(frontend, monkeypatch, 40)
    with dealer(server.endpoint) as sock:
        _send_inline_store(sock, 40)
        wait_for(lambda: storage.status()["l1"]["write_locked"] == 4, "the store copying")
        frontend.stop(force=force)
        assert frontend.join(30)
        stats = frontend.stats()
        assert stats.failures["internal"] == 1
        assert stats.store_keys_refused["internal"] == 4
        assert keys_accounted(server) == 4
        assert any("request 40 " in record.getMessage() for record in caplog.records)
        assert [(type(reply), getattr(reply, "code", None)) for reply in sent] == [
            (p.ErrorReply, p.ErrorCode.INTERNAL.value)
        ]
        (header,) = sock.recv_multipart()
    reply = p.reply_decoder.decode(header)
    assert isinstance(reply, p.ErrorReply) and reply.req_id == 40
    assert storage.status()["l1"]["write_locked"] == 0


def test_an_inline_store_stored_as_a_forced_stop_comes_is_answered_once(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server(frontends=[{"type": "native", "pool_workers": 1}])
    storage, frontend = server.storage, server.frontends[0]
    _copy_ends_as_the_stop_gives_up(server, monkeypatch, fails=False)
    sent = replies_to(frontend, monkeypatch, 50)
    with dealer(server.endpoint) as sock:
        _send_inline_store(sock, 50)
        wait_for(lambda: storage.status()["l1"]["write_locked"] == 4, "the store copying")
        frontend.stop(force=True)
        assert frontend.join(30)
        assert len(sent) == 1
        (header,) = sock.recv_multipart()
    reply = p.reply_decoder.decode(header)
    assert isinstance(reply, p.StoreReply) and reply.done == [True] * 4
    stats = frontend.stats()
    assert (stats.stores, stats.store_chunks) == (1, 4)
    assert keys_accounted(server) == 4
    assert storage.status()["l1"]["objects"] == 4
