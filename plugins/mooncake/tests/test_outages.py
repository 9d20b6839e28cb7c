"""The master goes away and comes back: calls fail within the timeout, nothing hangs, and
the adapter works again by itself.  Plus the deadline pool the lookups run on."""

from __future__ import annotations

import contextlib
import importlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from lmcache_plugin_mooncake import MooncakeStoreConfig
from lmcache_plugin_mooncake import backend as backend_module
from lmcache_plugin_mooncake import client as client_module
from lmcache_plugin_mooncake.calls import CallPool, CallTimeout
from lmcache_plugin_mooncake.client import MooncakeUnavailable
from lmcache_plugin_mooncake.cluster import LocalCluster
from lmcache_plugin_mooncake.listing import iter_pool_names
from mooncake_helpers import backend_of, config_for, eventually, open_adapter

from lmcache_tiers.errors import BackendUnavailableError, TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.plugin import free_ports
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.processes import wait_stopped

SIZE = 64 << 10
#: generous bound on a call against a dead master with a 1 s timeout: a guard against
#: hangs, not a performance expectation
HANG_GUARD_S = 20.0
#: Mooncake's master RPC timeout where a test needs a probe given up after
#: operation_timeout_s (0.5 s) still inside Mooncake: several seconds longer
FROZEN_PROBE_RPC_TIMEOUT_MS = 4000


def _round_trip(client: BlockingAdapterClient, start: int) -> bool:
    keys = make_keys(2, start=start)
    data = [pattern(start + i, SIZE) for i in range(2)]
    if client.store(keys, [memoryview(d) for d in data]) != [True, True]:
        return False
    result = client.lookup_and_lock(keys)
    buffers = [memoryview(bytearray(SIZE)) for _ in keys]
    loaded = client.load(keys, buffers) if all(result.found) else [False]
    client.adapter.unlock([k for k, hit in zip(keys, result.found, strict=True) if hit])
    return loaded == [True, True] and [bytes(b) for b in buffers] == data


def _first_round_trip(client: BlockingAdapterClient) -> None:
    """A round trip once the adapter is connected: its first set-up runs in the background
    within ``operation_timeout_s`` (a fraction of a second in these tests), which a loaded
    machine can miss once; the set-up is retried a second later."""
    eventually(lambda: _round_trip(client, 0), timeout=60, what="a first round trip through the pool")


def test_master_killed_mid_run_then_restarted(own_cluster: LocalCluster) -> None:
    own_cluster.add_segment_host("128MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=1.0))
    client = BlockingAdapterClient(adapter, timeout=60)
    try:
        _first_round_trip(client)
        stored = make_keys(2, start=0)
        own_cluster.kill_master()

        started = time.monotonic()
        assert client.lookup_and_lock(stored).found == [False, False]
        assert time.monotonic() - started < HANG_GUARD_S
        assert client.store(make_keys(1, start=50), [memoryview(b"x" * SIZE)]) == [False]
        buffers = [memoryview(bytearray(SIZE)) for _ in stored]
        assert client.load(stored, buffers) == [False, False]
        assert adapter.delete(stored) == [False, False]
        assert time.monotonic() - started < 4 * HANG_GUARD_S
        stats = adapter.stats()
        assert stats["backend_errors"] >= 4, stats

        # Repeated failures open core's circuit: lookups then miss without calling Mooncake.
        for _ in range(5):
            client.lookup_and_lock(stored)
        assert adapter.stats()["circuit_open"] == 1
        missed = adapter.stats()["circuit_missed_lookup_keys"]
        assert client.lookup_and_lock(stored).found == [False, False]
        assert adapter.stats()["circuit_missed_lookup_keys"] == missed + 2

        own_cluster.start_master()  # same ports, empty: objects do not survive it
        own_cluster.wait_for_segments(1)
        eventually(
            lambda: adapter.stats()["circuit_open"] == 0, timeout=60, what="the circuit closing by itself"
        )
        assert adapter.stats()["circuit_closed"] >= 1
        eventually(lambda: _round_trip(client, 100), timeout=60, what="stores and hits after the restart")
        assert client.lookup_and_lock(stored).found == [False, False], "old objects died with the master"
        assert adapter.used_bytes() == 2 * SIZE, "only the new objects are accounted"
        assert adapter.stats()["connected"] == 1
    finally:
        adapter.close()


def test_a_hung_master_fails_calls_after_the_timeout(own_cluster: LocalCluster) -> None:
    own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=1.0))
    client = BlockingAdapterClient(adapter, timeout=60)
    master = own_cluster.master
    assert master is not None
    try:
        _first_round_trip(client)
        master.send_signal(signal.SIGSTOP)
        wait_stopped(master.pid, HANG_GUARD_S)
        try:
            started = time.monotonic()
            assert client.lookup_and_lock(make_keys(2)).found == [False, False]
            assert client.store(make_keys(1, start=9), [memoryview(b"z" * SIZE)]) == [False]
            assert time.monotonic() - started < HANG_GUARD_S
        finally:
            master.send_signal(signal.SIGCONT)
        assert adapter.stats()["backend_errors"] >= 2
        eventually(lambda: _round_trip(client, 10), timeout=60, what="calls working once the master answers")
    finally:
        adapter.close()


