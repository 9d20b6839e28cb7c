"""A request whose server dies while it waits fails at once, not at its timeout; a
server that is only slow still answers it; the client goes on with a restarted server."""

from __future__ import annotations

import contextlib
import os
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from tiers_e2e import ServerProcess, fetch, make_keys, make_payloads, start_server

from lmcache_tiers.client import Client, ConnectionLostError, RequestTimeoutError, connection
from lmcache_tiers.testing.processes import freeze

#: far beyond anything these tests wait for: a call that reaches it was not ended early
CLIENT_TIMEOUT_S = 120.0
CHUNK = 64 << 10


def _lookup_in_thread(client: Client, keys: list[Any]) -> tuple[threading.Thread, dict[str, Any]]:
    outcome: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            outcome["hits"] = client.lookup(keys)
        except BaseException as exc:
            outcome["error"] = exc
        outcome["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def _lookup_over_a_pause(client: Client, keys: list[Any], server: ServerProcess) -> dict[str, Any]:
    """A LOOKUP sent to ``server`` while it is frozen for several of the client's looks at
    its connection, which all find it up; the outcome once the server has answered."""
    freeze(server.proc.pid)
    thread, outcome = _lookup_in_thread(client, keys)
    time.sleep(1.5)  # six times the client's look at its connection
    os.kill(server.proc.pid, signal.SIGCONT)
    thread.join(CLIENT_TIMEOUT_S)
    return outcome


def _stored(server: ServerProcess, tag: str, count: int) -> tuple[Client, list[Any]]:
    client = Client(server.url, timeout=CLIENT_TIMEOUT_S)
    keys = make_keys(tag, count)
    assert client.store(keys, make_payloads(tag, count, CHUNK)) == count
    client.release(keys)  # nothing of this client's is held when the server goes away
    return client, keys


def test_a_request_whose_server_dies_fails_at_once_as_a_lost_connection(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server")
    client, keys = _stored(server, "dies", 4)
    try:
        freeze(server.proc.pid)  # the LOOKUP is sent and never answered
        thread, outcome = _lookup_in_thread(client, keys)
        time.sleep(1.0)  # several looks at the connection, all finding it up
        assert thread.is_alive(), outcome
        server.stop(signal.SIGKILL)
        thread.join(CLIENT_TIMEOUT_S)
        error = outcome.get("error")
        assert isinstance(error, ConnectionLostError), outcome
        assert isinstance(error, RequestTimeoutError)  # handled wherever a timeout is
        assert "connection to" in str(error) and "Lookup" in str(error)
        assert outcome["seconds"] < CLIENT_TIMEOUT_S / 2, outcome
    finally:
        server.stop(signal.SIGKILL)
        client.close()


def test_a_server_that_is_only_slow_still_answers(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server")
    client, keys = _stored(server, "slow", 4)
    try:
        outcome = _lookup_over_a_pause(client, keys, server)
        assert outcome.get("hits") == 4, outcome
        client.release(keys)
    finally:
        client.close()
        assert server.stop() == 0, server.output()


def test_the_client_goes_on_with_a_server_restarted_at_its_address(tmp_path: Path) -> None:
    first = start_server(tmp_path / "first")
    client, keys = _stored(first, "restart", 2)
    port = int(first.url.rsplit(":", 1)[1])
    try:
        freeze(first.proc.pid)
        thread, outcome = _lookup_in_thread(client, keys)
        time.sleep(0.5)
        first.stop(signal.SIGKILL)
        thread.join(CLIENT_TIMEOUT_S)
        assert isinstance(outcome.get("error"), ConnectionLostError), outcome
        second = start_server(tmp_path / "second", port=port)
        try:
            deadline = time.monotonic() + 60
            while True:  # the socket reconnects by itself, within its reconnect interval
                try:
                    assert client.lookup(keys, timeout=2) == 0  # a new, empty server
                    break
                except RequestTimeoutError:
                    assert time.monotonic() < deadline, "the client never reached the restarted server"
            fresh = make_payloads("restart-again", 2, CHUNK)
            assert client.store(keys, fresh) == 2
            with client.retrieve(keys) as views:
                assert [bytes(view) for view in views] == [bytes(payload) for payload in fresh]
        finally:
            client.close()
            assert second.stop() == 0, second.output()
    finally:
        first.stop(signal.SIGKILL)
        client.close()


@pytest.fixture
def short_directory() -> Iterator[Path]:
    """A directory for ipc sockets: their paths are limited to about 100 bytes."""
    with tempfile.TemporaryDirectory(prefix="tiers-", dir="/tmp") as name:
        yield Path(name)


@contextlib.contextmanager
def _address_taken_over(
    tmp_path: Path, directory: Path, tag: str, *, second_metrics: bool
) -> Iterator[tuple[ServerProcess, ServerProcess, Client, list[Any]]]:
    """A client connected to a first server, which keeps that connection while a second
    server takes its ipc address; the first is frozen, so a request sent now goes over the
    first connection, unanswered, and killing the first makes the socket reconnect, to the
    second.  Yields (first, second, client, keys stored on the first)."""
    address = directory / "rpc.sock"
    first = start_server(tmp_path / "first", metrics=False, host=f"ipc://{address}")
    client, keys = _stored(first, tag, 2)
    second: ServerProcess | None = None
    try:
        address.rename(directory / "first.sock")
        second = start_server(tmp_path / "second", metrics=second_metrics, host=f"ipc://{address}")
        freeze(first.proc.pid)
        yield first, second, client, keys
    finally:
        first.stop(signal.SIGKILL)
        client.close()
        if second is not None:
            assert second.stop() == 0, second.output()


def test_a_request_whose_server_restarts_between_two_looks_fails_at_once(
    tmp_path: Path, short_directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection a request went over drops, and the socket reconnects to a server
    restarted at the address, before the client looks at its connection again: the reply
    would go to the connection that dropped, so it cannot come.  The call fails at that
    look, not at its timeout, and the next call is served by the new server."""
    # Looks far apart, so that the drop and the new connection both fall between two.
    monkeypatch.setattr(connection, "LINK_CHECK_S", 5.0)
    with _address_taken_over(tmp_path, short_directory, "restart-quick", second_metrics=False) as taken_over:
        first, _, client, keys = taken_over
        thread, outcome = _lookup_in_thread(client, keys)
        time.sleep(0.5)
        first.stop(signal.SIGKILL)  # the client reconnects, to the second server
        thread.join(CLIENT_TIMEOUT_S)
        assert isinstance(outcome.get("error"), ConnectionLostError), outcome
        assert outcome["seconds"] < CLIENT_TIMEOUT_S / 2, outcome
        assert client.lookup(keys, timeout=30) == 0  # the new, empty server answers
        fresh = make_payloads("restart-quick-again", 2, CHUNK)
        assert client.store(keys, fresh) == 2
        with client.retrieve(keys) as views:
            assert [bytes(view) for view in views] == [bytes(payload) for payload in fresh]


def test_a_request_sent_after_a_restart_is_waited_for_however_slow_the_new_server(tmp_path: Path) -> None:
    """A drop that came before a request was sent (the server restarted while the client
    was idle) does not end that request's wait: it went over the new connection."""
    first = start_server(tmp_path / "first")
    client, keys = _stored(first, "restart-idle", 2)
    port = int(first.url.rsplit(":", 1)[1])
    try:
        assert first.stop() == 0, first.output()
        second = start_server(tmp_path / "second", port=port)
        try:
            # The socket reconnects by itself within its reconnect interval; the drop and
            # the new connection are not looked at before the next request is sent.
            deadline = time.monotonic() + 60
            while not _connected(second, port):
                assert time.monotonic() < deadline, "the client never reconnected to the new server"
                time.sleep(0.05)
            outcome = _lookup_over_a_pause(client, keys, second)
            assert outcome.get("hits") == 0, outcome
        finally:
            client.close()
            assert second.stop() == 0, second.output()
    finally:
        client.close()


def _connected(server: ServerProcess, port: int) -> bool:
    """Whether a client's connection to ``port`` is established at ``server`` (seen from
    outside the client: asking it would look at its connection)."""
    return any(
        link.status == psutil.CONN_ESTABLISHED and link.laddr.port == port
        for link in psutil.Process(server.proc.pid).net_connections("tcp")
    )


def test_a_server_silent_past_the_heartbeat_timeout_is_taken_as_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped process answers no heartbeat, like a host that is down or cut off: its
    connection stays open in the kernel, and only the silence tells."""
    # This client's heartbeats: the same silence is told in 2 s instead of the default 10 s.
    monkeypatch.setattr(connection, "HEARTBEAT_INTERVAL_MS", 500)
    monkeypatch.setattr(connection, "HEARTBEAT_TIMEOUT_MS", 2_000)
    server = start_server(tmp_path / "server")
    client, keys = _stored(server, "silent", 2)
    try:
        freeze(server.proc.pid)
        thread, outcome = _lookup_in_thread(client, keys)
        thread.join(CLIENT_TIMEOUT_S)
        assert isinstance(outcome.get("error"), ConnectionLostError), outcome
        assert outcome["seconds"] >= connection.HEARTBEAT_TIMEOUT_MS / 1000 / 2, outcome
        assert outcome["seconds"] < CLIENT_TIMEOUT_S / 2, outcome
    finally:
        server.stop(signal.SIGKILL)
        client.close()


def test_an_inline_store_given_up_on_never_stores_the_bytes_its_buffers_hold_later(tmp_path: Path) -> None:
    """A caller told its store timed out reuses its buffers: what the server eventually
    reads of a request still queued must be the bytes the buffers held when it was made."""
    server = start_server(tmp_path / "server")
    client = Client(server.url, timeout=1.0, shm=False)
    keys = make_keys("late-store", 4)
    payloads = make_payloads("late-store", 4, 16 << 20)  # far beyond the socket buffers
    original = [bytes(payload) for payload in payloads]
    try:
        freeze(server.proc.pid)
        try:
            client.store(keys, payloads)
        except RequestTimeoutError:
            pass
        for payload in payloads:
            payload[:] = 0xEE  # the caller's next use of its buffers
        os.kill(server.proc.pid, signal.SIGCONT)
        client.timeout = CLIENT_TIMEOUT_S
        client.lookup(keys)
        with client.retrieve(keys) as views:
            for view, expected in zip(views, original, strict=False):
                assert bytes(view) == expected
    finally:
        client.close()
        server.stop(signal.SIGKILL)


def test_a_lost_connection_sends_no_give_back_over_the_next_one(
    tmp_path: Path, short_directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A RETRIEVE whose connection drops fails; the locks it meant to give back belong to
    the session of the connection that dropped (the server keeps sessions per connection),
    so a RELEASE by key over the next connection cannot reach them: it could only drop a
    lock another thread of this client took since, in the new session.  None is sent; the
    old locks expire with the lock TTL, and the log says so."""
    monkeypatch.setattr(connection, "LINK_CHECK_S", 5.0)  # the socket reconnects before the look
    with _address_taken_over(tmp_path, short_directory, "give-back", second_metrics=True) as taken_over:
        first, second, client, keys = taken_over
        outcome: dict[str, Any] = {}

        def retrieve() -> None:
            try:
                with client.retrieve(keys):
                    pass
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=retrieve, daemon=True)
        with caplog.at_level("INFO", logger="lmcache_tiers.client"):
            thread.start()
            time.sleep(0.5)
            first.stop(signal.SIGKILL)  # the client reconnects, to the second server
            thread.join(CLIENT_TIMEOUT_S)
        assert isinstance(outcome.get("error"), ConnectionLostError), outcome
        client.ping(timeout=30)  # over the new connection, after anything sent before it
        assert second.http_url is not None
        _, _, text = fetch(second.http_url + "/metrics")
        assert "Release" not in _ops_served(text), text
        assert "expire with the server's lock TTL" in caplog.text


def _ops_served(metrics_text: str) -> set[str]:
    return {
        line.split('op="', 1)[1].split('"', 1)[0]
        for line in metrics_text.splitlines()
        if line.startswith("lmcache_tiers_requests_total{")
    }


def test_a_retrieve_block_whose_connection_dropped_sends_no_release_over_the_next_one(
    tmp_path: Path, short_directory: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The server restarts at the address while a retrieve block is open: its locks went
    with the first server's session, and leaving the block normally sends no RELEASE by key
    over the next connection, where it could only drop locks another thread of this client
    took since.  The log says the old locks expire with the lock TTL."""
    address = short_directory / "rpc.sock"
    first = start_server(tmp_path / "first", metrics=False, host=f"ipc://{address}")
    client, keys = _stored(first, "block-over-restart", 2)
    second: ServerProcess | None = None
    try:
        with caplog.at_level("INFO", logger="lmcache_tiers.client"), client.retrieve(keys) as views:
            assert len(views) == 2
            address.rename(short_directory / "first.sock")
            second = start_server(tmp_path / "second", metrics=True, host=f"ipc://{address}")
            first.stop(signal.SIGKILL)  # the client reconnects, to the second server
            deadline = time.monotonic() + CLIENT_TIMEOUT_S
            while _server_pid(client) != second.proc.pid:
                assert time.monotonic() < deadline, "the client never reached the second server"
                time.sleep(0.05)
        client.ping(timeout=30)  # after anything leaving the block sent
        assert second.http_url is not None
        _, _, text = fetch(second.http_url + "/metrics")
        assert "Release" not in _ops_served(text), text
        assert "expire with the server's lock TTL" in caplog.text
    finally:
        first.stop(signal.SIGKILL)
        client.close()
        if second is not None:
            assert second.stop() == 0, second.output()


def _server_pid(client: Client) -> int | None:
    """The pid of the server answering now; None while none does."""
    try:
        pid: int = client.status()["server"]["pid"]
    except RequestTimeoutError:  # a lost connection too
        return None
    return pid
