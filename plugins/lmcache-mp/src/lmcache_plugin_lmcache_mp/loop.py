"""The request loop: LMCache's frames on core's RouterLoop (one ROUTER, one loop thread).

As in LMCache's server, the ROUTER is bound with ``ROUTER_MANDATORY`` and only the loop
thread touches it; requests are answered in the loop unless their handler returns a
:class:`~lmcache_plugin_lmcache_mp.base.Deferred`, whose work runs on the pool and whose
finisher (and reply) comes back to the loop.

Nothing a client sends can stop the loop: frames are bounded (``ZMQ_MAXMSGSIZE``
disconnects a peer sending a larger one; at most :data:`MAX_FRAMES` frames are kept), and a
request that cannot be decoded or served is logged with its operation and request ids,
counted, and -- like LMCache's server -- not answered.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from lmcache_plugin_lmcache_mp.base import Deferred, Prepared, failure_reason
from lmcache_plugin_lmcache_mp.handlers import BY_CONNECTION, NOT_SERVED, Handlers
from lmcache_plugin_lmcache_mp.wire import (
    MAX_ARGUMENT_BYTES,
    CacheKey,
    EncodedReply,
    decode_arguments,
    encode_reply,
    operation_name,
    peek_uid,
)
from lmcache_tiers.plugin import FrontendStats, RouterLoop, printable

logger = logging.getLogger(__name__)

#: frames kept of one message: identity, uid, op and up to 13 arguments (LMCache's widest
#: operation takes 7)
MAX_FRAMES = 16
#: unanswered requests logged per window of LOG_WINDOW_S; the rest are counted, then summed
#: up in the next line logged.  A minute, as the native front end's: one broken client
#: sending refused requests without pause would otherwise write 72,000 lines an hour
LOG_LINES_PER_WINDOW = 20
LOG_WINDOW_S = 60.0
#: operations whose work on the pool (pickled chunks) the stop gives up on, and counts,
#: itself: it holds reservations or read locks to give back (Transfers.release_everything)
_GIVEN_UP_BY_TRANSFERS = frozenset({"commit_store", "prepare_retrieve"})


class _LineBudget:
    """At most ``lines`` log lines a window of ``window_s``; reports how many it held back."""

    def __init__(self, lines: int, window_s: float) -> None:
        self.lines = lines
        self.window_s = window_s
        self._window = 0.0
        self._used = 0
        self._held = 0

    def take(self) -> tuple[bool, int]:
        """(may log now, lines held back since the last one logged)."""
        now = time.monotonic()
        if now - self._window >= self.window_s:
            self._window, self._used = now, 0
        if self._used >= self.lines:
            self._held += 1
            return False, 0
        self._used += 1
        held, self._held = self._held, 0
        return True, held


class MPServer:
    """LMCache's protocol on one ROUTER socket (core's RouterLoop), until :meth:`request_stop`."""

    #: the sweep's period, shorter under short L1 TTLs (see ``sweep_ttls`` below)
    SWEEP_INTERVAL_S = 0.5

    def __init__(
        self,
        handlers: Handlers,
        endpoint: str,
        *,
        name: str,
        workers: int,
        max_frame_bytes: int,
        drain_timeout_s: float,
        max_pool_bytes: int | None = None,
    ) -> None:
        self.handlers = handlers
        shared = handlers.shared
        self.stats: FrontendStats = shared.stats
        self.name = name
        self.router = RouterLoop(
            endpoint,
            name=name,
            stats=self.stats,
            pool_workers=workers,
            max_frame_bytes=max_frame_bytes,
            sweep_interval_s=self.SWEEP_INTERVAL_S,
            # What the sweep enforces: lookup locks held for half the lock TTL, a retrieve's
            # given back at most half of it before its deadline, reservations at the write
            # TTL.  A short TTL shortens the period, or L1 would reap them first.
            sweep_ttls=(shared.lock_ttl_s / 2, shared.write_ttl_s),
            drain_timeout_s=drain_timeout_s,
            max_pool_bytes=max_pool_bytes,
        )
        self.socket = self.router.socket
        self._budget = _LineBudget(LOG_LINES_PER_WINDOW, LOG_WINDOW_S)
        #: requests handed to the pool and not answered yet (loop thread only)
        self._in_pool: set[_PoolRequest] = set()
        #: the first frame of the message being handled, which knows its descriptor
        self._first_frame: zmq.Frame | None = None

    def request_stop(self, *, force: bool = False) -> None:
        """Begin a stop; safe from a signal handler (a flag, and a non-blocking wake-up)."""
        self.router.request_stop(force=force)

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Serve on the loop's thread until a stop, then give back what clients hold."""
        self.router.start(
            self._receive_one,
            sweep=self.handlers.sweep,
            on_drain=self.handlers.shared.stopping.set,  # waits in the pool end early
            on_shutdown=self._shut_down,
            on_failure=on_failure,
        )

    def _shut_down(self) -> None:
        """The pool's queue is cancelled: give up what waited in it, then give back what
        clients hold."""
        self._give_up_queued()
        self.handlers.release_everything()

    def _give_up_queued(self) -> None:
        """Requests still queued for a pool thread never run now, nor are answered: counted
        (``mp_shutting_down``) and logged by operation."""
        waiting, self._in_pool = self._in_pool, set()
        given_up = Counter(request.name for request in waiting if request.give_up())
        if given_up:
            total = sum(given_up.values())
            self.stats.failure("mp_shutting_down", total)
            logger.warning(
                "%s: %d requests waiting for a pool thread were given up at the stop, never "
                "answered (%s) [mp_shutting_down]",
                self.name,
                total,
                ", ".join(f"{name} x{count}" for name, count in sorted(given_up.items())),
            )

    def _receive_one(self) -> None:
        sock = self.socket
        try:
            part = sock.recv(copy=False)
        except zmq.Again:
            return  # receive timeout: time for housekeeping
        except zmq.ZMQError as exc:
            logger.warning("%s: receive failed: %s", self.name, exc)
            return
        self._first_frame = part
        frames = [part.bytes]
        more = part.more
        while more:  # parts of one message arrive together: these receives do not block
            part = sock.recv(copy=False)
            more = part.more
            if len(frames) < MAX_FRAMES:
                frames.append(part.bytes)
            elif len(frames) == MAX_FRAMES:
                frames.append(b"")  # marks the message as over the frame limit
        if self.router.is_waker(frames[0]):
            return
        if len(frames) < 3:
            self._unanswered(
                "?",
                peek_uid(frames[1]) if len(frames) > 1 else "?",
                "mp_bad_request",
                f"{len(frames)} frames: no uid or no op frame",
            )
            return
        if len(frames) > MAX_FRAMES:
            self._unanswered("?", peek_uid(frames[1]), "mp_bad_request", f"more than {MAX_FRAMES} frames")
            return
        try:
            self._handle(frames[0], frames[1], frames[2], frames[3:])
        except Exception as exc:  # a bug must cost one request, never the loop
            self._failed("?", frames[1], [], exc)

    def _handle(self, identity: bytes, uid: bytes, op: bytes, arg_frames: list[bytes]) -> None:
        try:
            name = operation_name(op)
        except ValueError as exc:
            self.stats.requests["unknown"] += 1
            self._unanswered("?", peek_uid(uid), "mp_unknown_op", str(exc))
            return
        if name not in self.handlers.table:
            if name in NOT_SERVED:
                self.stats.requests[name] += 1
                self._unanswered(name, peek_uid(uid), "mp_not_served", NOT_SERVED[name], arg_frames)
            else:  # one label for all: a client must not grow /metrics with made-up names
                self.stats.requests["unknown"] += 1
                message = "not an operation of LMCache's protocol"
                self._unanswered(name[:64], peek_uid(uid), "mp_unknown_op", message)
            return
        self.stats.requests[name] += 1
        if self.router.draining:
            if name == "commit_store":
                self._refuse_store_at_stop(identity, arg_frames)
            self._unanswered(
                name, peek_uid(uid), "mp_shutting_down", "the server is shutting down", arg_frames
            )
            return
        transfers = self.handlers.transfers
        peer = identity
        if name in BY_CONNECTION:
            fd = self._source_fd()
            peer = connection(identity, fd)
            if name == "prepare_store":
                # Its writer's process is read off the descriptor this message came in on,
                # during the call: once the connection closes, the number is another's.
                transfers.source_fd = fd
        try:
            args = decode_arguments(name, arg_frames)
            result = self.handlers.dispatch(name, args, peer)
        except Exception as exc:
            self._failed(name, uid, arg_frames, exc)
            return
        finally:
            transfers.source_fd = -1
        if isinstance(result, Deferred):
            self._submit(identity, uid, op, name, arg_frames, result)
        elif isinstance(result, Prepared):
            if not self._send(identity, uid, op, result.reply):
                result.undelivered()  # the client is gone or not reading: nobody has the slots
        else:
            self._send(identity, uid, op, result)

    def _source_fd(self) -> int:
        """The descriptor the message being handled came in on (-1: not known, as over
        ``inproc://`` or from a libzmq that does not say); read while it is handled."""
        if self._first_frame is None:
            return -1
        try:
            return int(self._first_frame.get(zmq.SRCFD))
        except zmq.ZMQError:
            return -1

    def _refuse_store_at_stop(self, identity: bytes, arg_frames: list[bytes]) -> None:
        """Count the keys of a store refused because the server stops (none are stored)."""
        try:
            key, instance_id, data = decode_arguments("commit_store", arg_frames)
        except ValueError:
            return  # not a store at all: the request alone is counted
        peer = connection(identity, self._source_fd())
        self.handlers.transfers.refuse_commit_at_stop(key, instance_id, data, peer=peer)

    # -- pool hand-off ---------------------------------------------------------------------

    def _submit(
        self, identity: bytes, uid: bytes, op: bytes, name: str, arg_frames: list[bytes], deferred: Deferred
    ) -> None:
        request = _PoolRequest(name)
        if name not in _GIVEN_UP_BY_TRANSFERS:
            self._in_pool.add(request)

        def work() -> Callable[[], Any]:
            if not request.start():
                return _never_answered  # given up at the stop, and counted then
            return deferred.work()

        def done(finish: Callable[[], Any] | None, error: BaseException | None) -> None:
            self._in_pool.discard(request)
            if request.given_up:
                return
            if finish is not None:
                try:
                    self._send(identity, uid, op, finish())
                    return
                except Exception as exc:
                    error = exc
            assert error is not None
            self._failed(name, uid, arg_frames, error)

        # Counted at the stop: the pickled ones by Transfers (a store only if it had not
        # ended), the others if never started.
        counted = deferred.counted_at_stop or (
            True if name in _GIVEN_UP_BY_TRANSFERS else lambda: request.given_up
        )
        # The message's size, held on the pool's byte bound (pickled chunks: up to max_message_mb).
        size = len(identity) + len(uid) + len(op) + sum(map(len, arg_frames))
        self.router.submit(work, done, counted_at_stop=counted, message_bytes=size)

    # -- replying --------------------------------------------------------------------------

    def _failed(self, name: str, uid: bytes, arg_frames: list[bytes], exc: BaseException) -> None:
        reason = failure_reason(exc)
        if reason == "mp_handler_error":
            logger.error("%s: %s (uid %s) raised", self.name, name, peek_uid(uid), exc_info=exc)
        self._unanswered(name, peek_uid(uid), reason, str(exc) or type(exc).__name__, arg_frames)

    def _unanswered(
        self, name: str, uid: str, reason: str, message: str, arg_frames: list[bytes] | None = None
    ) -> None:
        """Count a request not answered; log it, with the request id its ``arg_frames``
        carry, within the line budget."""
        self.stats.failure(reason)
        log, held = self._budget.take()
        if not log:
            return
        # Only for a line that is logged: a key may be 64 MiB to decode.
        request_id = _request_id(name, arg_frames) if arg_frames else ""
        earlier = f" ({held} more not logged)" if held else ""
        # Names and ids come from clients: escaped, so they cannot forge log lines.
        ids = f"uid {printable(uid)}" + (f", request_id {printable(request_id)}" if request_id else "")
        # The line does not say LMCache's server refuses the same: some refusals here are
        # departures it serves (a registration of an empty model name, LMCache-driven
        # transfers), and a reason that does (num_kv_readers 0) says so itself.
        logger.warning(
            "%s: %s (%s) not answered (the protocol has no error replies): %s [%s]%s",
            self.name,
            printable(name, 64),
            ids,
            printable(message, 300),
            reason,
            earlier,
        )

    def _send(self, identity: bytes, uid: bytes, op: bytes, result: Any) -> bool:
        """Send the reply; False when it could not go (``RouterLoop.send`` counted it)."""
        # None (LMCache's "void") goes as no payload frame
        if result is None:
            frames = [identity, uid, op]
        elif isinstance(result, EncodedReply):
            frames = [identity, uid, op, result.payload]
        else:
            frames = [identity, uid, op, encode_reply(result)]
        return self.router.send(frames)