def test_an_adapter_opened_before_the_master_starts_connects_later(own_cluster: LocalCluster) -> None:
    own_cluster.kill_master()
    started = time.monotonic()
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=1.0))
    try:
        assert time.monotonic() - started < HANG_GUARD_S, "opening must not wait for the master"
        client = BlockingAdapterClient(adapter, timeout=60)
        assert adapter.stats()["connected"] == 0
        assert client.lookup_and_lock(make_keys(1)).found == [False]
        assert client.store(make_keys(1), [memoryview(b"y" * SIZE)]) == [False]
        assert adapter.stats()["backend_errors"] == 2
        own_cluster.start_master()
        own_cluster.add_segment_host("64MB")
        eventually(lambda: adapter.stats()["connected"] == 1, timeout=90, what="the connection")
        assert adapter.stats()["connect_failures"] >= 1
        _first_round_trip(client)
    finally:
        adapter.close()


def test_a_missing_client_library_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def refuse(name: str, package: str | None = None) -> object:
        if name == "mooncake.store":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real(name, package)

    monkeypatch.setattr(client_module.importlib, "import_module", refuse)
    with pytest.raises(
        BackendUnavailableError, match=r"libibverbs.*pip install 'lmcache-plugin-mooncake\[non-cuda\]'"
    ):
        # Refused before any connection is tried: nothing needs to listen at these ports.
        metadata_port, master_port = free_ports(2)
        open_adapter(
            MooncakeStoreConfig(
                metadata_server=f"http://127.0.0.1:{metadata_port}/metadata",
                master_server_address=f"127.0.0.1:{master_port}",
                global_segment_size=0,
            )
        )


