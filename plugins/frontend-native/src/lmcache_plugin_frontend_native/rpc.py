"""The native RPC loop: decode each request, dispatch it, encode the reply.

The socket, the loop thread, the pool and the wake-ups are core's
:class:`~lmcache_tiers.router.RouterLoop`; this module receives the native protocol's
frames.  Every input is bounded before it is trusted -- frame size (ZMQ_MAXMSGSIZE drops
the peer), header size, frame count, total payload size -- and every failure to decode
or serve a request becomes an error reply, or a log line when the reply cannot be routed.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Any

import zmq

from lmcache_plugin_frontend_native.handlers import (
    Deferred,
    Finish,
    Frames,
    Handed,
    Handlers,
    Response,
    error_for,
)
from lmcache_tiers.plugin import BurstLog, KeyCache, RouterLoop, decode_request
from lmcache_tiers.plugin import wire_protocol as p

logger = logging.getLogger(__name__)

_raw_recv = zmq.backend.Socket.recv


class RpcServer:
    """Serves :class:`Handlers` on a ROUTER socket until :meth:`request_stop`."""

    #: housekeeping period, and the longest a stop request waits to be noticed; shorter
    #: under short TTLs (a quarter of the shortest the sweep enforces, at least 0.05 s), so
    #: that a prefetch result is given back before L1 reaps its locks
    SWEEP_INTERVAL_S = 0.2

    def __init__(
        self,
        handlers: Handlers,
        endpoint: str,
        *,
        name: str = "native",
        auth_token: str | None = None,
        pool_workers: int = 8,
        max_frame_bytes: int = 256 << 20,
        max_request_bytes: int = 1 << 30,
        drain_timeout_s: float = 10.0,
        max_pool_bytes: int | None = None,
    ) -> None:
        self.handlers = handlers
        self.stats = handlers.stats
        self._token = auth_token.encode() if auth_token else None
        self.max_request_bytes = max_request_bytes
        self.max_frames = handlers.max_keys  # a STORE_INLINE carries a frame per key
        # The loop thread's: every request is decoded there.  A LOOKUP's new keys are left
        # undecoded only where a miss at the first key is found without asking about the
        # others: no L2 adapter, or every one answering lookups at once (from memory), as
        # the prefetch controller then asks about that key alone.  An adapter that cannot
        # would be asked about every key, and the list proven valid on top of decoding it.
        self._keys = KeyCache(
            lazy_lookups=all(adapter.answers_lookups_now for adapter in handlers.storage.adapters)
        )
        self._refusals = BurstLog(logger)
        self._expired_reservations = BurstLog(logger, "store_reservation_expired")
        sessions = handlers.sessions
        self.router = RouterLoop(
            endpoint,
            name=name,
            stats=self.stats,
            pool_workers=pool_workers,
            max_frame_bytes=max_frame_bytes,
            sweep_interval_s=self.SWEEP_INTERVAL_S,
            sweep_ttls=(sessions.result_ttl_s, sessions.lock_ttl_s, sessions.write_ttl_s),
            drain_timeout_s=drain_timeout_s,
            max_pool_bytes=max_pool_bytes,
        )
        self.socket = self.router.socket
        self.endpoint = self.router.endpoint

    @property
    def draining(self) -> bool:
        return self.router.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.router.draining = value

    @property
    def heartbeat(self) -> float:
        return self.router.heartbeat

    def request_stop(self, *, force: bool = False) -> None:
        """Begin a graceful stop; safe from a signal handler (see RouterLoop)."""
        self.router.request_stop(force=force)

    def close(self) -> None:
        """Release the socket of a server that will not serve (start-up failed later on)."""
        self.router.close()

    def start(self, on_failure: Callable[[BaseException], None]) -> None:
        """Serve on the loop's thread until a stop is requested and in-flight work is
        finished or abandoned."""
        self.router.start(
            self._receive_one,
            sweep=self._sweep,
            on_drain=self.handlers.stopping.set,  # cancels prefetch waits in the pool
            on_shutdown=self._shut_down,
            on_failure=on_failure,
        )

    def _shut_down(self) -> None:
        """Answer the pool's requests not answered yet (a forced stop never handles their
        completions), while the socket is still open: one that ended is counted as it
        ended, one given up on (still running, or never started) is refused
        SHUTTING_DOWN, so no client waits for its own timeout.  Only then give back what
        clients hold: the locks a wait answered here hands its client are given back with
        the rest."""
        for request in self.handlers.give_up_pool_requests():
            self._finish(request.identity, request.req_id, request.answer, request.keys)
        self.handlers.release_everything()

    def _sweep(self, now: float) -> None:
        self.handlers.collect_prefetches(now)
        self._count_expired_reservations(self.handlers.sessions.sweep(now))
        self.handlers.release_fences_of_exited_writers()

    def _count_expired_reservations(self, keys: int) -> None:
        """Reservations a client neither committed nor aborted within the write TTL (it went
        away, or is too slow), forgotten by the sweep: counted per key, one line per sweep
        at most (per burst).  L1 frees them at its own deadline (``l1_lock_expired``)."""
        if not keys:
            return
        self.stats.failure("store_reservation_expired", keys)
        self._expired_reservations.event(
            keys,
            f"store reservations left uncommitted past the write TTL "
            f"({self.handlers.sessions.write_ttl_s:g}s) were forgotten; a later commit of them "
            "stores nothing",
        )

    # -- receiving -------------------------------------------------------------------------

    def _receive_one(self) -> None:
        """Receive and handle one message, or return at the receive timeout."""
        sock = self.socket
        # The identity as bytes, the header as a Frame whose ``more`` reads the message's
        # own flag: a getsockopt(RCVMORE) costs more than the receive, since pyzmq turns
        # the option into an enum member in Python on every call.  Payload frames stay
        # Frames, not copied.
        try:
            identity: bytes = _raw_recv(sock)
        except zmq.Again:
            return  # receive timeout: time for housekeeping
        except zmq.ZMQError as exc:
            logger.warning("receive failed: %s", exc)
            return
        # A ROUTER hands every message over behind its sender's identity, and a message has
        # at least one frame: a header follows.  Parts of a multipart message arrive
        # together, so these receives cannot block.
        first = _raw_recv(sock, 0, False)
        header: bytes = first.bytes
        more = first.more
        frames: list[Any] = []
        # The header has a limit of its own; the request limit bounds the payload frames,
        # so that a batch whose payloads reach the advertised inline limit is taken whatever
        # its header adds.
        total = 0
        too_large = len(header) > p.MAX_HEADER_BYTES
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
        if self.router.is_waker(identity):
            return  # a pool thread finished something; the loop collects it next
        # Kept for the handlers while they handle it: the connection's process is asked of
        # the kernel off this frame's descriptor, which is another connection's once it closes.
        handlers = self.handlers
        handlers.source = first
        try:
            self._handle(identity, header, frames, too_large, total)
        finally:
            handlers.source = None

    def _handle(self, identity: bytes, header: bytes, frames: Frames, too_large: bool, total: int) -> None:
        if too_large and len(header) > p.MAX_HEADER_BYTES:
            # Not decoded, but its id is readable: the caller learns at once, not at its timeout.
            message = f"request header of {len(header)} bytes is over the {p.MAX_HEADER_BYTES}-byte limit"
            self._fail(identity, p.peek_request_id(header), p.ErrorCode.TOO_LARGE, message)
            return
        try:
            request = decode_request(header, self._keys)
        except Exception as exc:  # any undecodable input: msgspec errors, recursion limits
            req_id, code = p.diagnose_undecodable(header)
            self._fail(identity, req_id, code, f"cannot decode request: {str(exc)[:200]}")
            return
        # A refusal also counts the keys it leaves unstored (``_store_keys``), worked out
        # there: most requests are served, and name none.
        if self._token is not None and not hmac.compare_digest(request.token.encode(), self._token):
            self._fail(
                identity,
                request.req_id,
                p.ErrorCode.UNAUTHORIZED,
                "missing or wrong auth token",
                _store_keys(request),
            )
            return
        if too_large:
            self._fail(
                identity,
                request.req_id,
                p.ErrorCode.TOO_LARGE,
                f"request with {total} payload bytes is over the limit "
                f"({self.max_request_bytes} bytes, {self.max_frames} frames)",
                _store_keys(request),
            )
            return
        if self.draining:
            self._fail(
                identity,
                request.req_id,
                p.ErrorCode.SHUTTING_DOWN,
                "server is shutting down",
                _store_keys(request),
            )
            return
        self.stats.requests[type(request).__name__] += 1
        try:
            result = self.handlers.dispatch(request, identity, frames)
        except Exception as exc:
            self._fail_with(identity, request.req_id, exc, _store_keys(request))
            return
        if isinstance(result, Deferred):
            self._submit(identity, request, result, len(header) + total)
        else:
            self._answer(identity, result)

    # -- pool hand-off ---------------------------------------------------------------------

    def _submit(self, identity: bytes, request: p._Request, deferred: Deferred, message_bytes: int) -> None:
        def done(finish: Finish | None, error: BaseException | None) -> None:
            if deferred.cleanup is not None:
                deferred.cleanup()
            if finish is not None:
                self._finish(identity, request.req_id, finish, _store_keys(request))
                return
            assert error is not None
            self._fail_with(identity, request.req_id, error, _store_keys(request))

        # Every pool request is a PoolRequest: the stop counts those it gives up on.
        self.router.submit(deferred.work, done, counted_at_stop=True, message_bytes=message_bytes)

    def _finish(self, identity: bytes, req_id: int, finish: Finish, store_keys: int) -> None:
        """Send what ``finish`` builds (nothing for None: answered already), or refuse the
        request with the error it raises -- an error the pool's work met."""
        try:
            result = finish()
        except BaseException as exc:
            self._fail_with(identity, req_id, exc, store_keys)
            return
        if result is not None:
            self._answer(identity, result)

    # -- replying --------------------------------------------------------------------------

    def _answer(self, identity: bytes, answer: Response) -> None:
        sent = self._send(identity, *answer)
        handlers = self.handlers
        handing = handlers.handing
        if handing is not None:  # a LOOKUP's read locks (``Handlers.handing``)
            handlers.handing = None
            if not sent:
                handlers.locks_undelivered(handing)
        elif not sent and isinstance(answer, Handed):
            answer.undelivered()  # its client never learns of what it hands over

    def _fail_with(self, identity: bytes, req_id: int, exc: BaseException, store_keys: int = 0) -> None:
        code, message = error_for(exc)
        if code is p.ErrorCode.INTERNAL:
            logger.error("request %d from %s failed", req_id, identity.hex(), exc_info=exc)
        self._fail(identity, req_id, code, message, store_keys)

    def _fail(
        self, identity: bytes, req_id: int, code: p.ErrorCode, message: str, store_keys: int = 0
    ) -> None:
        """Refuse a request: counted by its code, and ``store_keys`` (the keys a refused
        STORE named, none stored) by the same code among the refused store keys."""
        self.stats.failure(code.name.lower())
        if store_keys:
            self.stats.store_keys_refused[code.name.lower()] += store_keys
        if code is p.ErrorCode.INTERNAL:  # logged with its traceback where it was raised
            logger.debug("error reply to %s (request %d): %s %s", identity.hex(), req_id, code.name, message)
        else:
            # Each counter is explained in the log, at most once a minute per code: a
            # misbehaving client cannot flood it.
            self._refusals.warn(
                code.name, "refused request %d from %s: %s %s", req_id, identity.hex(), code.name, message
            )
        self._send(identity, p.ErrorReply(req_id, code.value, message), ())

    def _send(self, identity: bytes, reply: p._Reply, payloads: Frames) -> bool:
        """Send ``reply``; False when its client does not get it: it could not be sent
        (``RouterLoop.send`` counted and logged that), or encoded (an error goes instead)."""
        try:
            header = p.encoder.encode(reply)
        except Exception as exc:
            # A value msgpack has no encoding for: raised here it would end the loop (or,
            # from the pool, leave the caller waiting); the caller is told instead.
            logger.error("cannot encode the %s to %s", type(reply).__name__, identity.hex(), exc_info=exc)
            self.stats.failure(p.ErrorCode.INTERNAL.name.lower())
            message = f"the {type(reply).__name__} could not be encoded: {exc}"
            header = p.encoder.encode(p.ErrorReply(reply.req_id, p.ErrorCode.INTERNAL.value, message))
            self.router.send([identity, header])
            return False
        return self.router.send([identity, header, *payloads])


def _store_keys(request: p._Request) -> int:
    """How many keys a request names to be stored: those of a STORE_RESERVE or STORE_INLINE
    (a commit or abort names keys already counted by their reservation)."""
    if isinstance(request, (p.StoreReserve, p.StoreInline)):
        return len(request.keys)
    return 0
