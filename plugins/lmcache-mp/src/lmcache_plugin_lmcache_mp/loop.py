"""The request loop: one ZeroMQ ROUTER, one loop thread, a pool for requests that wait.

As in LMCache's server, the ROUTER is bound with ``ROUTER_MANDATORY`` and only the loop
thread touches it; requests are answered in the loop unless their handler returns a
:class:`~lmcache_plugin_lmcache_mp.base.Deferred`, whose work runs on the pool and whose
finisher (and reply) comes back to the loop through a queue and a wake-up message from an
in-process DEALER.

Nothing a client sends can stop the loop: frames are bounded (``ZMQ_MAXMSGSIZE``
disconnects a peer sending a larger one; at most :data:`MAX_FRAMES` frames are kept), and a
request that cannot be decoded or served is logged with its operation and request ids,
counted, and -- like LMCache's server -- not answered.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from lmcache_plugin_lmcache_mp.base import Deferred, RequestRefused
from lmcache_plugin_lmcache_mp.handlers import NOT_SERVED, Handlers
from lmcache_plugin_lmcache_mp.wire import CacheKey, decode_arguments, encode_reply, operation_name, peek_uid
from lmcache_tiers.plugin import FrontendStats, KeyValidationError, printable

logger = logging.getLogger(__name__)

#: frames kept of one message: identity, uid, op and up to 13 arguments (LMCache's widest
#: operation takes 7)
MAX_FRAMES = 16
#: unanswered requests logged per second; the rest are counted, then summed up in one line
LOG_LINES_PER_SECOND = 20

_instances = itertools.count()
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
#: identity, uid, op, name, argument frames, then the finisher or what the work raised
_Completion = tuple[bytes, bytes, bytes, str, list[bytes], "Callable[[], Any] | None", "BaseException | None"]


class _LineBudget:
    """At most ``per_second`` log lines a second; reports how many it held back."""

    def __init__(self, per_second: int) -> None:
        self.per_second = per_second
        self._window = 0.0
        self._used = 0
        self._held = 0

    def take(self) -> tuple[bool, int]:
        """(may log now, lines held back since the last one logged)."""
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._used = now, 0
        if self._used >= self.per_second:
            self._held += 1
            return False, 0
        self._used += 1
        held, self._held = self._held, 0
        return True, held


class MPServer:
    """LMCache's protocol on one ROUTER socket, until :meth:`request_stop`."""

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
    ) -> None:
        self.handlers = handlers
        self.stats: FrontendStats = handlers.shared.stats
        self.name = name
        self.drain_timeout_s = drain_timeout_s
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.setsockopt(zmq.LINGER, 500)
        self.socket.setsockopt(zmq.RCVTIMEO, int(self.SWEEP_INTERVAL_S * 1000))
        if "[" in endpoint:
            self.socket.setsockopt(zmq.IPV6, 1)
        # The wake-up DEALER connects before the public endpoint exists, so the first
        # message the ROUTER receives is its greeting: that is how its identity is known.
        inproc = f"inproc://tiers-lmcache-mp-wake-{next(_instances)}"
        self.socket.bind(inproc)
        self._waker = self._context.socket(zmq.DEALER)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.connect(inproc)
        self._waker.send(b"")
        self._wake_identity = self.socket.recv()
        self.socket.recv()
        self._waker_lock = threading.Lock()
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets(0)
            raise OSError(exc.errno, f"cannot listen on {endpoint}: {exc.strerror}") from None
        raw = self.socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tiers-lmcache-mp")
        self._completions: collections.deque[_Completion] = collections.deque()
        self._in_pool = 0
        self._stop_requested = False
        self._force_stop = False
        self.draining = False
        self.heartbeat = time.monotonic()
        self._budget = _LineBudget(LOG_LINES_PER_SECOND)

    # -- control ---------------------------------------------------------------------------

    def request_stop(self, *, force: bool = False) -> None:
        """Begin a stop; safe from a signal handler (a flag, and a non-blocking wake-up)."""
        self._stop_requested = True
        if force:
            self._force_stop = True
        if self._waker_lock.acquire(blocking=False):
            try:
                self._waker.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # closed or full: the receive timeout gets there
            finally:
                self._waker_lock.release()

    def _wake(self) -> None:
        with self._waker_lock, contextlib.suppress(zmq.ZMQError):
            self._waker.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Release the sockets of a loop that will not run."""
        self._pool.shutdown(wait=False)
        self._close_sockets(0)

    def _close_sockets(self, linger: int | None = None) -> None:
        with self._waker_lock:
            self._waker.close(0)
        bound = getattr(self, "endpoint", "")
        self.socket.close(linger)
        self._context.term()
        if bound.startswith("ipc://"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(bound[len("ipc://") :])

    # -- the loop --------------------------------------------------------------------------

    def serve(self) -> None:
        next_sweep = time.monotonic() + self.SWEEP_INTERVAL_S
        drain_deadline = 0.0
        try:
            while True:
                self._receive_one()
                if self._completions:
                    self._finish_completions()
                now = time.monotonic()
                self.heartbeat = now
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + self.SWEEP_INTERVAL_S
                if self._stop_requested and not self.draining:
                    self.draining = True
                    self.handlers.shared.stopping.set()  # waits in the pool end early
                    drain_deadline = now + self.drain_timeout_s
                    logger.info("%s stopping: refusing new requests, %d in flight", self.name, self._in_pool)
                if self.draining and (self._in_pool == 0 or now >= drain_deadline or self._force_stop):
                    break
        finally:
            self._shutdown()

    def _sweep(self, now: float) -> None:
        try:
            self.handlers.sweep(now)
            self.stats.pool_tasks = self._in_pool
        except Exception:
            logger.exception("%s: periodic maintenance failed", self.name)

    def _shutdown(self) -> None:
        if self._in_pool:
            logger.warning(
                "%s: abandoning %d requests still running at the drain deadline", self.name, self._in_pool
            )
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.handlers.release_everything()
        except Exception:
            logger.exception("%s: releasing client locks at shutdown failed", self.name)
        self._close_sockets()

    def _receive_one(self) -> None:
        sock = self.socket
        try:
            part = sock.recv(copy=False)
        except zmq.Again:
            return  # receive timeout: time for housekeeping
        except zmq.ZMQError as exc:
            logger.warning("%s: receive failed: %s", self.name, exc)
            return
        frames = [part.bytes]
        more = part.more
        while more:  # parts of one message arrive together: these receives do not block
            part = sock.recv(copy=False)
            more = part.more
            if len(frames) < MAX_FRAMES:
                frames.append(part.bytes)
            elif len(frames) == MAX_FRAMES:
                frames.append(b"")  # marks the message as over the frame limit
        if frames[0] == self._wake_identity:
            return
        if len(frames) < 3:
            self._unanswered(
                "?",
                peek_uid(frames[1]) if len(frames) > 1 else "?",
                "",
                "mp_bad_request",
                f"{len(frames)} frames: no uid or no op frame",
            )
            return
        if len(frames) > MAX_FRAMES:
            self._unanswered("?", peek_uid(frames[1]), "", "mp_bad_request", f"more than {MAX_FRAMES} frames")
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
            self._unanswered("?", peek_uid(uid), "", "mp_unknown_op", str(exc))
            return
        if name not in self.handlers.table:
            if name in NOT_SERVED:
                self.stats.requests[name] += 1
                self._unanswered(name, peek_uid(uid), "", "mp_not_served", NOT_SERVED[name])
            else:  # one label for all: a client must not grow /metrics with made-up names
                self.stats.requests["unknown"] += 1
                message = "not an operation of LMCache's protocol"
                self._unanswered(name[:64], peek_uid(uid), "", "mp_unknown_op", message)
            return
        self.stats.requests[name] += 1
        if self.draining:
            self._unanswered(name, peek_uid(uid), "", "mp_shutting_down", "the server is shutting down")
            return
        try:
            args = decode_arguments(name, arg_frames)
            result = self.handlers.dispatch(name, args)
        except Exception as exc:
            self._failed(name, uid, arg_frames, exc)
            return
        if isinstance(result, Deferred):
            self._submit(identity, uid, op, name, arg_frames, result)
        else:
            self._send(identity, uid, op, result)

    # -- pool hand-off ---------------------------------------------------------------------

    def _submit(
        self, identity: bytes, uid: bytes, op: bytes, name: str, arg_frames: list[bytes], deferred: Deferred
    ) -> None:
        def run() -> None:
            try:
                item: _Completion = (identity, uid, op, name, arg_frames, deferred.work(), None)
            except BaseException as exc:
                item = (identity, uid, op, name, arg_frames, None, exc)
            self._completions.append(item)
            self._wake()

        self._in_pool += 1
        self._pool.submit(run)

    def _finish_completions(self) -> None:
        while self._completions:
            identity, uid, op, name, arg_frames, finish, error = self._completions.popleft()
            self._in_pool -= 1
            if finish is not None:
                try:
                    self._send(identity, uid, op, finish())
                    continue
                except Exception as exc:
                    error = exc
            assert error is not None
            self._failed(name, uid, arg_frames, error)

    # -- replying --------------------------------------------------------------------------

    def _failed(self, name: str, uid: bytes, arg_frames: list[bytes], exc: BaseException) -> None:
        if isinstance(exc, RequestRefused):
            reason = exc.reason
        elif isinstance(exc, KeyValidationError | ValueError):
            reason = "mp_bad_request"
        else:
            reason = "mp_handler_error"
            logger.error("%s: %s (uid %s) raised", self.name, name, peek_uid(uid), exc_info=exc)
        self._unanswered(
            name, peek_uid(uid), _request_id(name, arg_frames), reason, str(exc) or type(exc).__name__
        )

    def _unanswered(self, name: str, uid: str, request_id: str, reason: str, message: str) -> None:
        self.stats.failure(reason)
        log, held = self._budget.take()
        if not log:
            return
        earlier = f" ({held} more not logged)" if held else ""
        # Names and ids come from clients: escaped, so they cannot forge log lines.
        ids = f"uid {printable(uid)}" + (f", request_id {printable(request_id)}" if request_id else "")
        logger.warning(
            "%s: %s (%s) not answered, as LMCache's server would not: %s [%s]%s",
            self.name,
            printable(name, 64),
            ids,
            printable(message, 300),
            reason,
            earlier,
        )

    def _send(self, identity: bytes, uid: bytes, op: bytes, result: Any) -> None:
        sock = self.socket
        try:
            sock.send(identity, _SNDMORE_NOBLOCK)
            sock.send(uid, _SNDMORE_NOBLOCK)
            if result is None:
                sock.send(op, _NOBLOCK)
                return
            payload = encode_reply(result)
            sock.send(op, _SNDMORE_NOBLOCK)
            sock.send(payload, _NOBLOCK, copy=len(payload) < 65536)
        except zmq.Again:
            self.stats.failure("reply_dropped")
            logger.warning(
                "%s: dropped a reply to %s: it is not reading its replies", self.name, identity.hex()
            )
        except zmq.ZMQError as exc:
            self.stats.failure("reply_dropped")
            if exc.errno == errno.EHOSTUNREACH:
                logger.info("%s: dropped a reply to %s: the client is gone", self.name, identity.hex())
            else:
                logger.warning("%s: dropped a reply to %s: %s", self.name, identity.hex(), exc)


def _request_id(name: str, arg_frames: list[bytes]) -> str:
    """The request id of a request, for log lines (best effort: the frames may be junk)."""
    if not arg_frames:
        return ""
    try:
        if name in ("query_prefetch_status", "wait_prefetch_status", "end_session"):
            return _TEXT.decode(arg_frames[0])[:80]
        return _KEY.decode(arg_frames[0]).request_id[:80]
    except (msgspec.DecodeError, RecursionError):
        return ""


_TEXT = msgspec.msgpack.Decoder(str)
_KEY = msgspec.msgpack.Decoder(CacheKey)