def test_timeouts_are_put_in_mooncakes_environment_unless_the_operator_set_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(client_module, "_OPERATOR_SET", None)
    for name in client_module.timeout_environment(1.0):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "77")
    applied = client_module.apply_timeout_environment(2.5)
    assert applied["MC_RPC_TIMEOUT_MS"] == "2500"
    assert applied["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "3"
    assert applied["MC_TCP_STATUS_TIMEOUT_SEC"] == "77", "the operator's value wins"
    assert client_module.apply_timeout_environment(1.0)["MC_RPC_TIMEOUT_MS"] == "1000", (
        "ours follow the adapter"
    )


# -- the deadline pool --------------------------------------------------------------------------


def test_a_call_past_its_deadline_is_given_up_and_cleaned_up_when_it_ends() -> None:
    pool = CallPool("test", 1, exit_wait_s=10)
    release = threading.Event()
    late: list[str] = []
    try:
        started = time.monotonic()
        with pytest.raises(CallTimeout, match=r"lookup did not answer within 0\.2s"):
            pool.run("lookup", 0.2, release.wait, 30, on_late=lambda: late.append("first"))
        assert time.monotonic() - started < HANG_GUARD_S
        # The only thread is stuck: the next call waits in the queue, is given up, never runs.
        ran: list[int] = []
        with pytest.raises(CallTimeout):
            pool.run("queued", 0.1, ran.append, 1, on_late=lambda: late.append("second"))
        assert late == [] and pool.busy == 1
        release.set()
        eventually(lambda: late == ["first", "second"], timeout=10, what="late clean-ups")
        assert ran == [], "a call given up before it started never runs"
        assert pool.run("after", 5, lambda x: x * 2, 21) == 42
    finally:
        release.set()
        pool.close()


def test_a_call_answered_in_time_returns_or_raises_as_it_did() -> None:
    pool = CallPool("test", 2, exit_wait_s=10)
    cleaned: list[int] = []
    try:
        assert pool.run("ok", 5, sum, [1, 2, 3], on_late=lambda: cleaned.append(1)) == 6
        with pytest.raises(ZeroDivisionError):
            pool.run("fails", 5, lambda: 1 / 0)
        assert cleaned == [], "on_late is only for calls given up"
    finally:
        pool.close()


# -- the master's key listing -------------------------------------------------------------------


def _serve_once(body: bytes, length: int) -> tuple[str, threading.Thread]:
    """An HTTP server on loopback that answers one request with ``body`` under a
    ``Content-Length`` of ``length``, then closes the connection."""
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n" % length + body
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


def test_a_key_listing_cut_short_by_the_master_fails_instead_of_passing_for_the_whole() -> None:
    """The master announces the listing's length; a connection that closes before it all
    arrived (the master stopped mid-listing) must not read as the end of the pool's keys,
    or the start-up scan would account part of the pool as all of it."""
    body = b"p/a\np/b\np/c\n"
    url, thread = _serve_once(body, len(body) + 100)
    try:
        with pytest.raises(OSError, match="cut short"):
            list(iter_pool_names(url, "p/", 5.0))
    finally:
        thread.join(10)


def test_a_whole_key_listing_is_read_to_its_end() -> None:
    body = b"p/a\nq/b\np/c\n"
    url, thread = _serve_once(body, len(body))
    try:
        assert list(iter_pool_names(url, "p/", 5.0)) == ["p/a", "p/c"]
    finally:
        thread.join(10)


class _Recording:
    """A Mooncake client whose calls and close are recorded in order (the calls go through)."""

    def __init__(self, store: object, events: list[str]) -> None:
        self._store = store
        self._events = events

    def __getattr__(self, name: str) -> object:
        method = getattr(self._store, name)
        events = self._events

        def recorded(*args: object) -> object:
            events.append(f"enter {name}")
            try:
                return method(*args)
            finally:
                events.append(f"leave {name}")

        return recorded


def _resume_once_closing(connection: object, master: object) -> threading.Thread:
    """SIGCONT ``master`` as soon as ``connection``'s close has begun: the calls stuck on
    it then end while close waits for them, and close finds the master answering (a
    client whose master does not answer at close is left unclosed, never closed)."""

    def resume() -> None:
        eventually(lambda: connection._stop.is_set(), timeout=HANG_GUARD_S, what="close begun")  # type: ignore[attr-defined]
        master.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]

    thread = threading.Thread(target=resume, daemon=True)
    thread.start()
    return thread


def test_close_never_closes_the_client_under_a_load_still_in_mooncake(own_cluster: LocalCluster) -> None:
    # Core stops waiting for running calls after its close_timeout_s, which may be
    # shorter than operation_timeout_s: the backend's close must still let a load that
    # is inside Mooncake (writing into L1) end before the client under it is closed.
    own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=2.0))
    adapter.close_timeout_s = 0.2  # type: ignore[misc]  # core gives up on the load at once
    client = BlockingAdapterClient(adapter, timeout=60)
    master = own_cluster.master
    assert master is not None
    keys = make_keys(1)
    assert client.store(keys, [memoryview(pattern(0, SIZE))]) == [True]
    assert client.lookup_and_lock(keys).found == [True]
    events: list[str] = []
    connection = adapter.backend.inner.connection  # type: ignore[attr-defined]  # behind the breaker
    with connection._lock:
        connection._store = _Recording(connection._store, events)
    master.send_signal(signal.SIGSTOP)
    wait_stopped(master.pid, HANG_GUARD_S)
    try:
        loading = threading.Thread(
            target=client.load, args=(keys, [memoryview(bytearray(SIZE))]), daemon=True
        )
        loading.start()
        eventually(lambda: any(event.startswith("enter ") for event in events), what="the load in Mooncake")
        resuming = _resume_once_closing(connection, master)
        adapter.close()
        resuming.join(HANG_GUARD_S)
    finally:
        master.send_signal(signal.SIGCONT)
    loading.join(HANG_GUARD_S)
    eventually(lambda: "enter close" in events, what="the client closed")
    load_calls = [event for event in events if event != "enter close" and event != "leave close"]
    closed_at = events.index("enter close")
    assert events[:closed_at] == load_calls, f"the client was closed under a running call: {events}"


