"""One DEALER socket to the server: requests out, replies matched to them by id.

Several requests may be in flight (``lookup_many`` pipelines them); a reply that arrives
for another outstanding request is kept for it, and one for a request that already timed
out (or whose wait was interrupted) settles what that request took on the client's
behalf (reservations, read locks), which nobody would otherwise give back before the
server's TTL.

ZeroMQ reconnects a dropped connection by itself, to whatever server listens at the URL
then, without telling the socket's user.  A monitor on the socket notes every drop, so
the client can greet the server again (``_connection_dropped``) before it trusts arena
offsets that may name another server's segment.  The same monitor ends the wait of a
request whose connection is gone (the server stopped or died): its reply cannot come, so
the request fails within ``LINK_CHECK_S`` instead of waiting out its whole timeout; a
server that falls silent (its host down, the network cut) is taken as gone once it has not
answered heartbeats for ``HEARTBEAT_TIMEOUT_MS``.  So does a request whose connection
dropped after it was sent even when the socket has reconnected since (a server restarted
at the address within one look): the server's ROUTER answers a connection, not a client,
so a reply never reaches a request over a later connection.  Each request notes the drops
seen when it is sent (see ``_link_epoch``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import zmq

from lmcache_tiers.client.errors import (
    ClientError,
    ConnectionLostError,
    ProtocolError,
    RequestTimeoutError,
    ServerError,
    error_code,
)
from lmcache_tiers.client.spin import REPLY_SPIN_S, checked_spin, poll_for_reply
from lmcache_tiers.endpoints import check_server_url
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.after_fork import renew_locks_after_fork

AUTH_TOKEN_ENV = "LMCACHE_TIERS_AUTH_TOKEN"

logger = logging.getLogger(__name__)

_R = TypeVar("_R", bound=p._Reply)
_K = TypeVar("_K")
_V = TypeVar("_V")

# Plain ints: pyzmq's flags are Python enums, and combining them runs enum code on every
# request, a noticeable share of a LOOKUP round trip.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_OK = p.ErrorCode.OK.value
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_HANDSHAKE_SUCCEEDED = int(zmq.EVENT_HANDSHAKE_SUCCEEDED)
# The backend's methods, without the sugar wrappers (routing_id/group support for socket
# types a client does not use): a few hundred nanoseconds per request.  A reply's first
# frame is received as a Frame, whose ``more`` reads the message's own flag: a
# getsockopt(RCVMORE) costs more than the receive, since pyzmq turns the option into an
# enum member in Python on every call.
_raw_send = zmq.backend.Socket.send
_raw_recv = zmq.backend.Socket.recv
_raw_get = zmq.backend.Socket.get
_decode_reply = p.reply_decoder.decode
_encode = p.encoder.encode
#: the default bound on a clean-up call (the RELEASE or STORE_ABORT after a call cut
#: short, the settling of late replies on ``close``): it runs after a failure, often
#: against a server that did not answer, and must not hold the caller up for a whole
#: ``timeout`` (the client's ``cleanup_timeout``; never more than its ``timeout``)
CLEANUP_TIMEOUT_S = 2.0
#: how long a request waits for its reply between looks at whether its connection is gone
LINK_CHECK_S = 0.25
_LINK_CHECK_MS = int(LINK_CHECK_S * 1000)
#: the shortest blocking wait for a reply (the socket's receive timeout is in milliseconds)
_MIN_WAIT_S = 0.001
#: the longest single wait for the server to become reachable (a request waits in slices)
_MAX_POLL_S = 3600.0
#: a connection over which nothing arrived this long after a heartbeat is taken as gone
HEARTBEAT_INTERVAL_MS = 2_000
HEARTBEAT_TIMEOUT_MS = 10_000
#: the least time between a drop and the socket's next connection (ZeroMQ adds up to as
#: much again at random); set explicitly, since ``_link_epoch`` relies on it
RECONNECT_IVL_MS = 100
#: a request sent at most this long after the connection events were last read needs no
#: new read for its ``_link_epoch`` (a read costs a system call, a good share of a LOOKUP)
#: -- unless that read found no connection: a new one may come up at any time after it
_EVENTS_FRESH_S = RECONNECT_IVL_MS / 1000 / 2
#: the longest a send waits for the report of a connection the socket can already send
#: over (libzmq hands the socket a new connection a moment before it reports it)
_CONNECTION_REPORT_WAIT_S = RECONNECT_IVL_MS / 1000 / 2
# Monitor endpoints are named uniquely: a closed client's name may stay bound for a while.
_MONITORS = itertools.count()
#: requests given up on, and running prefetches, remembered per client (oldest forgotten)
_REMEMBERED = 1024


_KEY_TYPES = frozenset((ObjectKey,))


def _remember(table: dict[_K, _V], key: _K, value: _V) -> None:
    """(Caller holds the client's lock.)"""
    table[key] = value
    while len(table) > _REMEMBERED:
        table.pop(next(iter(table)), None)


def checked_timeout(seconds: float, name: str = "timeout") -> float:
    """``seconds`` if it is a positive number of seconds (infinity included), the rule for
    the client's timeouts and for a call's own.  NaN would fail deep inside the call (no
    integer of milliseconds), and a timeout of zero or less would give up on a reply
    before it could come: both are refused before anything is sent.  It is returned as a
    float: the time a LOOKUP or WAIT_PREFETCH_STATUS asks the server to wait is the number
    given, and msgpack encodes no numpy scalar or Fraction (a bool goes out as a bool, which
    the server refuses)."""
    if not seconds > 0:  # NaN too
        raise ValueError(f"{name} must be a positive number of seconds, got {seconds!r}")
    return seconds if type(seconds) is float else float(seconds)


def checked_wait(seconds: float) -> float:
    """``seconds`` if it is a wait of zero (a poll) or more; NaN and negative waits are
    refused as :func:`checked_timeout` refuses those timeouts; a float, as that returns."""
    if not seconds >= 0:  # NaN too
        raise ValueError(f"wait must not be negative, got {seconds!r}")
    return seconds if type(seconds) is float else float(seconds)


def checked_keys(keys: Sequence[ObjectKey], where: str = "") -> list[ObjectKey]:
    """``keys`` as a list, if each is an :class:`ObjectKey`.  Anything else would go out as
    it is (msgpack encodes a string or a tuple as readily), to be refused by the server as
    a malformed request, counted among its failures -- after the parts of a long call
    before the bad key were stored or locked.  ``where`` names the key list in the message
    (``lookup_many``'s prompts)."""
    if type(keys) is not list and isinstance(keys, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{where}keys must be a sequence of ObjectKeys, not a {type(keys).__name__}")
    listed = list(keys)
    # One pass in C over the exact types (a lookup's keys are checked on every call);
    # subclasses take the slow path.
    if not _KEY_TYPES.issuperset(map(type, listed)):
        for position, key in enumerate(listed):
            if not isinstance(key, ObjectKey):
                raise TypeError(f"{where}keys[{position}] is a {type(key).__name__}, not an ObjectKey")
    return listed


def checked_handle(handle: int) -> int:
    """``handle`` if it can be a prefetch handle (the server's handles are 63-bit): another
    value would be refused by the server as a malformed request, counted among its failures."""
    if not isinstance(handle, int) or isinstance(handle, bool):
        raise TypeError(f"a prefetch handle is an int, not a {type(handle).__name__}")
    if not 0 <= handle < 1 << 63:
        raise ValueError(f"no prefetch handle is {handle}: handles are 0 to 2**63 - 1")
    return handle


def _wait_ms(seconds: float) -> int:
    """A blocking wait of ``seconds`` in the whole milliseconds a socket takes, rounded up
    (at least one): rounded down, the last wait of a call ended up to 1 ms before its
    deadline, and the call timed out that much early."""
    return max(1, math.ceil(seconds * 1000))


def _rest_of_message(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The frames after a message's first, received as bytes (they arrive together with
    it, so these receives do not block)."""
    frames: list[bytes] = []
    while True:
        frame = _raw_recv(sock, 0, False)
        frames.append(frame.bytes)
        if not frame.more:
            return frames


class Connection:
    """A connected, greeted DEALER socket; ``server`` is the HELLO reply."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float,
        auth_token: str | None,
        name: str,
        cleanup_timeout: float = CLEANUP_TIMEOUT_S,
        reply_spin_s: float = REPLY_SPIN_S,
    ) -> None:
        self.url = url
        self.timeout = checked_timeout(timeout)
        self.cleanup_timeout = checked_timeout(cleanup_timeout, "cleanup_timeout")
        # how long a call polls for its reply before sleeping on it (client/spin.py)
        spin_s = checked_spin(reply_spin_s)
        self._spin_ns = int(spin_s * 1e9)
        # a call shorter than this would end its first blocking wait past its deadline after
        # a poll: its poll and that wait come out of its own time (see _round_trip)
        self._short_call_s = LINK_CHECK_S + spin_s if spin_s else 0.0
        # a call shorter than this polls for all of its time: what its poll would leave is
        # less than a blocking wait's least (whole milliseconds), which would outlast it
        self._poll_whole_call_s = spin_s + _MIN_WAIT_S if spin_s else 0.0
        self._token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV, "")
        if len(self._token) > p.MAX_TOKEN_LEN or len(name) > p.MAX_TOKEN_LEN:
            raise ClientError(f"auth token and client name are limited to {p.MAX_TOKEN_LEN} characters")
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        # set in a forked child, where the socket is the parent's (see _after_fork)
        self._inherited = False
        renew_locks_after_fork(self)
        self._name = name
        self._closed = False
        # set once the connection to the server dropped since the last HELLO (see the module)
        self._dropped = False
        # set while the last connection event seen is a drop: no connection to the server now
        self._unlinked = False
        # connection drops seen so far, and when the events were last read (see _link_epoch)
        self._drops = 0
        self._events_read_at = -math.inf
        self._monitor: zmq.Socket[bytes] | None = None
        # requests that timed out, by id, in case their replies still arrive: with the keys
        # whose locks their replies would hand over (None where a RELEASE sent since gave
        # them back, see _released_every_lock), and their _link_epoch when sent
        self._orphans: dict[int, tuple[p._Request, Sequence[ObjectKey | None], int]] = {}
        # the keys of each prefetch still running on the server, by handle: a WAIT whose
        # reply comes too late still hands their locks over (see _settle_orphan)
        self._prefetch_keys: dict[int, list[ObjectKey]] = {}
        self._receive_timeout_ms = -1
        # requests sent and not yet answered (id -> _link_epoch when sent), and answers
        # that came in early
        self._outstanding: dict[int, int] = {}
        self._early: dict[int, tuple[p.Reply, list[Any]]] = {}
        # per thread, the _link_epoch of the request whose reply it took last (whether the
        # connection that reply came over has dropped since): per thread, so a caller reads
        # its own call's without holding the lock past the call, where other threads'
        # calls (a greeting of a restarted server among them) must be free to run
        self._answered = threading.local()
        # the id of the last request sent without waiting for its reply (a RELEASE after a
        # timeout, a late reply's follow-up), and of the last request whose reply came
        # (every request is numbered when sent, so a reply to a later one means the server
        # has read it): close makes sure the former reached the server (see close)
        self._last_unwaited_id = 0
        self._last_answered_id = 0
        # the last key list encoded, and its msgpack (see _header)
        self._last_keys: tuple[list[Any], msgspec.Raw] | None = None
        # the last LOOKUP's keys, wait, and header before and after its id (see _header)
        self._lookup_template: tuple[list[Any], float, bytes, bytes] | None = None
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Fail fast instead of queueing requests forever for a peer that never appears.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        # Bracketed IPv6 addresses (tcp://[::1]:5555) connect only with IPV6 on; IPv4 still does.
        self._socket.setsockopt(zmq.IPV6, 1)
        # A server whose host went down or was cut off closes no connection: heartbeats
        # (answered by the server's ZeroMQ I/O thread, busy or not) notice the silence and
        # drop the connection, which ends the requests waiting on it (see _await).
        self._socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
        self._socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        self._socket.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        try:
            # Before connecting, so that no drop goes unseen.
            self._monitor = self._socket.get_monitor_socket(
                _DISCONNECTED | _HANDSHAKE_SUCCEEDED,
                f"inproc://lmcache-tiers-client-monitor-{os.getpid()}-{next(_MONITORS)}",
            )
            try:
                check_server_url(url)
                self._socket.connect(url)
            except ConfigError as exc:
                raise ClientError(str(exc)) from None
            except zmq.ZMQError as exc:
                raise ClientError(f"invalid server URL {url!r}: {exc}") from None
            self.server = self._greet()
        except BaseException:
            self.close()
            raise
        self.max_keys = max(1, self.server.max_keys)

    def close(self) -> None:
        """Close the socket. Locks still held expire on the server.

        A call in progress on another thread is waited for (at most its timeout): a ZeroMQ
        socket closed under a thread that uses it aborts the whole process.  Calls that
        start afterwards raise ClientError.  Replies still due to calls given up on are
        waited for briefly, and requests sent without waiting for their reply are made sure
        of (``_settle_before_close``), so that what they took is given back rather than
        held until the server's TTL."""
        if self._closed:
            return
        self._closed = True  # before the lock: calls waiting for it find the client closed
        with self._lock:
            try:
                if not self._inherited:
                    with contextlib.suppress(ClientError, zmq.ZMQError):
                        self._settle_before_close()
            finally:  # Ctrl-C during that wait ends the wait, not the closing
                if self._monitor is not None:
                    with contextlib.suppress(zmq.ZMQError):
                        self._socket.disable_monitor()
                    self._monitor.close(0)
                self._socket.close(0)

    def _after_fork(self) -> None:
        # In a forked child.  A lock another thread held when the process forked stays held
        # in the child, where that thread does not exist: a call there would wait forever
        # for it instead of being refused (see ``_header``), and so would ``close``.  The
        # connection is marked as inherited here, once, rather than by comparing
        # ``os.getpid()`` on every request: a system call, a noticeable share of a LOOKUP.
        self._lock = threading.RLock()
        self._inherited = True

    def _call_seconds(self, timeout: float | None) -> float:
        """The bound of a call given ``timeout`` (None: the client's), checked as the
        client's own is."""
        return self.timeout if timeout is None else checked_timeout(timeout)

    def _cleanup_seconds(self) -> float:
        """How long a clean-up call waits for its reply (see ``CLEANUP_TIMEOUT_S``)."""
        return min(self.timeout, self.cleanup_timeout)

    def _answerable_orphans(self) -> int:
        """How many requests given up on may still be answered (caller holds the lock):
        those sent over the connection that is still up."""
        self._read_link_events()
        if self._unlinked:
            return 0
        return sum(1 for _, _, sent_at in self._orphans.values() if sent_at >= self._drops)

    def _settle_before_close(self) -> None:
        """On ``close`` (caller holds the lock, the socket still open), within
        ``_cleanup_seconds`` in all: read the late replies of requests given up on, giving
        back what they took (read locks, reservations), then make sure that what was sent
        without waiting for its reply (those follow-ups, a RELEASE after a timeout) reached
        the server before the socket goes: it is closed without lingering, which drops
        what ZeroMQ has not written out yet, and a PING sent after them is answered only
        once the server has handled them.  A LOOKUP's locks would otherwise stay until the
        server's TTL, pinning its objects in L1.  What is left unsettled (a frozen or
        vanished server) is logged and expires there.  A client with nothing of the kind
        closes at once."""
        waiting = self._answerable_orphans()
        if not waiting and self._last_unwaited_id <= self._last_answered_id:
            return
        deadline = time.monotonic() + self._cleanup_seconds()
        while waiting and (remaining := deadline - time.monotonic()) > 0:
            frames = self._receive(min(remaining, LINK_CHECK_S), False)
            if frames is not None:
                self._early_or_settle(frames)
            waiting = self._answerable_orphans()
        if self._last_unwaited_id > self._last_answered_id and not self._unlinked:
            self._await_ping_before(deadline)
        if waiting:
            logger.warning(
                "client for %s closed with %d request%s given up on still unanswered after %gs: "
                "what their replies take on the server (read locks, reservations) expires with its TTL",
                self.url,
                waiting,
                "" if waiting == 1 else "s",
                self._cleanup_seconds(),
            )

    def _await_ping_before(self, deadline: float) -> None:
        """Send a PING and read replies until its own, or ``deadline`` (caller holds the
        lock; used on ``close``, so not through ``_header``, which refuses a closed client)."""
        ping = p.Ping(next(self._ids), self._token)
        try:
            _raw_send(self._socket, p.encode(ping), _NOBLOCK)
        except zmq.Again:
            return
        while (remaining := deadline - time.monotonic()) > 0:
            frames = self._receive(min(remaining, LINK_CHECK_S), False)
            if frames is None:
                self._read_link_events()
                if self._unlinked:
                    return  # the connection is gone: nothing more comes
                continue
            try:
                reply = p.reply_decoder.decode(frames[0])
            except msgspec.DecodeError:
                return
            if reply.req_id == ping.req_id:
                return
            self._early_or_settle(frames, reply)

    def _greet(self, timeout: float | None = None) -> p.HelloReply:
        """HELLO: the server's data-plane parameters (segment, limits, features), within
        ``timeout`` (None: the client's)."""
        hello = p.Hello(0, self._token, p.PROTOCOL_VERSION, self._name, os.getpid())
        return self._call(hello, p.HelloReply, timeout=timeout)

    def _connection_dropped(self) -> bool:
        """Whether the connection to the server dropped since the last HELLO: the socket
        has reconnected (or will) to whatever server listens at the URL now, possibly a
        restarted one with another segment; ``_dropped`` stays set until a HELLO clears it.

        A drop is reported by the socket's I/O thread before it reconnects, so once a reply
        came over a new connection, this sees the drop."""
        if not self._dropped and self._monitor is not None and not self._closed and not self._inherited:
            with self._lock:
                if not self._closed:  # closed while this waited for the lock
                    self._read_link_events()
        return self._dropped

    def _read_link_events(self) -> None:
        """Apply the connection events the monitor has queued, in order (caller holds the
        lock): a drop sets ``_dropped`` and ``_unlinked``, a completed handshake (a new
        connection) clears ``_unlinked``."""
        monitor = self._monitor
        if monitor is None:
            return
        # Every event reported before now is read below.
        self._events_read_at = time.monotonic()
        try:
            while int(_raw_get(monitor, _EVENTS)) & _POLLIN:
                event = int.from_bytes(monitor.recv_multipart(_NOBLOCK)[0][:2], "little")
                if event == _DISCONNECTED:
                    self._dropped = self._unlinked = True
                    self._drops += 1
                elif event == _HANDSHAKE_SUCCEEDED:
                    self._unlinked = False
        except zmq.ZMQError:
            pass
        except BaseException:
            self._event_maybe_lost()
            raise

    def _event_maybe_lost(self) -> None:
        """An exception (a signal handler's, Ctrl-C) cut a read of the connection events
        short, perhaps between an event's receipt and its use (caller holds the lock).  A
        drop lost that way would leave the client trusting the mapped segment of a server
        that may have restarted since: copies into its old segment, committed on the new
        one.  So it counts as a drop: the server is greeted again before the next request
        that names arena offsets, and requests sent before are taken as lost (they fail
        early rather than wait).  The connection counts as up: were it not, a send waits
        for it (IMMEDIATE), and a request that went into the dropped pipe waits out its
        timeout; counted down, every request would wait for a new connection's report
        and fail early until the next connection came."""
        self._dropped = True
        self._drops += 1
        self._unlinked = False

    def _link_epoch(self, now: float) -> int:
        """Right before a send at ``now`` (caller holds the lock): the drops a request sent
        now comes after.

        A drop is reported before the socket starts on another connection, which takes at
        least the reconnect interval; so a drop not seen by a read of the events less than
        half that interval ago left no other connection to send over: the request went over
        the connection that dropped, or into its pipe, and cannot be answered.  Reads older
        than that are done again first, and so is a read that found no connection: the
        next one may have come up any time since (the reconnect interval runs from the
        drop, not from the read), and a request sent over it would be taken as sent before
        the drop, failing at its first look at the connection although it is answered.

        A send that succeeds while the last event seen is a drop may also have gone into
        the dropped connection's pipe, which the socket had not let go of yet: that drop
        counts as coming after it.  libzmq lets go of that pipe a moment after reporting
        the drop, and hands the socket a new connection a moment before reporting it:
        while the socket can send although the last event seen is a drop, the events are
        read again until it cannot (the old pipe went) or the new connection is reported
        (``_await_connection_report``).  At worst (that report late by more than
        ``_CONNECTION_REPORT_WAIT_S``) a request that reached a new connection is taken as
        lost, failing early; its reply is then settled like that of any request given up
        on."""
        if self._unlinked or now - self._events_read_at > _EVENTS_FRESH_S:
            self._read_link_events()
            if self._unlinked:
                self._await_connection_report()
        return self._drops - 1 if self._unlinked else self._drops

    def _events_read_lately(self) -> bool:
        """Whether a send now would not read the connection events again first (see
        ``_link_epoch``): they were read less than ``_EVENTS_FRESH_S`` ago and found the
        connection up, so a drop since left no other connection to reach another server
        over yet."""
        return not self._unlinked and time.monotonic() - self._events_read_at <= _EVENTS_FRESH_S

    def _await_connection_report(self) -> None:
        """While the last event seen is a drop and the socket can send all the same, read
        the events again (caller holds the lock), for up to ``_CONNECTION_REPORT_WAIT_S``:
        see ``_link_epoch``.  Asking whether the socket can send also makes it take in
        what its I/O thread told it (the old pipe's end, a new connection), so a send that
        follows goes where the events say."""
        monitor = self._monitor
        if monitor is None:
            return
        deadline = time.monotonic() + _CONNECTION_REPORT_WAIT_S
        with contextlib.suppress(zmq.ZMQError):
            while self._unlinked and int(_raw_get(self._socket, _EVENTS)) & _POLLOUT:
                remaining = deadline - time.monotonic()
                if not remaining > 0:
                    return
                # In slices of a millisecond: the old pipe's end is told to the socket, not
                # reported on the monitor.
                monitor.poll(_wait_ms(min(remaining, _MIN_WAIT_S)), zmq.POLLIN)
                self._read_link_events()
            if not self._unlinked:
                # Taken in now, the new connection and, before it, the old pipe's end.
                _raw_get(self._socket, _EVENTS)

    def _answered_over(self) -> int:
        """The ``_link_epoch`` of the request whose reply this thread took last."""
        over: int = getattr(self._answered, "over", 0)
        return over

    def _link_lost(self, sent_at: int) -> bool:
        """Whether a request sent at ``sent_at`` (its ``_link_epoch``) can no longer be
        answered (caller holds the lock): the socket has no connection to the server now,
        or the one the request went over has dropped since, even if another has come up."""
        if self._inherited:
            return False
        self._read_link_events()
        return self._unlinked or self._drops > sent_at

    def _send_and_forget(self, request: p._Request) -> bool:
        """Send ``request`` without waiting for its reply (dropped when it comes): what a
        failed call gives back must not wait another timeout for a server that did not
        answer.  False, and nothing sent, when the server cannot be reached at once."""
        with self._lock, contextlib.suppress(ClientError, zmq.ZMQError):
            _raw_send(self._socket, self._header(request), _NOBLOCK)
            self._last_unwaited_id = request.req_id
            if type(request) is p.Release and not request.once:
                self._released_every_lock(request.keys)
            return True
        return False

    def _released_every_lock(self, keys: Sequence[ObjectKey]) -> None:
        """A RELEASE of every lock this client holds on ``keys`` has just gone out, or is
        about to (caller holds the lock).  The server reads it after the RETRIEVEs and the
        LOOKUPs asking for no wait given up on before it over the same connection, which it
        answers as it reads them: their locks on those keys go with it, and their late
        replies must release nothing more of them -- a RELEASE of one lock per key after it
        would drop a lock taken since, another retrieve's under views in use.  (A LOOKUP
        that waits for its prefetch, or a WAIT, may be answered after a RELEASE read
        meanwhile, once the prefetch ends: its reply's locks still go back.)"""
        if not self._orphans:
            return
        released = set(keys)
        for req_id, (request, held, sent_at) in list(self._orphans.items()):
            answered_at_once = isinstance(request, p.Retrieve) or (
                isinstance(request, p.Lookup) and not request.wait_s
            )
            if answered_at_once and sent_at == self._drops and not released.isdisjoint(held):
                self._orphans[req_id] = (request, [None if key in released else key for key in held], sent_at)

    # -- request/reply -----------------------------------------------------------------------

    def _call(
        self,
        request: p._Request,
        expect: type[_R],
        payloads: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> _R:
        if payloads:
            return self._exchange(request, expect, payloads, timeout)[0]
        with self._lock:
            if self._outstanding:  # pipelined requests in flight: their replies come first
                return self._exchange(request, expect, payloads, timeout)[0]
            return self._round_trip(request, expect, self.timeout if timeout is None else timeout)

    def _round_trip(self, request: p._Request, expect: type[_R], seconds: float) -> _R:
        """The usual request (no payload frames, nothing else in flight; caller holds the
        lock): everything is prepared before the send, and the blocking receive follows it
        directly.  On a small machine both processes often share a core, so every step
        between send and receive, and every Python call around them, adds to the round trip
        about twice what it costs in a hot loop.  Anything unusual (the server not reachable
        yet, a late reply to an earlier request, a multi-frame reply, no reply in time)
        continues on the general path of ``_start``/``_await``."""
        header = self._header(request)
        now = time.monotonic()
        deadline = now + seconds
        sock = self._socket
        # in slices: between them, _await looks whether the connection is gone
        timeout_ms = _LINK_CHECK_MS if seconds >= LINK_CHECK_S else _wait_ms(seconds)
        if timeout_ms != self._receive_timeout_ms:
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._receive_timeout_ms = timeout_ms
        req_id = request.req_id
        # Outstanding before the send: an exception right after it (a signal handler's)
        # leaves a request whose reply may come, given up on below like an unanswered one.
        # Its _link_epoch, without the call when the events were read recently enough and
        # found the connection up.
        if self._unlinked or now - self._events_read_at > _EVENTS_FRESH_S:
            self._outstanding[req_id] = self._link_epoch(now)
        else:
            self._outstanding[req_id] = self._drops
        try:
            try:
                _raw_send(sock, header, _NOBLOCK)
            except zmq.Again:
                # waits for the server to be reachable
                self._outstanding[req_id] = self._send(header, (), deadline)
            spin_ns = self._spin_ns
            short = seconds < self._short_call_s
            if short and seconds < self._poll_whole_call_s:
                spin_ns = int(seconds * 1e9)
            first = poll_for_reply(sock, spin_ns)
            if first is None:
                if short:
                    # the rest of its time, and no more: its slice was set before the poll
                    return self._await(request, expect, deadline)[0]
                try:
                    first = _raw_recv(sock, 0, False)
                except zmq.Again:
                    return self._await(request, expect, deadline)[0]  # no reply yet: times out there
            if first.more:
                frames = [first.bytes, *_rest_of_message(sock)]
                self._early_or_settle(frames)
                return self._await(request, expect, deadline)[0]
            try:
                # From the frame's own buffer (pyzmq's stubs do not say a Frame is one): its
                # copy as bytes is only needed below.
                reply = _decode_reply(first)  # type: ignore[arg-type]
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"undecodable reply from {self.url}: {exc}") from None
            if reply.req_id != req_id:
                self._early_or_settle([first.bytes], reply)
                return self._await(request, expect, deadline)[0]
        except BaseException:
            self._give_up(request)
            raise
        self._answered.over = self._outstanding.pop(req_id)
        self._last_answered_id = req_id  # sent after every request before it
        if reply.code != _OK:
            raise self._refusal(reply)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.__name__} but got {type(reply).__name__}")
        return reply

    def _refusal(self, reply: p._Reply) -> ServerError:
        """The error of a reply refusing its request (caller holds the lock).  The key list
        kept encoded is forgotten: keys equal by value to well-formed ones may encode to
        what the server refuses (a rank of ``True`` or ``1.0`` equals ``1``), and would
        otherwise go out again for the next, well-formed list equal to them."""
        self._last_keys = None
        self._lookup_template = None
        return ServerError(error_code(reply.code), reply.message)

    def _early_or_settle(self, frames: list[Any], reply: p.Reply | None = None) -> None:
        """A message that is not the reply awaited: kept for the outstanding request it
        answers, or, for one that timed out, what it took is given back."""
        if reply is None:
            try:
                reply = p.reply_decoder.decode(frames[0])
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"undecodable reply from {self.url}: {exc}") from None
        if reply.req_id in self._outstanding:
            self._early[reply.req_id] = (reply, frames)
        else:
            self._settle_orphan(reply)

    def _exchange(
        self,
        request: p._Request,
        expect: type[_R],
        payloads: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[_R, list[Any]]:
        with self._lock:
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            try:
                self._start(request, payloads, deadline)
                return self._await_reply(request, expect, deadline)
            except BaseException:
                self._give_up(request)
                raise

    def _start(self, request: p._Request, payloads: Sequence[Any], deadline: float) -> None:
        """Send one request (caller holds the lock); its reply is collected by ``_await``.

        The request is outstanding from before its send: if the send is interrupted, the
        caller gives it up (``_give_up``), and a reply that comes anyway is settled."""
        header = self._header(request)
        self._outstanding[request.req_id] = self._drops  # _send tells which connection it went over
        self._outstanding[request.req_id] = self._send(header, payloads, deadline)

    def _header(self, request: p._Request) -> bytes:
        """Number ``request``, sign it with the token and encode it."""
        if self._closed:
            raise ClientError("the client is closed")
        if self._inherited:
            raise ClientError("a Client cannot be used in a forked child; create a new one there")
        request.req_id = next(self._ids)
        request.token = self._token
        if type(request) is not p.Lookup:
            return self._encoded_header(request, getattr(request, "keys", None))
        # An engine asks about the same prompt again and again, with the same wait: what
        # comes before and after the request id is kept from the last LOOKUP encoded
        # (``_lookup_template``), the very bytes encoding the request would give, and only
        # the id is encoded on each call.
        template = self._lookup_template
        if template is None or template[1] != request.wait_s or template[0] != request.keys:
            header, template = self._new_lookup_template(request)
            if template is None:
                return header
            self._lookup_template = template
        return template[2] + _encode(request.req_id) + template[3]

    def _new_lookup_template(
        self, request: p.Lookup
    ) -> tuple[bytes, tuple[list[Any], float, bytes, bytes] | None]:
        """The header of ``request``, and the template it gives for the next LOOKUP: its key
        list (a copy: the caller may change its own) and wait, and the bytes before and
        after its request id (None when the header is not one a template serves: over the
        size limit with some request id, or not laid out as read here)."""
        keys = request.keys
        header = self._encoded_header(request, keys)
        # A fixarray of the fields, then the op tag (a positive fixint), then the id; an id
        # takes up to 9 bytes.
        id_end = 2 + len(_encode(request.req_id))
        if (
            type(keys) is not list
            or header[2:id_end] != _encode(request.req_id)
            or len(header) - id_end + 2 + 9 > p.MAX_HEADER_BYTES
        ):
            return header, None
        return header, (list(keys), request.wait_s, header[:2], header[id_end:])

    def _encoded_header(self, request: p._Request, keys: Any) -> bytes:
        """``request`` encoded, its key list (``keys``) from the last one kept encoded."""
        if not (type(keys) is list and keys):
            return self._checked_size(request, p.encode(request))
        # An engine asks about the same prompt again and again (each scheduler step while
        # it waits), then retrieves it: the key list's msgpack is kept and put in the
        # header as it is, the very bytes encoding the keys would give.  It stands in for
        # the list in the request itself while that is encoded (a copy of the request
        # costs more), which keeps its keys for ``_remember_orphan``.
        request.keys = self._encoded_keys(keys)  # type: ignore[attr-defined]
        try:
            return self._checked_size(request, p.encode(request))
        finally:
            request.keys = keys  # type: ignore[attr-defined]

    @staticmethod
    def _checked_size(request: p._Request, header: bytes) -> bytes:
        if len(header) > p.MAX_HEADER_BYTES:
            # The server would refuse it anyway; say so now rather than after a round trip.
            raise ClientError(
                f"{type(request).__name__} encodes to {len(header)} bytes, over the protocol's "
                f"{p.MAX_HEADER_BYTES}-byte header limit"
            )
        return header

    def _encoded_keys(self, keys: list[Any]) -> msgspec.Raw:
        """The msgpack of ``keys``; the same list as the last one (compared key by key, by
        identity first) is not encoded again."""
        last = self._last_keys
        if last is not None and last[0] == keys:
            return last[1]
        encoded = msgspec.Raw(p.encoder.encode(keys))
        self._last_keys = (list(keys), encoded)  # a copy: the caller may change its list
        return encoded

    def _await(self, request: p._Request, expect: type[_R], deadline: float) -> tuple[_R, list[Any]]:
        """Receive until the reply to ``request`` arrives; replies to other outstanding
        requests of this client are kept for their own ``_await``."""
        try:
            return self._await_reply(request, expect, deadline)
        except BaseException:
            self._give_up(request)
            raise

    def _give_up(self, request: p._Request) -> None:
        """A wait for the reply to ``request`` ended without it (interrupted by a signal
        handler or Ctrl-C, or another message could not be decoded): its reply may still
        come, so it is settled like that of a request that timed out.  Left outstanding,
        that reply would be kept for a wait that never comes, holding what it took on the
        client's behalf (locks, reservations) until the server's TTL, and every later call
        would take the slow path of pipelined requests."""
        sent_at = self._outstanding.pop(request.req_id, None)
        if sent_at is None:
            return  # answered, or already given up on
        self._remember_orphan(request, sent_at)
        arrived = self._early.pop(request.req_id, None)
        if arrived is not None:
            self._settle_orphan(arrived[0])

    def _await_reply(self, request: p._Request, expect: type[_R], deadline: float) -> tuple[_R, list[Any]]:
        req_id = request.req_id
        sent_at = self._outstanding.get(req_id, self._drops)
        # Zero-copy frames only where payloads come back; plain bytes are cheaper.
        zero_copy = isinstance(request, p.Retrieve) and request.inline
        arrived = self._early.pop(req_id, None)
        while arrived is None:
            remaining = deadline - time.monotonic()
            frames = self._receive(min(remaining, LINK_CHECK_S), zero_copy) if remaining > 0 else None
            lost = False
            if frames is None and remaining > LINK_CHECK_S:
                if not self._link_lost(sent_at):
                    continue
                # A reply that arrived before the drop is still readable; nothing comes after it.
                frames = self._receive(0.001, zero_copy)
                lost = True
            if frames is None and not lost and deadline > time.monotonic():
                # Woke before the deadline: ZeroMQ's clock may run a little behind.
                continue
            if frames is None:
                self._outstanding.pop(req_id, None)
                self._remember_orphan(request, sent_at)
                what = type(request).__name__
                if lost:
                    raise ConnectionLostError(
                        f"the connection to {self.url} was lost while waiting for the reply to "
                        f"{what} (the server stopped, died or restarted)"
                    )
                raise RequestTimeoutError(f"no reply from {self.url} to {what} in time")
            try:
                reply = p.reply_decoder.decode(frames[0])
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"undecodable reply from {self.url}: {exc}") from None
            if reply.req_id == req_id:
                arrived = reply, frames
            else:
                self._early_or_settle(frames, reply)
        self._answered.over = self._outstanding.pop(req_id, sent_at)
        self._last_answered_id = max(self._last_answered_id, req_id)
        reply, frames = arrived
        if reply.code != _OK:
            raise self._refusal(reply)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.__name__} but got {type(reply).__name__}")
        return reply, frames[1:]

    def _receive(self, seconds: float, zero_copy: bool) -> list[Any] | None:
        # A blocking receive with a timeout wakes up faster than polling first.
        timeout_ms = _wait_ms(seconds)
        if timeout_ms != self._receive_timeout_ms:
            self._socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._receive_timeout_ms = timeout_ms
        sock = self._socket
        try:
            if zero_copy:
                part = sock.recv(copy=False)
                frames: list[Any] = [part]
                while part.more:
                    part = sock.recv(copy=False)
                    frames.append(part)
                return frames
            first = _raw_recv(sock, 0, False)
        except zmq.Again:
            return None
        if not first.more:
            return [first.bytes]
        return [first.bytes, *_rest_of_message(sock)]

    def _send(self, header: bytes, payloads: Sequence[Any], deadline: float) -> int:
        """Send one message; returns its ``_link_epoch``.

        All or nothing for the caller: an exception between two frames (a signal handler's,
        Ctrl-C, a buffer ZeroMQ cannot take) would leave the message open, and ZeroMQ would
        append the next request's frames to it -- a PING's header stored as an object when
        the frame count happens to match the key count.  The message is ended with an empty
        frame instead, which the server refuses (and counts) for certain: it takes no empty
        payload, nor a frame count other than the key count.  Whether the frame being sent
        when the exception came went out cannot be told; if it was the last, the message
        was whole, and the empty frame is a message of its own, refused as undecodable."""
        sock = self._socket
        more = bool(payloads)
        open_message = False  # whether a frame sent with SNDMORE may have gone out
        try:
            while True:
                epoch = self._link_epoch(time.monotonic())
                try:
                    open_message = more
                    _raw_send(sock, header, _SNDMORE_NOBLOCK if more else _NOBLOCK)
                    break
                except zmq.Again:
                    open_message = False
                    # IMMEDIATE: nothing is queued while the server is unreachable, so a
                    # request never reaches a server long after its caller gave up on it.
                    remaining = deadline - time.monotonic()
                    if not remaining > 0:
                        raise RequestTimeoutError(f"cannot reach the server at {self.url}") from None
                    # In slices: a poll takes an int of milliseconds, which a long (or
                    # infinite) timeout overflows.
                    sock.poll(_wait_ms(min(remaining, _MAX_POLL_S)), zmq.POLLOUT)
            last = len(payloads) - 1
            for index, payload in enumerate(payloads):
                # Copied, not referenced: a message may still be queued when its caller is
                # told the request timed out, and the caller then reuses its buffers; ZeroMQ
                # would send what they hold by then, stored under the keys of this request.
                sock.send(payload, _SNDMORE if index < last else 0, copy=True)
        except BaseException:
            if open_message:
                # A frame of a message under way is always taken (the high-water mark
                # counts whole messages); if the connection went meanwhile, ZeroMQ has
                # dropped the message already.
                with contextlib.suppress(zmq.ZMQError):
                    _raw_send(sock, b"", _NOBLOCK)
            raise
        return epoch

    def _remember_orphan(self, request: p._Request, sent_at: int) -> None:
        if isinstance(request, (p.StoreReserve, p.Retrieve, p.Lookup)):
            _remember(self._orphans, request.req_id, (request, request.keys, sent_at))
        elif isinstance(request, (p.WaitPrefetchStatus, p.QueryPrefetchStatus)):
            # Either collects a finished prefetch, locks and all, when its reply is sent.
            with self._lock:
                keys = self._prefetch_keys.pop(request.handle, None)
                if keys is not None:
                    _remember(self._orphans, request.req_id, (request, keys, sent_at))

    def _running_prefetch(self, handle: int, keys: list[ObjectKey]) -> None:
        """A LOOKUP was answered while its prefetch still runs: remember its keys."""
        with self._lock:
            _remember(self._prefetch_keys, handle, keys)

    def _prefetch_settled(self, handle: int) -> None:
        """The prefetch's result was collected, or the server knows no such prefetch."""
        with self._lock:
            self._prefetch_keys.pop(handle, None)

    def _settle_orphan(self, reply: p._Reply) -> None:
        """A reply arrived after its request timed out: give back what it took on our
        behalf (reservations, read locks), which nobody will otherwise release before the
        server's TTL.  The follow-up request's own reply is discarded like this one.

        Read locks go one per key (``once``): a RETRIEVE of the same keys may be in
        flight or its views in use, under locks of their own.

        A reply read after the connection it came over dropped (it was in the socket
        before the drop) is left alone: what its request took lives in that connection's
        session (or in a server that restarted since), which no request over the next
        connection reaches.  A RELEASE or STORE_ABORT by key over that one would give back
        what this client took since under the same keys -- a lookup's lock, the
        reservation of a store being copied into, whose extent would go back to the
        allocator under the copy."""
        orphan = self._orphans.pop(reply.req_id, None)
        if orphan is None or reply.code != p.ErrorCode.OK:
            return
        request, keys, sent_at = orphan
        if self._link_lost(sent_at):
            logger.info(
                "a late reply to %s came over a connection to %s that has dropped since: what it "
                "took there is left to the server's TTLs, not given back over the next connection",
                type(request).__name__,
                self.url,
            )
            return
        follow_up: p._Request | None = None
        if isinstance(request, p.StoreReserve) and isinstance(reply, p.StoreReserveReply):
            reserved = [
                k for k, slot in zip(request.keys, reply.slots, strict=False) if slot.offset != p.NO_SLOT
            ]
            follow_up = p.StoreAbort(next(self._ids), self._token, reserved) if reserved else None
        elif isinstance(request, p.Retrieve) and isinstance(reply, p.RetrieveReply) and not request.inline:
            follow_up = self._release_once(keys[: len(reply.slots)])
        elif isinstance(request, p.Lookup) and isinstance(reply, p.LookupReply) and reply.hits:
            follow_up = self._release_once(keys[: reply.hits])
        elif isinstance(request, (p.WaitPrefetchStatus, p.QueryPrefetchStatus)) and isinstance(
            reply, p.PrefetchStatusReply
        ):
            if reply.hits:  # the prefetch finished, and this reply collected its locks
                follow_up = self._release_once(keys[: reply.hits])
            elif reply.hits is None:  # still running: a later WAIT or QUERY may collect it
                self._running_prefetch(request.handle, [key for key in keys if key is not None])
        if follow_up is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send(p.encode(follow_up), zmq.NOBLOCK)
                self._last_unwaited_id = follow_up.req_id

    def _release_once(self, named: Sequence[ObjectKey | None]) -> p.Release | None:
        """A RELEASE of one lock per key, for a late reply's locks (None among ``named``:
        given back already); None when there is none, or for a server without
        ``release_once`` (an earlier release), which ignores ``once`` and would drop every
        lock this client holds on the keys, a retrieve's in use among them: those locks are
        left to the server's lock TTL instead."""
        keys = [key for key in named if key is not None]
        if not keys:
            return None
        if "release_once" in self.server.features:
            return p.Release(next(self._ids), self._token, keys, once=True)
        logger.info(
            "%d read locks a late reply took are left to the server's lock TTL (%ss): "
            "the server (%s) cannot release one lock per key",
            len(keys),
            self.server.lock_ttl_s,
            self.server.server_version,
        )
        return None

    def _batches(self, count: int) -> Iterator[slice]:
        # Each part starts where the one before it ended, at the limit the server greeted
        # last tells: a server greeted meanwhile (by another call of this client) may tell
        # another, and parts cut at one limit's starts to the other's length would overlap
        # (keys counted twice) or leave keys out.
        start = 0
        while start < count:
            stop = min(count, start + self.max_keys)
            yield slice(start, stop)
            start = stop
