"""A call interrupted while it waits for its reply (a signal handler raising, Ctrl-C in a
notebook) is given up on like one that timed out: what its late reply took on the
client's behalf is given back when that reply arrives, not held until the server's TTL."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import msgspec
import pytest
from tiers_e2e import ServerProcess, fetch, make_keys, make_payloads, metric

from lmcache_tiers.client import Client, ClientError, RequestTimeoutError
from lmcache_tiers.testing.processes import freeze
from lmcache_tiers.wire.protocol import Release

# Each test gets the ``server`` fixture (conftest.py): started on loopback, and stopped and
# checked (exit status 0, no L1 segment left) once the test's clients are closed.

CLIENT_TIMEOUT_S = 120.0


class _Interrupted(Exception):
    """What the test's signal handler raises in the middle of a call."""


@pytest.fixture
def interrupting_signal() -> Iterator[signal.Signals]:
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGUSR1, interrupt)
    try:
        yield signal.SIGUSR1
    finally:
        signal.signal(signal.SIGUSR1, previous)


class _Interruption:
    """The test's interruption of this process, sent again when it was dropped: a handler's
    exception raised while a destructor runs (a ZeroMQ frame's, freed as the call waits) is
    printed and ignored, not raised in the call, which would wait on for its reply."""

    def __init__(self, signum: signal.Signals) -> None:
        self.signum, self.raised, self.dropped = signum, 0, 0

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        interrupt, hook = signal.getsignal(self.signum), sys.unraisablehook

        def count_then_interrupt(signum: int, frame: FrameType | None) -> None:
            self.raised += 1
            assert callable(interrupt)
            interrupt(signum, frame)

        def send_again_if_dropped(unraisable: Any) -> None:
            if isinstance(unraisable.exc_value, _Interrupted):
                self.dropped += 1
                os.kill(os.getpid(), self.signum)
            else:
                hook(unraisable)

        signal.signal(self.signum, count_then_interrupt)
        sys.unraisablehook = send_again_if_dropped
        try:
            yield
        finally:
            signal.signal(self.signum, interrupt)
            sys.unraisablehook = hook

    def went_through(self) -> bool:
        """Whether an interruption was raised and not dropped (so far: a dropped one is
        reported right after its handler ran)."""
        return self.raised > self.dropped


@contextlib.contextmanager
def _interrupted_while_frozen(server_pid: int, signum: signal.Signals) -> Iterator[None]:
    """Freeze the server, so that the block's call is sent and answered only after the
    interruption; interrupt this process in the middle of that call, and let the server
    go on once the interruption went through (the call's clean-up may wait for the
    server's answer)."""
    interruption = _Interruption(signum)
    ended = threading.Event()

    def resume_once_interrupted() -> None:
        deadline = time.monotonic() + 60  # a bound against hangs only
        while not ended.is_set() and time.monotonic() < deadline:
            if interruption.went_through():
                ended.wait(0.2)  # a dropped interruption would have been reported by now
                if interruption.went_through():
                    break
            ended.wait(0.01)
        os.kill(server_pid, signal.SIGCONT)

    with interruption.armed():
        freeze(server_pid)
        threads = [
            threading.Timer(0.5, os.kill, (os.getpid(), signum)),
            threading.Thread(target=resume_once_interrupted),
        ]
        for thread in threads:
            thread.start()
        try:
            yield
        finally:
            ended.set()  # a block that ended without the interruption fails as it is
            for thread in threads:
                thread.join()
            os.kill(server_pid, signal.SIGCONT)


def _server_status_once_settled(client: Client) -> dict[str, Any]:
    """The server's status once the late reply of a call given up on has been read, and
    what the client sent on reading it (a RELEASE, a STORE_ABORT) has been handled: the
    late reply arrives before the first PING's, and what it made the client send goes out
    before the second PING."""
    client.ping()
    client.ping()
    server_status: dict[str, Any] = client.status()["server"]
    return server_status