@pytest.mark.parametrize("call", ["delete", "probe"])
def test_close_never_closes_the_client_under_a_delete_or_probe_in_mooncake(
    own_cluster: LocalCluster, call: str
) -> None:
    # Deletes and probes run on the deadline pool: their caller may have given them up,
    # but a call still inside Mooncake (a delete reads headers into the header lanes)
    # must end before the client under it is closed, as a load must.
    own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=2.0))
    client = BlockingAdapterClient(adapter, timeout=60)
    master = own_cluster.master
    assert master is not None
    keys = make_keys(1)
    assert client.store(keys, [memoryview(pattern(0, SIZE))]) == [True]
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind the breaker
    events: list[str] = []
    with backend.connection._lock:
        backend.connection._store = _Recording(backend.connection._store, events)
    master.send_signal(signal.SIGSTOP)
    wait_stopped(master.pid, HANG_GUARD_S)
    try:
        work = (lambda: backend.delete_many(keys)) if call == "delete" else backend.ping

        def given_up() -> None:
            # Given up at its deadline, or answered once close resumed the master: either
            # way the call stays inside Mooncake until close has begun.
            with contextlib.suppress(TiersError):
                work()

        calling = threading.Thread(target=given_up, daemon=True)
        calling.start()
        eventually(
            lambda: any(event.startswith("enter ") for event in events), what=f"the {call} in Mooncake"
        )
        resuming = _resume_once_closing(backend.connection, master)
        adapter.close()
        resuming.join(HANG_GUARD_S)
    finally:
        master.send_signal(signal.SIGCONT)
    calling.join(HANG_GUARD_S)
    eventually(lambda: "enter close" in events, what="the client closed")
    calls = [event for event in events if event not in ("enter close", "leave close")]
    closed_at = events.index("enter close")
    assert events[:closed_at] == calls, f"the client was closed under a running call: {events}"


def test_a_client_close_left_open_under_a_call_is_closed_when_that_call_ends(
    own_cluster: LocalCluster,
) -> None:
    # A close that waited out 3 x operation_timeout_s leaves the client open under the
    # call still using it; that call's end must close it (else every such close leaks
    # the client's threads and descriptors for good).  The call here is a lease held
    # open by the test: a call inside Mooncake, as long as the test wants.
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=0.2))
    backend = backend_of(adapter)
    connection = backend.connection
    eventually(lambda: connection.connected, what="the client connected")
    events: list[str] = []
    with connection._lock:
        connection._store = _Recording(connection._store, events)
    inside = threading.Event()
    release = threading.Event()

    def held_call() -> None:
        with connection.leased():
            inside.set()
            release.wait(HANG_GUARD_S)

    calling = threading.Thread(target=held_call, daemon=True)
    calling.start()
    assert inside.wait(HANG_GUARD_S)
    adapter.close()  # gives up waiting for the held call
    assert adapter.stats()["close_calls_left_running"] == 1
    assert "enter close" not in events, "the client was closed under a running call"
    with pytest.raises(MooncakeUnavailable), connection.leased():  # a call after close is refused
        pass
    assert "enter close" not in events, "a refused call closed the client under the held one"

    release.set()
    calling.join(HANG_GUARD_S)
    eventually(lambda: "leave close" in events, what="the client closed once the call ended")
    eventually(lambda: adapter.stats().get("close_completed_late") == 1, what="the late close counted")
    assert events.count("enter close") == 1