class _PoolRequest:
    """A request handed to the pool, until a pool thread starts it or the stop gives it up:
    one of the two, under its lock, so one given up never runs and is never answered."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._started = False
        self.given_up = False

    def start(self) -> bool:
        """Pool thread: False if the stop gave it up first."""
        with self._lock:
            if self.given_up:
                return False
            self._started = True
            return True

    def give_up(self) -> bool:
        """Loop thread, at the stop: True if it had not started (now it never does)."""
        with self._lock:
            if self._started:
                return False
            self.given_up = True
            return True


def connection(identity: bytes, fd: int) -> bytes:
    """What names a client's connection: its routing identity, then the inode of the
    server's socket for it (8 bytes; 0 when the descriptor is not known).  An identity
    alone is the peer's choice (``ZMQ_ROUTING_ID``), free again once its connection
    drops: another connection taking it must not commit, abort or unregister what the
    first one prepared or registered -- a commit of a reservation nobody copied into
    makes its extent's stale bytes readable as those keys.  Unlike its descriptor's
    number, a socket's inode is never another connection's while that one is open."""
    inode = 0
    if fd >= 0:
        try:
            inode = os.fstat(fd).st_ino
        except OSError:
            pass  # closed already: nothing it sent is answered
    return identity + inode.to_bytes(8, "big")


def _never_answered() -> None:
    return None


def _request_id(name: str, arg_frames: list[bytes]) -> str:
    """The request id of a request, for log lines (best effort: the frames may be junk, or
    the first one no key at all, e.g. a ping's instance id: then there is none)."""
    if not arg_frames or len(arg_frames[0]) > MAX_ARGUMENT_BYTES:
        return ""  # such a key is not decoded, not even for a log line
    try:
        if name in ("query_prefetch_status", "wait_prefetch_status", "end_session"):
            return _TEXT.decode(arg_frames[0])[:80]
        return _KEY.decode(arg_frames[0]).request_id[:80]
    except (msgspec.DecodeError, RecursionError):
        return ""


_TEXT = msgspec.msgpack.Decoder(str)
_KEY = msgspec.msgpack.Decoder(CacheKey)