def test_the_locks_of_an_interrupted_lookup_are_given_back_when_its_reply_lands(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    keys = make_keys("interrupted", 4)
    with Client(server.url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.store(keys, make_payloads("interrupted", 4, 64 << 10)) == 4
        client.release(keys)
        with _interrupted_while_frozen(server.proc.pid, interrupting_signal), pytest.raises(_Interrupted):
            client.lookup(keys)
        # The late reply carries 4 hits, locked for this client.
        assert _server_status_once_settled(client)["locked_keys"] == 0
        # The calls after the interruption are not slowed or confused by it.
        assert not client._outstanding and not client._early
        assert client.lookup(keys) == 4
        client.release(keys)


def test_a_late_lookup_reply_from_a_server_without_release_once_leaves_the_locks_held(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    """A server of an earlier release (28c5b5b) decodes RELEASE's ``once`` as absent and
    drops every lock this client holds on the keys, a retrieve's whose views are in use
    among them: the late reply's locks are left to the lock TTL instead.  The server here
    is this release's, greeted as an earlier one announces itself (no ``release_once``),
    so the locks it still holds show what the client sent."""
    keys = make_keys("no-release-once", 4)
    with Client(server.url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.store(keys, make_payloads("no-release-once", 4, 64 << 10)) == 4
        client.release(keys)
        earlier = [feature for feature in client.server.features if feature != "release_once"]
        client.server = msgspec.structs.replace(client.server, features=earlier)
        with _interrupted_while_frozen(server.proc.pid, interrupting_signal), pytest.raises(_Interrupted):
            client.lookup(keys)
        assert _server_status_once_settled(client)["locked_keys"] == 4
        client.release(keys)
        assert client.status()["server"]["locked_keys"] == 0


@pytest.mark.parametrize(
    ("count", "interrupted_frame", "sent", "stored", "refusal"),
    [
        # the header and 1 of 2 payloads out: a PING's header would make the count match
        (2, 1, False, 0, "invalid_argument"),
        # 2 of 3 payloads out, the message still open
        (3, 1, True, 0, "invalid_argument"),
        # the last frame went out before the interruption: the message was whole, and the
        # empty frame that would have ended it is a message of its own
        (2, 1, True, 2, "malformed"),
    ],
    ids=["before-last-frame", "after-a-middle-frame", "after-the-last-frame"],
)
def test_a_store_interrupted_between_its_frames_never_stores_the_next_request(
    server: ServerProcess, count: int, interrupted_frame: int, sent: bool, stored: int, refusal: str
) -> None:
    """Ctrl-C between two frames of a STORE_INLINE must not leave the message open: ZeroMQ
    would append the next request's frames to it, and with the counts matching the server
    would store that request's header as an object."""
    keys = make_keys(f"cut-{count}-{sent}", count)
    # Plain bytes (no tensor layout), so the server has no size to hold a frame against.
    payloads = [array.tobytes() for array in make_payloads(f"cut-{count}-{sent}", count, 4 << 10)]
    with (
        Client(server.url, timeout=CLIENT_TIMEOUT_S, shm=False) as client,
        Client(server.url, timeout=CLIENT_TIMEOUT_S, shm=False) as checker,
    ):
        frames_seen = 0
        real_send = client._socket.send

        def send_then_interrupt(data: Any, flags: int = 0, **kwargs: Any) -> Any:
            # Only the payload frames go through here (the header is sent by the raw method).
            nonlocal frames_seen
            frames_seen += 1
            if frames_seen - 1 == interrupted_frame:
                if sent:
                    real_send(data, flags, **kwargs)
                raise KeyboardInterrupt
            return real_send(data, flags, **kwargs)

        client._socket.send = send_then_interrupt  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                client.store(keys, payloads)
        finally:
            del client._socket.send
        # The next request goes in a message of its own (not into the store's, where it
        # would be stored, and never answered).
        try:
            client.ping(timeout=10)
            answered = True
        except RequestTimeoutError:
            answered = False
        hits = checker.lookup(keys)
        with checker.retrieve(keys[:hits]) as views:
            for view, payload in zip(views, payloads, strict=False):
                assert bytes(view) == payload, "an object was stored with wrong bytes"
        assert answered
        assert hits == stored
        # What the server refused is counted.
        assert server.http_url is not None
        text = fetch(server.http_url + "/metrics")[2]
        assert metric(text, "lmcache_tiers_failures_total", f'reason="{refusal}"') == 1
        # A store after the interruption goes through whole.
        checker.evict(keys)
        assert client.store(keys, payloads) == count
        assert not client._outstanding and not client._early


def test_leaving_a_retrieve_block_of_a_client_closed_meanwhile_does_not_raise(server: ServerProcess) -> None:
    """Another thread closes the client while a ``retrieve`` block is open, right before
    the block's RELEASE: the locks expire on the server; leaving the block is no error."""
    keys = make_keys("closed-under", 2)
    with Client(server.url, timeout=CLIENT_TIMEOUT_S) as client:
        real_release = client.release

        def close_then_release(keys: Any) -> int:
            client.close()  # what another thread's close does, landing in this window
            return real_release(keys)

        assert client.store(keys, make_payloads("closed-under", 2, 4 << 10)) == 2
        with client.retrieve(keys) as views:
            assert len(views) == 2
            client.release = close_then_release  # type: ignore[method-assign]
        with pytest.raises(ClientError, match="closed"):
            client.ping()


def test_an_interrupted_retrieve_gives_its_locks_back_and_not_those_of_a_later_lookup(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    keys = make_keys("interrupted-retrieve", 4)
    with Client(server.url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.store(keys, make_payloads("interrupted-retrieve", 4, 64 << 10)) == 4
        assert client.lookup(keys) == 4
        with (
            _interrupted_while_frozen(server.proc.pid, interrupting_signal),
            pytest.raises(_Interrupted),
            client.retrieve(keys),
        ):
            pytest.fail("the retrieve block was entered")
        assert _server_status_once_settled(client)["locked_keys"] == 0
        # A later lookup's locks are its own: nothing the interrupted call left drops them.
        assert client.lookup(keys) == 4
        assert _server_status_once_settled(client)["locked_keys"] == 4
        assert not client._outstanding and not client._early
        client.release(keys)


def test_the_reservations_of_an_interrupted_store_are_aborted_when_its_reply_lands(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    keys = make_keys("interrupted-store", 4)
    payloads = make_payloads("interrupted-store", 4, 64 << 10)
    with Client(server.url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.uses_shm
        with _interrupted_while_frozen(server.proc.pid, interrupting_signal), pytest.raises(_Interrupted):
            client.store(keys, payloads)
        assert _server_status_once_settled(client)["in_flight"]["stores"] == 0
        assert client.lookup(keys) == 0  # nothing was committed
        assert client.store(keys, payloads) == 4
        assert not client._outstanding and not client._early


#: how long the tests below keep a server frozen at most: well past their clean-up bound,
#: and short of the client's heartbeat timeout (10 s), which would end the wait by itself
FROZEN_S = 8.0


@contextlib.contextmanager
def _frozen_for_a_while(server_pid: int, signum: signal.Signals) -> Iterator[threading.Event]:
    """Freeze the server, interrupt this process in the middle of the block's call, and
    let the server go on only ``FROZEN_S`` later; the event yielded is set then, so the
    block can tell whether what it did ended while the server was still frozen."""
    resumed = threading.Event()

    def resume() -> None:
        os.kill(server_pid, signal.SIGCONT)
        resumed.set()

    with _Interruption(signum).armed():
        freeze(server_pid)
        timers = [threading.Timer(0.5, os.kill, (os.getpid(), signum)), threading.Timer(FROZEN_S, resume)]
        for timer in timers:
            timer.start()
        try:
            yield resumed
        finally:
            for timer in timers:
                timer.cancel()
                timer.join()
            resume()


def test_the_release_after_an_interrupted_retrieve_waits_the_clean_up_bound_not_the_timeout(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    """The RELEASE a cut-short RETRIEVE sends faces a server that did not answer: it waits
    the client's clean-up bound, not its whole (here hour-long) timeout."""
    keys = make_keys("cleanup-retrieve", 2)
    with Client(server.url, timeout=3600.0, cleanup_timeout=0.5) as client:
        assert client.store(keys, make_payloads("cleanup-retrieve", 2, 4 << 10)) == 2
        with _frozen_for_a_while(server.proc.pid, interrupting_signal) as resumed:
            with pytest.raises(_Interrupted), client.retrieve(keys):
                pytest.fail("the retrieve block was entered")
            assert not resumed.is_set(), "the clean-up RELEASE waited for the frozen server"
        # Whatever the cut-short calls locked is given back once the server answers.
        assert _server_status_once_settled(client)["locked_keys"] == 0


def test_the_abort_after_an_interrupted_store_waits_the_clean_up_bound_not_the_timeout(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    """A STORE cut short after its reservation (here while it copies into the segment)
    sends STORE_ABORT, which waits the clean-up bound for a server that does not answer."""
    keys = make_keys("cleanup-store", 2)
    payloads = make_payloads("cleanup-store", 2, 4 << 10)
    resumed = threading.Event()

    def resume() -> None:
        os.kill(server.proc.pid, signal.SIGCONT)
        resumed.set()

    resume_later = threading.Timer(FROZEN_S, resume)

    def freeze_then_interrupt(*args: Any, **kwargs: Any) -> None:
        freeze(server.proc.pid)
        resume_later.start()
        raise _Interrupted

    with Client(server.url, timeout=3600.0, cleanup_timeout=0.5) as client:
        assert client.uses_shm
        segment = client._segment
        assert segment is not None
        try:
            segment.write_many = freeze_then_interrupt  # type: ignore[method-assign]
            try:
                with pytest.raises(_Interrupted):
                    client.store(keys, payloads)
            finally:
                del segment.write_many
            assert not resumed.is_set(), "the clean-up STORE_ABORT waited for the frozen server"
            resume_later.cancel()
            resume()  # the abort was given up on: it is handled once the server goes on
            assert _server_status_once_settled(client)["in_flight"]["stores"] == 0
            assert client.store(keys, payloads) == 2
        finally:
            # The server goes on before the client closes, whatever failed above.
            resume_later.cancel()
            os.kill(server.proc.pid, signal.SIGCONT)


def test_close_gives_back_the_locks_of_an_interrupted_lookup_whose_reply_is_late(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    """A client closed right after a LOOKUP was interrupted reads that LOOKUP's late reply
    before it goes, and releases the read locks it carries: they do not stay until the
    server's lock TTL."""
    keys = make_keys("close-settles", 4)
    with (
        # A generous clean-up bound: close may wait for the frozen server to go on.
        Client(server.url, timeout=CLIENT_TIMEOUT_S, cleanup_timeout=CLIENT_TIMEOUT_S) as client,
        Client(server.url, timeout=CLIENT_TIMEOUT_S) as checker,
    ):
        assert client.store(keys, make_payloads("close-settles", 4, 64 << 10)) == 4
        client.release(keys)
        with _interrupted_while_frozen(server.proc.pid, interrupting_signal):
            with pytest.raises(_Interrupted):
                client.lookup(keys)
            client.close()
        assert checker.status()["server"]["locked_keys"] == 0


def test_close_with_a_late_reply_from_a_frozen_server_ends_within_the_clean_up_bound(
    server: ServerProcess, interrupting_signal: signal.Signals, caplog: pytest.LogCaptureFixture
) -> None:
    """The server never answers while the client closes: close gives up after its clean-up
    bound, says so in the log, and the locks expire on the server."""
    keys = make_keys("close-frozen", 2)
    with Client(server.url, timeout=3600.0, cleanup_timeout=0.5) as client:
        assert client.store(keys, make_payloads("close-frozen", 2, 4 << 10)) == 2
        client.release(keys)
        with _frozen_for_a_while(server.proc.pid, interrupting_signal) as resumed:
            with pytest.raises(_Interrupted):
                client.lookup(keys)
            client.close()
            assert not resumed.is_set(), "close waited for the frozen server"
        assert "1 request given up on still unanswered" in caplog.text


#: releases of keys nobody holds, each of max_keys keys (about 0.5 MB), sent to a frozen
#: server: more than the loopback socket buffers take, so what follows stays in ZeroMQ's pipe
JUNK_RELEASES = 120


def test_close_right_after_a_release_sent_without_waiting_makes_sure_it_reached_the_server(
    server: ServerProcess,
) -> None:
    """A RELEASE sent without waiting for its reply (after a timeout), then ``close`` at
    once: the socket closes without lingering, which drops what ZeroMQ has not written out
    yet.  Close makes sure the release reached the server (a PING answered after it)
    before the socket goes, so the locks do not stay until the server's TTL."""
    keys = make_keys("forget-then-close", 4)
    with (
        # A generous clean-up bound: close waits for the frozen server to go on (1 s).
        Client(server.url, timeout=CLIENT_TIMEOUT_S, cleanup_timeout=CLIENT_TIMEOUT_S) as client,
        Client(server.url, timeout=CLIENT_TIMEOUT_S) as checker,
    ):
        junk = make_keys("forget-then-close-junk", client.max_keys)
        assert client.store(keys, make_payloads("forget-then-close", 4, 4 << 10)) == 4
        assert client.lookup(keys) == 4  # read locks held for this client
        freeze(server.proc.pid)
        resume = threading.Timer(1.0, os.kill, (server.proc.pid, signal.SIGCONT))
        resume.start()
        try:
            for _ in range(JUNK_RELEASES):
                client._send_and_forget(Release(0, "", junk))
            client._send_and_forget(Release(0, "", keys))
            client.close()
        finally:
            resume.join()
            os.kill(server.proc.pid, signal.SIGCONT)
        assert checker.status()["server"]["locked_keys"] == 0


def test_a_release_that_runs_out_of_time_still_sends_its_other_batches(server: ServerProcess) -> None:
    """``release(keys, timeout=...)`` split into several requests whose time runs out on
    the first (a frozen server): the other batches go out without waiting rather than not
    at all, so no key keeps its lock until the server's TTL."""
    keys = make_keys("release-out-of-time", 6)
    with Client(server.url, timeout=CLIENT_TIMEOUT_S) as client:
        assert client.store(keys, make_payloads("release-out-of-time", 6, 4 << 10)) == 6
        assert client.lookup(keys) == 6  # read locks held for this client
        client.max_keys = 2  # three RELEASE requests
        freeze(server.proc.pid)
        try:
            # the caller is told which keys may keep their locks for a while: all six,
            # the first batch having gone unanswered
            with pytest.raises(RequestTimeoutError, match=r"the last 6 of these 6 keys"):
                client.release(keys, timeout=0.3)
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        client.ping()  # answered after the releases sent before it
        assert client.status()["server"]["locked_keys"] == 0


def test_a_close_interrupted_while_it_settles_late_replies_still_closes_the_socket(
    server: ServerProcess, interrupting_signal: signal.Signals
) -> None:
    """Ctrl-C while ``close`` waits for a frozen server's late reply ends the wait, not the
    closing: the socket is closed all the same (a second close returns at once and would
    not close it)."""
    keys = make_keys("close-interrupted", 2)
    with Client(server.url, timeout=3600.0, cleanup_timeout=60.0) as client:
        assert client.store(keys, make_payloads("close-interrupted", 2, 4 << 10)) == 2
        client.release(keys)
        with _frozen_for_a_while(server.proc.pid, interrupting_signal):
            with pytest.raises(_Interrupted):
                client.lookup(keys)
            closing_interrupted = threading.Timer(0.5, os.kill, (os.getpid(), interrupting_signal))
            closing_interrupted.start()
            try:
                with pytest.raises(_Interrupted):
                    client.close()
            finally:
                closing_interrupted.join()
        assert client._socket.closed