def test_closing_against_a_stopped_master_takes_the_adapters_timeouts_not_mooncakes(
    own_cluster: LocalCluster,
) -> None:
    # Mooncake's close unregisters the client at the metadata server with a fixed 3 s HTTP
    # timeout per request, three of them, and its binding holds the GIL meanwhile: a
    # close thread joined for operation_timeout_s cannot end that wait, so a server's
    # stop took about 10 s whatever the adapter's timeout.
    timeout_s = 0.5
    own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=timeout_s))
    client = BlockingAdapterClient(adapter, timeout=60)
    master = own_cluster.master
    assert master is not None
    _first_round_trip(client)
    master.send_signal(signal.SIGSTOP)
    wait_stopped(master.pid, HANG_GUARD_S)
    try:
        adapter.close()
    finally:
        master.send_signal(signal.SIGCONT)
    # Structural, not timed: the client whose close would have waited out Mooncake's own
    # timeouts was kept unclosed, so the stop never entered that wait.
    assert adapter.stats()["close_left_unclosed"] == 1, adapter.stats()
    # The master answers again: the client left unclosed is closed after all.
    eventually(
        lambda: adapter.stats().get("unclosed_clients_closed_later") == 1,
        timeout=HANG_GUARD_S,
        what="the unclosed client closed once the master answers",
    )


@contextlib.contextmanager
def _master_silent(
    cluster: LocalCluster,
) -> Iterator[tuple[BackendAdapter, BlockingAdapterClient, list[ObjectKey]]]:
    """An adapter (``operation_timeout_s`` 0.25), a client, and two keys it stored, the
    master killed since and failed a call; closed once the given-up probes ended."""
    cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(cluster, operation_timeout_s=0.25))
    client = BlockingAdapterClient(adapter, timeout=60)
    try:
        _first_round_trip(client)
        stored = make_keys(2, start=0)
        cluster.kill_master()
        # The first call finds the master's connection closed: it fails at once.
        assert client.lookup_and_lock(stored).found == [False, False]
        yield adapter, client, stored
        # A given-up probe ends with Mooncake's ~4 s retries, longer than the close waits
        # for it (3 x 0.25 s): the test lets it end, so the close closes the client.
        calls = backend_of(adapter).calls
        eventually(lambda: calls.busy == 0, timeout=HANG_GUARD_S, what="the given-up probes ending")
    finally:
        adapter.close()


def test_calls_against_a_killed_master_end_at_the_adapters_timeout_not_mooncakes_reconnect(
    own_cluster: LocalCluster,
) -> None:
    # Once the master failed a call, every later call of Mooncake's client retries the
    # connection for about 4 s whatever its RPC timeout: the adapter probes first, bounded
    # by operation_timeout_s, and refuses the call when the probe is not answered.
    with _master_silent(own_cluster) as (adapter, client, stored):
        assert client.lookup_and_lock(stored).found == [False, False]
        assert client.store(make_keys(1, start=50), [memoryview(b"x" * SIZE)]) == [False]
        # Structural, not timed: both calls were refused before entering Mooncake, whose
        # reconnect would have held each for seconds; the probe alone went in.
        assert adapter.stats()["calls_refused_master_silent"] == 2, adapter.stats()


