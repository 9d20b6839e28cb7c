"""A pickled ``commit_store`` runs on the pool: its keys are counted once however it ends --
finished, raising, still copying when the stop's drain gives up on it, or never started
(cancelled from the pool's queue) -- and never again if it finishes after the stop."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from mp_counts import keys_accounted
from mpclient import (
    STALL_LIMIT_S,
    MPClient,
    Registration,
    mp_address,
    send_pickled_store,
    stalled_fills,
    wait_for,
)

from lmcache_tiers.router import ABANDONED_REASON

REG = Registration()


def test_pickled_stores_the_drain_gives_up_on_count_their_keys_once(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One pool thread: the first store stalls in its copy, the second waits in the queue.
    server = make_mp_server(shm=False, allow_pickle=True, workers=1, shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    with stalled_fills(storage, monkeypatch) as go_on, MPClient(mp_address(server)) as client:
        client.register(REG)
        send_pickled_store(client, 20, "store-20")
        send_pickled_store(client, 21, "store-21")
        wait_for(
            lambda: frontend.loop.router.in_pool == 2 and storage.status()["l1"]["write_locked"] == 4,
            "the first store copying, the second queued",
        )
        frontend.stop()
        assert frontend.join(30)
        stats = frontend.stats()
        assert stats.store_keys_refused["shutting_down"] == 8
        assert keys_accounted(server) == 8
        # The copy the drain gave up on finishes now: its reservations are given back, not
        # made visible (its keys were counted as refused), and nothing is counted again.
        go_on.set()
    wait_for(
        lambda: storage.status()["l1"]["write_locked"] == 0, "the late copy never gave its reservations back"
    )
    assert storage.status()["l1"]["objects"] == 0
    assert stats.store_chunks == 0
    assert keys_accounted(server) == 8


def test_a_pickled_store_whose_handler_raises_counts_its_keys(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the native front end counts a refused STORE's keys under its error code."""
    server = make_mp_server(shm=False, allow_pickle=True)
    storage = server.storage

    def broken(obj: Any, *, fill: bool = False) -> Any:
        raise RuntimeError("a bug in the copy")

    monkeypatch.setattr(storage, "lend", broken)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        send_pickled_store(client, 22, "s")  # not answered
        stats = server.frontends[0].stats()
        wait_for(lambda: stats.failures["mp_handler_error"] == 1, "the failed store was not counted")
        assert stats.store_keys_refused["mp_handler_error"] == 4
        assert keys_accounted(server) == 4
        assert storage.status()["l1"]["write_locked"] == 0


def test_a_copy_raising_after_the_stop_gave_up_on_it_is_counted_once(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stop counted it (mp_shutting_down): its late failure, answered while the last
    replies go out, is not counted (nor logged) again as mp_handler_error."""
    server = make_mp_server(shm=False, allow_pickle=True, workers=1, shutdown_timeout_s=0.2)
    storage, frontend = server.storage, server.frontends[0]
    router, transfers = frontend.loop.router, frontend.handlers.transfers
    go_on = threading.Event()

    def stalled_then_broken(obj: Any, *, fill: bool = False) -> Any:
        go_on.wait(STALL_LIMIT_S)  # still copying at the drain deadline
        raise RuntimeError("the copy broke after the stop")

    give_up = transfers._give_up_pickled_stores

    def give_up_then_let_the_copy_fail() -> None:
        give_up()
        go_on.set()
        # Its completion is then handled while the last replies land, before the close.
        wait_for(lambda: len(router._completions) == 1, "the late copy never ended")

    monkeypatch.setattr(storage, "lend", stalled_then_broken)
    monkeypatch.setattr(transfers, "_give_up_pickled_stores", give_up_then_let_the_copy_fail)
    with MPClient(mp_address(server)) as client:
        client.register(REG)
        send_pickled_store(client, 23, "store-23")
        wait_for(lambda: storage.status()["l1"]["write_locked"] == 4, "the store copying")
        frontend.stop()
        assert frontend.join(30)
    stats = frontend.stats()
    assert router.in_pool == 0  # the late failure was handled
    assert stats.failures["mp_shutting_down"] == 1
    assert stats.failures["mp_handler_error"] == 0
    assert stats.store_keys_refused["shutting_down"] == 4
    assert keys_accounted(server) == 4
    assert storage.status()["l1"]["write_locked"] == 0


def test_a_pickled_store_that_ended_unanswered_at_a_forced_stop_is_counted_once(
    make_mp_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its copy committed, but a forced stop ended the loop before its completion was
    handled: never answered, its keys counted as stored, and the request counted once as
    ``pool_request_abandoned``.  It was counted nowhere: the router took every pickled
    store for one the stop had given up on and counted."""
    server = make_mp_server(shm=False, allow_pickle=True, workers=1)
    frontend, transfers = server.frontends[0], server.frontends[0].handlers.transfers
    ended, go_on = threading.Event(), threading.Event()
    write = transfers._write_pickled

    def written_then_held(*args: Any) -> None:
        write(*args)
        ended.set()
        go_on.wait(STALL_LIMIT_S)  # its completion comes only after the stop

    monkeypatch.setattr(transfers, "_write_pickled", written_then_held)
    try:
        with MPClient(mp_address(server)) as client:
            client.register(REG)
            send_pickled_store(client, 24, "store-24")
            assert ended.wait(STALL_LIMIT_S)
            frontend.stop(force=True)
            assert frontend.join(30)
    finally:
        go_on.set()
    stats = frontend.stats()
    assert stats.store_chunks == 4
    assert stats.failures["mp_shutting_down"] == 0
    assert stats.failures[ABANDONED_REASON] == 1
    assert keys_accounted(server) == 4
