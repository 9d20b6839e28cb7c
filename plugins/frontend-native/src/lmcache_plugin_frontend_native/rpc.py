"""The RPC loop: one ZeroMQ ROUTER socket, one loop thread, a small pool for blocking work.

ZeroMQ sockets are not thread-safe, so only the loop thread receives and sends on the
ROUTER.  The loop blocks in a plain ``recv`` (with a receive timeout for housekeeping):
on small VMs that is about twice as fast per request as polling the socket next to other
file descriptors.  Pool threads therefore hand finished work back through a queue and
wake the loop with an empty message from an in-process DEALER connected to the same
ROUTER, whose identity the loop recognises.

Every input is bounded before it is trusted -- frame size (ZMQ_MAXMSGSIZE drops the peer),
header size, frame count, total request size -- and every failure to decode or serve a
request becomes an error reply, or a log line when the reply cannot be routed.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import hmac
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from lmcache_plugin_frontend_native.handlers import Deferred, Frames, Handlers, Response, error_for
from lmcache_tiers.wire import protocol as p

logger = logging.getLogger(__name__)

_instances = itertools.count()

_Completion = tuple[bytes, int, Deferred, "Callable[[], Response] | None", "BaseException | None"]

# Plain ints: pyzmq's flags are Python enums, and combining them (``SNDMORE | NOBLOCK``)
# runs enum code costing about a microsecond per request on the loop thread.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
# The backend's send, without the sugar wrapper (which only adds routing_id/group support,
# for socket types this server does not use): half a microsecond per frame saved.
_raw_send = zmq.backend.Socket.send


class RpcServer:
    """Serves :class:`Handlers` on a ROUTER socket until :meth:`request_stop`."""

    #: housekeeping period, and the longest a stop request waits to be noticed
    SWEEP_INTERVAL_S = 0.2

    def __init__(
        self,
        handlers: Handlers,
        endpoint: str,
        *,
        auth_token: str | None = None,
        pool_workers: int = 8,
        max_frame_bytes: int = 256 << 20,
        max_request_bytes: int = 1 << 30,
        drain_timeout_s: float = 10.0,
    ) -> None:
        self.handlers = handlers
        self.stats = handlers.stats
        self._token = auth_token.encode() if auth_token else None
        self.max_request_bytes = max_request_bytes
        self.max_frames = p.MAX_KEYS_PER_REQUEST
        self.drain_timeout_s = drain_timeout_s
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.ROUTER)
        # Unroutable replies raise instead of vanishing, so a vanished client is logged.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer sending a frame over the limit is disconnected by libzmq before the
        # frame is ever buffered in full.
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.setsockopt(zmq.LINGER, 500)
        self.socket.setsockopt(zmq.RCVTIMEO, int(self.SWEEP_INTERVAL_S * 1000))
        if "[" in endpoint:
            self.socket.setsockopt(zmq.IPV6, 1)
        # The wake-up socket connects before the public endpoint exists, so the first
        # message the ROUTER ever receives is its greeting: that is how its identity is known.
        inproc = f"inproc://tiers-rpc-wake-{next(_instances)}"
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
        self._pool = ThreadPoolExecutor(max_workers=pool_workers, thread_name_prefix="tiers-rpc")
        self._completions: collections.deque[_Completion] = collections.deque()
        self._in_pool = 0
        self._stop_requested = False
        self._force_stop = False
        self.draining = False
        self.heartbeat = time.monotonic()

    # -- control ---------------------------------------------------------------------------

    def request_stop(self, *, force: bool = False) -> None:
        """Begin a graceful stop (``force``: stop waiting for in-flight work).

        Safe from a signal handler: the flag alone is enough (the loop looks at it at least
        every receive timeout); the wake-up message only makes it immediate, and is skipped
        rather than waited for when a pool thread holds the wake-up socket.
        """
        self._stop_requested = True
        if force:
            self._force_stop = True
        if self._waker_lock.acquire(blocking=False):
            try:
                self._waker.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # closed or full: the receive timeout still gets there
            finally:
                self._waker_lock.release()

    def _wake(self) -> None:
        with self._waker_lock:
            try:
                self._waker.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # a queue of wake-ups is already pending, or the server is closing

    def close(self) -> None:
        """Release the socket of a server that will not serve (start-up failed later on)."""
        self._pool.shutdown(wait=False)
        self._close_sockets(0)

    def _close_sockets(self, linger: int | None = None) -> None:
        with self._waker_lock:
            self._waker.close(0)
        bound = getattr(self, "endpoint", "")
        # No unbind first: unbinding also drops the connections accepted on the endpoint,
        # and with them replies still queued for sending (the last answers of a drain).
        # Closing with a linger flushes those, then releases the port.
        self.socket.close(linger)
        self._context.term()
        if bound.startswith("ipc://"):
            # libzmq leaves the socket file behind; nobody can connect to it any more.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(bound[len("ipc://") :])

    # -- the loop --------------------------------------------------------------------------

    def serve(self) -> None:
        """Run until a stop is requested and in-flight work is finished or abandoned."""
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
                    self._begin_drain()
                    drain_deadline = now + self.drain_timeout_s
                if self.draining and (self._in_pool == 0 or now >= drain_deadline or self._force_stop):
                    break
        finally:
            self._shutdown()

    def _begin_drain(self) -> None:
        self.draining = True
        self.handlers.stopping.set()  # cancels prefetch waits in the pool
        logger.info("stopping: refusing new requests, %d in flight", self._in_pool)

    def _sweep(self, now: float) -> None:
        try:
            self.handlers.collect_prefetches(now)
            self.handlers.sessions.sweep(now)
            self.handlers.refresh_gauges()
            self.stats.pool_tasks = self._in_pool
        except Exception:
            logger.exception("periodic maintenance failed")

    def _shutdown(self) -> None:
        if self._in_pool:
            logger.warning("abandoning %d requests still running at the drain deadline", self._in_pool)
        self._pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.handlers.release_everything()
        except Exception:
            logger.exception("releasing client locks at shutdown failed")
        self._close_sockets()

    # -- receiving -------------------------------------------------------------------------

    def _receive_one(self) -> None:
        """Receive and handle one message, or return at the receive timeout."""
        sock = self.socket
        # Frames rather than bytes: a frame carries its "more" flag, where getsockopt
        # (RCVMORE) would run pyzmq's Python-level option lookup for every part.
        try:
            part = sock.recv(copy=False)
        except zmq.Again:
            return  # receive timeout: time for housekeeping
        except zmq.ZMQError as exc:
            logger.warning("receive failed: %s", exc)
            return
        identity: bytes = part.bytes
        if not part.more:
            logger.warning("dropped a request from %s with no header frame", identity.hex())
            self.stats.failure("dropped")
            return
        # Parts of a multipart message arrive together, so these receives cannot block.
        part = sock.recv(copy=False)
        header: bytes = part.bytes
        more = part.more
        frames: list[Any] = []
        total = len(header)
        too_large = total > p.MAX_HEADER_BYTES
        while more:
            frame = sock.recv(copy=False)
            more = frame.more
            total += len(frame)
            if too_large:
                continue  # keep draining the message, holding nothing
            if len(frames) >= self.max_frames or total > self.max_request_bytes:
                too_large = True
                frames.clear()
                continue
            frames.append(frame)
        if identity == self._wake_identity:
            return  # a pool thread finished something; the loop collects it next
        self._handle(identity, header, frames, too_large, total)

    def _handle(self, identity: bytes, header: bytes, frames: Frames, too_large: bool, total: int) -> None:
        if too_large and len(header) > p.MAX_HEADER_BYTES:
            # Not decoded, but its id is readable: the caller learns at once, not at its timeout.
            message = f"request header of {len(header)} bytes is over the {p.MAX_HEADER_BYTES}-byte limit"
            self._fail(identity, p.peek_request_id(header), p.ErrorCode.TOO_LARGE, message)
            return
        try:
            request = p.request_decoder.decode(header)
        except Exception as exc:  # any undecodable input: msgspec errors, recursion limits
            req_id, code = p.diagnose_undecodable(header)
            self._fail(identity, req_id, code, f"cannot decode request: {str(exc)[:200]}")
            return
        if self._token is not None and not hmac.compare_digest(request.token.encode(), self._token):
            self._fail(identity, request.req_id, p.ErrorCode.UNAUTHORIZED, "missing or wrong auth token")
            return
        if too_large:
            self._fail(
                identity,
                request.req_id,
                p.ErrorCode.TOO_LARGE,
                f"request of {total} bytes / {len(frames)} frames is over the limit "
                f"({self.max_request_bytes} bytes, {self.max_frames} frames)",
            )
            return
        if self.draining:
            self._fail(identity, request.req_id, p.ErrorCode.SHUTTING_DOWN, "server is shutting down")
            return
        self.stats.requests[type(request).__name__] += 1
        try:
            result = self.handlers.dispatch(request, identity, frames)
        except Exception as exc:
            self._fail_with(identity, request.req_id, exc)
            return
        if isinstance(result, Deferred):
            self._submit(identity, request.req_id, result)
        else:
            self._send(identity, *result)

    # -- pool hand-off ---------------------------------------------------------------------

    def _submit(self, identity: bytes, req_id: int, deferred: Deferred) -> None:
        def run() -> None:
            try:
                item: _Completion = (identity, req_id, deferred, deferred.work(), None)
            except BaseException as exc:
                item = (identity, req_id, deferred, None, exc)
            self._completions.append(item)
            self._wake()

        self._in_pool += 1
        self._pool.submit(run)

    def _finish_completions(self) -> None:
        while self._completions:
            identity, req_id, deferred, finish, error = self._completions.popleft()
            self._in_pool -= 1
            if deferred.cleanup is not None:
                deferred.cleanup()
            if finish is not None:
                try:
                    reply, payloads = finish()
                except Exception as exc:
                    error = exc
                else:
                    self._send(identity, reply, payloads)
                    continue
            assert error is not None
            self._fail_with(identity, req_id, error)

    # -- replying --------------------------------------------------------------------------

    def _fail_with(self, identity: bytes, req_id: int, exc: BaseException) -> None:
        code, message = error_for(exc)
        if code is p.ErrorCode.INTERNAL:
            logger.error("request %d from %s failed", req_id, identity.hex(), exc_info=exc)
        self._fail(identity, req_id, code, message)

    def _fail(self, identity: bytes, req_id: int, code: p.ErrorCode, message: str) -> None:
        self.stats.failure(code.name.lower())
        logger.debug("error reply to %s (request %d): %s %s", identity.hex(), req_id, code.name, message)
        self._send(identity, p.ErrorReply(req_id, code.value, message), ())

    def _send(self, identity: bytes, reply: p._Reply, payloads: Frames) -> None:
        sock = self.socket
        header = p.encoder.encode(reply)
        try:
            _raw_send(sock, identity, _SNDMORE_NOBLOCK)
            if not payloads:
                _raw_send(sock, header, _NOBLOCK)
                return
            _raw_send(sock, header, _SNDMORE_NOBLOCK)
            last = len(payloads) - 1
            for index, payload in enumerate(payloads):
                sock.send(payload, _SNDMORE_NOBLOCK if index < last else _NOBLOCK, copy=False)
        except zmq.Again:
            self.stats.failure("reply_dropped")
            logger.warning("dropped a reply to %s: it is not reading its replies", identity.hex())
        except zmq.ZMQError as exc:
            self.stats.failure("reply_dropped")
            if exc.errno == errno.EHOSTUNREACH:
                logger.info("dropped a reply to %s: the client is gone", identity.hex())
            else:
                logger.warning("dropped a reply to %s: %s", identity.hex(), exc)