def test_concurrent_calls_to_a_silent_master_leave_one_probe_inside_mooncake(
    own_cluster: LocalCluster,
) -> None:
    # Each call to a silent master is preceded by a probe that, given up at the deadline,
    # stays inside Mooncake's ~4 s reconnect: one per concurrent call would fill the
    # deadline pool (deletes and the circuit's probes wait behind them) and leave daemon
    # threads inside Mooncake.  While one probe is unanswered, the others wait for it up to
    # the timeout and are refused.
    callers = 6
    with _master_silent(own_cluster) as (adapter, _, stored):
        backend = backend_of(adapter)
        errors: list[BaseException] = []

        def look_up() -> None:
            try:
                backend.contains_many(stored)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=look_up) for _ in range(callers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(HANG_GUARD_S)
        assert len(errors) == callers, errors
        assert adapter.stats()["calls_refused_master_silent"] == callers, adapter.stats()
        # Structural: Mooncake keeps the one probe for seconds, the refusals came at once.
        assert backend.calls.busy <= 1, backend.calls.busy


def test_calls_made_as_a_frozen_master_resumes_are_served_not_refused(
    own_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A probe given up while the master was frozen is still inside Mooncake when the
    # master resumes; the calls made then wait for it (and probe again) instead of being
    # refused because an earlier probe had not come back: hits resume with the master.
    # Mooncake's RPC timeout set by the operator, longer than operation_timeout_s: with
    # the two equal (the adapter's own setting) Mooncake ended the frozen probe as the
    # adapter gave it up, and on a loaded machine none was left inside to resume with.
    monkeypatch.setattr(client_module, "_OPERATOR_SET", frozenset({"MC_RPC_TIMEOUT_MS"}))
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", str(FROZEN_PROBE_RPC_TIMEOUT_MS))
    own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=0.5))
    client = BlockingAdapterClient(adapter, timeout=60)
    master = own_cluster.master
    assert master is not None
    try:
        _first_round_trip(client)
        stored = make_keys(2, start=0)
        backend = backend_of(adapter)
        master.send_signal(signal.SIGSTOP)
        wait_stopped(master.pid, HANG_GUARD_S)
        try:
            # The first fails unanswered (after Mooncake's RPC timeout), the second's probe
            # is given up after operation_timeout_s and stays inside Mooncake.
            for _ in range(2):
                with contextlib.suppress(Exception):
                    backend.contains_many(stored)
            assert backend.calls.busy >= 1, "no given-up call left inside Mooncake"
        finally:
            master.send_signal(signal.SIGCONT)
        assert [size is not None for size in backend.contains_many(stored)] == [True, True]
        eventually(lambda: backend.calls.busy == 0, timeout=HANG_GUARD_S, what="the given-up calls ending")
    finally:
        adapter.close()


def test_probes_of_a_master_hung_for_good_hold_at_most_two_pool_threads(
    own_cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A probe stuck past _PROBE_ALONE_S lets one more through (a probe stuck for good must
    # not keep the circuit open for good), but a master hung for good keeps that one too:
    # a new probe every _PROBE_ALONE_S would take one more deadline-pool thread each time.
    monkeypatch.setattr(backend_module, "_PROBE_ALONE_S", 0.3)
    # Mooncake's RPC timeout set long by the operator: a probe stays inside while the
    # master is hung (the operator's value wins over operation_timeout_s).
    monkeypatch.setattr(client_module, "_OPERATOR_SET", frozenset({"MC_RPC_TIMEOUT_MS"}))
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", "60000")
    own_cluster.add_segment_host("64MB")
    adapter = open_adapter(config_for(own_cluster, operation_timeout_s=0.25))
    backend = backend_of(adapter)
    master = own_cluster.master
    assert master is not None
    try:
        assert _round_trip(BlockingAdapterClient(adapter, timeout=60), 0)
        master.send_signal(signal.SIGSTOP)
        wait_stopped(master.pid, HANG_GUARD_S)
        try:
            for _ in range(5):
                with contextlib.suppress(TiersError):
                    backend.ping()
                time.sleep(0.35)  # past the (shortened) _PROBE_ALONE_S: the running probe is "stuck"
            # Structural: the master never answered, so every probe let through is still inside.
            assert backend.calls.busy <= 2, backend.calls.busy
            assert adapter.stats().get("probes_refused_stuck", 0) >= 1, adapter.stats()
        finally:
            master.send_signal(signal.SIGCONT)
        eventually(lambda: backend.calls.busy == 0, timeout=HANG_GUARD_S, what="the given-up probes ending")
    finally:
        adapter.close()


def test_the_master_query_before_a_close_names_its_adapter_when_it_fails(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A client that cannot be queried at all (None has no batch_is_exist): the failure is
    # logged under the adapter's name, as every other line of the close is.
    with caplog.at_level(logging.DEBUG, logger=client_module.__name__):
        assert client_module._query_master(None, "7:mooncake_store") == []
    assert any(
        "7:mooncake_store" in record.getMessage() and "master probe before close" in record.getMessage()
        for record in caplog.records
    ), [record.getMessage() for record in caplog.records]
