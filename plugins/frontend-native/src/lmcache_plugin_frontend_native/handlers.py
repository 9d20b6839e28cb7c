"""Request handlers: turn each decoded request into StorageManager calls and a reply.

Cheap requests (everything that only takes the L1 lock briefly) are answered on the
server's loop thread, which is what keeps LOOKUP round trips short.  Requests that may
block or copy a lot -- waiting for a prefetch (WAIT_PREFETCH_STATUS, or a LOOKUP with
``wait_s`` that has to go to L2), inline stores and retrieves, CLEAR -- return
a :class:`Deferred`: its ``work`` runs on a small thread pool and returns a ``finish``
callable that the loop thread runs to update per-client state and build the reply, so
every mutation of sessions and stats stays on one thread.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from lmcache_plugin_frontend_native.sessions import (
    FENCED_SHARE_OF_L1_ALL_CLIENTS,
    PendingPrefetch,
    Session,
    SessionTable,
)
from lmcache_plugin_frontend_native.unsent import UnsentInlineBytes
from lmcache_plugin_frontend_native.writers import WriterProcesses
from lmcache_tiers.plugin import (
    BurstLog,
    FrontendStats,
    KeyValidationError,
    L1Loan,
    L1OutOfMemoryError,
    ObjectKey,
    TensorLayout,
    __version__,
    copy_into,
)
from lmcache_tiers.plugin import wire_protocol as p

logger = logging.getLogger(__name__)

#: a client's expired reservations it may still copy into stay fenced up to this share of
#: L1 (1/8); past it its new shared-memory stores are refused until it commits or aborts them
FENCED_SHARE_OF_L1 = 8

#: payload frames as they come off the socket (zmq.Frame) or go onto it (bytes-likes)
Frames = Sequence[Any]
Response = tuple[p._Reply, Frames]


class Handed(tuple[p._Reply, Frames]):
    """A reply (a :data:`Response`) that hands its client something held for it which
    the client learns of from this reply alone (read locks, reservations, a prefetch's
    handle), with what gives that back when the reply cannot be sent (the client is gone,
    or not reading its replies): a client that never got it never releases, commits,
    aborts or collects it."""

    undelivered: Callable[[], None]

    def __new__(cls, reply: p._Reply, payloads: Frames, undelivered: Callable[[], None]) -> Handed:
        handed = super().__new__(cls, (reply, payloads))
        handed.undelivered = undelivered
        return handed


#: run on the loop thread once a Deferred's work is over: its reply, or None when there is
#: nothing left to send (the stop answered the request already)
Finish = Callable[[], Response | None]

#: the answer to a pool request the stop gave up on (still running, or never started)
GIVEN_UP = "server is shutting down: the request was given up at the stop"

#: the random base of the prefetch handles clients are told is below 2**62: a handle
#: stays within the protocol's 63 bits for 2**62 prefetches
_HANDLE_BASE_BITS = 62

#: the largest pid a HELLO may report: what ``pid_t`` holds.  The pid is kept for the
#: connection's STORE_RESERVEs, which open a pidfd on it: one past this made that raise
#: OverflowError mid-request, after L1 had fenced the reservations no session then held
_PID_MAX = (1 << 31) - 1


class HandlerError(Exception):
    """A request that is well-formed but cannot be served; becomes an ErrorReply."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Deferred:
    """Work for the pool; ``work()`` returns the loop-thread finisher producing the reply."""

    work: Callable[[], Finish]
    kind: str
    #: runs on the loop thread once the work is over, whether it succeeded or raised
    cleanup: Callable[[], None] | None = None


class StorageLike(Protocol):
    """What the server uses of :class:`lmcache_tiers.storage.StorageManager`."""

    @property
    def l1(self) -> Any: ...

    @property
    def adapters(self) -> Sequence[Any]: ...

    def reserve_write(
        self, keys: Sequence[ObjectKey], sizes: Sequence[int], layouts: Sequence[str] | None = None
    ) -> dict[ObjectKey, Any]: ...

    # Reservations are committed and aborted by the objects reserve_write gave, never by
    # key: a key L1 reaped may be another writer's by then.
    def commit_reserved(self, reserved: Any, *, to_l2: bool = True) -> list[ObjectKey]: ...

    def abort_reserved(self, reserved: Any) -> None: ...

    def submit_prefetch(self, keys: Sequence[ObjectKey], *, readers: int = 1) -> int: ...

    def start_prefetch(
        self, keys: Sequence[ObjectKey], *, readers: int = 1, owner_expires: bool = False
    ) -> tuple[int, list[ObjectKey] | None]: ...

    def query_prefetch(self, handle: int) -> int | None: ...

    def wait_prefetch(self, handle: int, timeout: float) -> int | None: ...

    def discard_prefetch(self, handle: int) -> None: ...

    def read(self, keys: Sequence[ObjectKey], *, generations: list[int] | None = None) -> list[Any]: ...

    def lend(self, obj: Any, *, fill: bool = False) -> L1Loan: ...

    def read_object(self, obj: Any, out: memoryview) -> None: ...

    def write_object(self, obj: Any, data: memoryview) -> None: ...

    def release(self, keys: Sequence[ObjectKey], count: int = 1) -> None: ...

    def clear(self, *, force: bool = False) -> int: ...

    def evict(self, keys: Sequence[ObjectKey]) -> int: ...

    def status(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DataPlane:
    """What HELLO tells clients about the shared-memory segment ("" name: inline only)."""

    shm_name: str = ""
    shm_size: int = 0
    shm_device: int = 0
    shm_inode: int = 0
    generation_offset: int = 0
    generation_block: int = 0
    #: where the segment file is ("": /dev/shm)
    shm_dir: str = ""


class Handlers:
    """Dispatch table from request type to handler, plus the shared state they use."""

    #: how long one blocking wait in the pool lasts before it re-checks for shutdown
    WAIT_SLICE_S = 0.2

    def __init__(
        self,
        storage: StorageLike,
        *,
        chunk_size: int,
        data_plane: DataPlane,
        stats: FrontendStats,
        status_provider: Callable[[], dict[str, Any]],
        max_inline_bytes: int,
        max_keys: int = p.MAX_KEYS_PER_REQUEST,
    ) -> None:
        self.storage = storage
        self.max_keys = max_keys
        self.chunk_size = chunk_size
        self.data_plane = data_plane
        self.stats = stats
        self.status_provider = status_provider
        self.max_inline_bytes = max_inline_bytes
        self.unsent_inline = UnsentInlineBytes(max_inline_bytes)
        l1 = storage.l1
        #: fenced bytes (``Session.fenced``) past which a client's new shared-memory stores
        #: are refused: what a client that never comes back keeps out of L1
        self.fenced_bytes_per_client = max(1, int(l1.capacity_bytes) // FENCED_SHARE_OF_L1)
        self.writers = WriterProcesses(
            data_plane.shm_device,
            data_plane.shm_inode,
            lambda identity: self.sessions.peek(identity) is not None,
        )
        self.sessions = SessionTable(
            float(l1.lock_ttl_s),
            float(l1.write_ttl_s),
            lock_deadline=l1.lock_deadline,
            fenced_bytes_bound=max(1, int(l1.capacity_bytes) // FENCED_SHARE_OF_L1_ALL_CLIENTS),
            fenced_bytes_per_client=self.fenced_bytes_per_client,
        )
        self.stopping = threading.Event()
        #: the first frame of the request being handled, set by the RPC loop around its
        #: dispatch (None: not known), whose ``zmq.SRCFD`` names the connection it came in on
        self.source: Any = None
        #: the read locks a LOOKUP's reply hands its client (its session, the keys, their
        #: deadline), set by ``lookup`` for the RPC loop, which takes it once the reply is
        #: sent and gives them back when it could not be (``locks_undelivered``).  A LOOKUP
        #: hit is the most frequent reply: a :class:`Handed` built for each (~1 us on
        #: the loop thread, before the send) would be used by almost none.
        self.handing: tuple[Session, list[ObjectKey], float] | None = None
        # prefetch handles a pool thread is blocked on; the sweep leaves them alone
        self._waited: set[int] = set()
        # Clients are told the storage's prefetch handles plus this random base.  The
        # storage numbers them from 1 at every start, so a handle a client kept from before
        # a restart would otherwise name a prefetch the restarted server started for that
        # client's next LOOKUP (its new connection is one session for all its threads):
        # collected, it hands over another prefetch's hit count and locks.
        self._handle_base = secrets.randbits(_HANDLE_BASE_BITS)
        self._expired_results = BurstLog(logger, "prefetch_result_expired")
        self._layout_mismatches = BurstLog(logger, "retrieve_layout_mismatch")
        self._lost_reservations = BurstLog(logger)
        self._unhanded_reservations = BurstLog(logger)
        self._expired_reservations = BurstLog(logger, "store_reservation_expired")
        self._undelivered = BurstLog(logger, "reply_dropped")
        #: requests handed to the pool and not answered yet (loop thread only)
        self._pool_requests: set[PoolRequest] = set()
        self._table: dict[type[p._Request], Callable[[Any, bytes, Frames], Response | Deferred]] = {
            p.Hello: self.hello,
            p.Ping: self.ping,
            p.Lookup: self.lookup,
            p.QueryPrefetchStatus: self.query_prefetch,
            p.WaitPrefetchStatus: self.wait_prefetch,
            p.StoreReserve: self.store_reserve,
            p.StoreCommit: self.store_commit,
            p.StoreAbort: self.store_abort,
            p.StoreInline: self.store_inline,
            p.Retrieve: self.retrieve,
            p.Release: self.release,
            p.Clear: self.clear,
            p.Status: self.status,
            p.Evict: self.evict,
        }

    def dispatch(self, request: p._Request, identity: bytes, frames: Frames) -> Response | Deferred:
        if frames and not isinstance(request, p.StoreInline):
            raise HandlerError(p.ErrorCode.INVALID_ARGUMENT, "only STORE_INLINE carries payload frames")
        keys = getattr(request, "keys", None)
        if keys is not None and len(keys) > self.max_keys:
            # Served on the loop thread, a request's keys are work every other client
            # waits behind; clients were told the limit in HELLO and split larger batches.
            raise HandlerError(
                p.ErrorCode.TOO_LARGE,
                f"the request names {len(keys)} keys, over this server's limit of {self.max_keys} "
                "per request (max_keys_per_request, told in HELLO)",
            )
        return self._table[type(request)](request, identity, frames)

    # -- handshake and trivia -------------------------------------------------------------

    def hello(self, req: p.Hello, identity: bytes, frames: Frames) -> Response:
        if req.version != p.PROTOCOL_VERSION:
            raise HandlerError(
                p.ErrorCode.VERSION_MISMATCH,
                f"client speaks protocol version {req.version}, this server speaks {p.PROTOCOL_VERSION}",
            )
        if not 0 <= req.pid <= _PID_MAX:
            raise HandlerError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"HELLO names pid {req.pid}, which no process can have (0 for none, else 1 to {_PID_MAX})",
            )
        plane = self.data_plane
        reply = p.HelloReply(
            req.req_id,
            server_version=__version__,
            chunk_size=self.chunk_size,
            shm_name=plane.shm_name,
            shm_size=plane.shm_size,
            shm_device=plane.shm_device,
            shm_inode=plane.shm_inode,
            lock_ttl_s=float(self.storage.l1.lock_ttl_s),
            max_keys=self.max_keys,
            max_inline_bytes=self.max_inline_bytes,
            generation_offset=plane.generation_offset,
            generation_block=plane.generation_block,
            features=list(p.FEATURES),
            shm_dir=plane.shm_dir,
        )
        logger.debug("client %s (pid %d) connected as %s", req.client_name or "?", req.pid, identity.hex())
        self.writers.hello(identity, req.pid)
        return reply, ()

    def ping(self, req: p.Ping, identity: bytes, frames: Frames) -> Response:
        return p.PingReply(req.req_id), ()

    def status(self, req: p.Status, identity: bytes, frames: Frames) -> Response:
        # Values msgpack lacks (a component's numpy integer, a path) become strings, as
        # HTTP /status writes them.
        document = msgspec.to_builtins(
            self.status_provider(), builtin_types=(bytes, bytearray, memoryview), enc_hook=str, str_keys=False
        )
        return p.StatusReply(req.req_id, status=document), ()

    # -- lookup and prefetch ----------------------------------------------------------------
    #
    # A LOOKUP that has to go to L2 leaves a PendingPrefetch in the client's session.  Once
    # the prefetch is done (seen by a query, a wait or the periodic sweep) the record holds
    # the read locks taken for the client; they become the client's when it collects the
    # result, and are given back if it does not within the result TTL.

    def lookup(self, req: p.Lookup, identity: bytes, frames: Frames) -> Response | Deferred:
        keys = req.keys
        now = time.monotonic()
        session = self.sessions.get(identity, now)
        # The sweep gives back (and counts) a result not collected by its deadline: the
        # storage keeps it until then, or the sweep would count again one it expired.
        handle, locked = self.storage.start_prefetch(keys, readers=1, owner_expires=True)
        wire_handle = self._handle_base + handle
        if locked is None:
            pending = PendingPrefetch(keys, now, now + self.sessions.result_ttl_s)
            session.prefetches[handle] = pending
            if req.wait_s > 0:  # the client would WAIT next: do it now, saving a round trip
                req_id = req.req_id

                def reply(hits: int | None) -> Response:
                    return p.LookupReply(req_id, handle=wire_handle, hits=hits), ()

                return self._wait(identity, req.req_id, handle, now + req.wait_s, reply, "lookup_wait")
            return Handed(
                p.LookupReply(req.req_id, handle=wire_handle),
                (),
                functools.partial(self._prefetch_undelivered, session, handle, pending),
            )
        # Done at once (the usual all-in-L1 case): the prefix is this client's now.  The
        # keys are the decoder's remembered objects, which the session's dicts match by
        # identity; L1's prefix ends before a repeat, so they are distinct.
        if locked:
            deadline = self.sessions.read_lock_deadline(now)
            session.add_read_locks(locked, deadline, distinct=True)
            self.handing = (session, locked, deadline)
        return p.LookupReply(req.req_id, handle=wire_handle, hits=len(locked)), ()

    def _settled(self, handle: int, pending: PendingPrefetch) -> bool:
        """Whether the prefetch is done, asking the storage unless a pool thread is waiting
        for it (that thread collects the storage's result; a second ask would get 0)."""
        if pending.hits is None and handle not in self._waited:
            hits = self.storage.query_prefetch(handle)
            if hits is not None:
                pending.settle(hits)
        return pending.hits is not None

    def _collect(self, session: Session, handle: int, pending: PendingPrefetch) -> int:
        """Hand a finished prefetch to its client: the hit count, and the locks with it."""
        del session.prefetches[handle]
        # Deadline from the LOOKUP: L1 took the locks no earlier, so keeps them no shorter.
        session.add_read_locks(pending.locked, self.sessions.prefetch_lock_deadline(pending.started))
        return pending.hits or 0

    def _collected(self, answer: Response, session: Session, pending: PendingPrefetch) -> Response:
        """``answer``, the reply handing over the prefetch ``_collect`` just collected:
        with the give-back of its locks should it not be sent."""
        if not pending.locked:
            return answer
        deadline = self.sessions.prefetch_lock_deadline(pending.started)
        undelivered = functools.partial(
            self._locks_undelivered, session, pending.locked, deadline, "prefetch result"
        )
        return Handed(*answer, undelivered)

    # -- replies that could not be sent -----------------------------------------------------
    #
    # A reply that hands its client something only that reply tells of (the slots of its
    # read locks or reservations, a prefetch's handle) and cannot be sent (RouterLoop.send
    # counted it as reply_dropped) gives it back at once, on the loop thread, right after
    # the failed send: nothing of the client's can have changed it in between.  Left, the
    # locks stayed until the lock TTL, and the reservations write-locked until the write
    # TTL, then fenced until a commit or abort that never comes (its client never learned
    # of them) -- the same client's later stores of those keys skipped them as being
    # written, then were refused.
    # The session forgets what is given back, so a RELEASE, STORE_ABORT or sweep after it
    # does not give it back again.

    def _locks_undelivered(self, session: Session, keys: list[ObjectKey], deadline: float, what: str) -> None:
        """A reply handing over read locks on ``keys`` (taken to expire at ``deadline``)
        was not sent: those locks, and only those, go back."""
        taken = session.take_read_lock_at(keys, deadline)
        if taken and deadline > time.monotonic():  # past it, L1 has reaped them: forgotten only
            self._release_locks(taken, 1, deadline)
        self._undelivered.warn(
            "locks",
            "a %s reply could not be sent (the client is gone or not reading its replies): "
            "its read locks on %d keys were given back (failure reason reply_dropped)",
            what,
            len(taken),
        )

    def locks_undelivered(self, handing: tuple[Session, list[ObjectKey], float]) -> None:
        """The LOOKUP reply that handed over ``handing`` (``self.handing``) was not sent."""
        session, keys, deadline = handing
        self._locks_undelivered(session, keys, deadline, "LOOKUP")

    def _prefetch_undelivered(self, session: Session, handle: int, pending: PendingPrefetch) -> None:
        """A LOOKUP reply naming a prefetch still running was not sent: no one can collect
        it, so it is given back now rather than at the result TTL."""
        if session.prefetches.get(handle) is not pending or handle in self._waited:
            return
        del session.prefetches[handle]
        keys = self._give_back(handle, pending)
        self._undelivered.warn(
            "prefetch",
            "a LOOKUP reply naming a running prefetch could not be sent (the client is gone or not "
            "reading its replies): the prefetch was given back, with its read locks on %d keys "
            "(failure reason reply_dropped)",
            keys,
        )

    def _reservations_undelivered(self, session: Session, reserved: Mapping[ObjectKey, Any]) -> None:
        """A STORE_RESERVE reply was not sent: no one copies into its slots nor commits
        them, so its reservations are aborted now, their keys counted refused."""
        mine = session.take_reserved(reserved)
        self._give_back_reserved(session, mine)
        if mine:
            self.stats.store_keys_refused["reply_dropped"] += len(mine)
        self._undelivered.warn(
            "reservations",
            "a STORE_RESERVE reply could not be sent (the client is gone or not reading its "
            "replies): its %d reservations were given back, their keys not stored "
            "(store_keys_refused reason reply_dropped)",
            len(mine),
        )

    def _give_back_reserved(self, session: Session, reserved: Mapping[ObjectKey, Any]) -> None:
        """Abort ``reserved`` -- reservations no client copies into, fenced at the reserve --
        and lift their fences; ``session`` stops counting as a writer once it holds none."""
        if reserved:
            self.storage.abort_reserved(reserved)
            self.storage.l1.writers_done(list(reserved.values()))
        self._forget_writers_if_idle(session)

    def _pending(self, identity: bytes, wire_handle: int) -> tuple[Session, int, PendingPrefetch]:
        """The caller's pending prefetch named by ``wire_handle`` (what its LOOKUP was
        told), with the storage's handle for it."""
        handle = wire_handle - self._handle_base
        # A client that started no prefetch gets no session for asking about one.
        session = self.sessions.existing(identity)
        pending = None if session is None or handle <= 0 else session.prefetches.get(handle)
        if session is None or pending is None:
            raise HandlerError(
                p.ErrorCode.NOT_FOUND,
                f"no pending prefetch {wire_handle} for this client (already collected, not "
                f"collected within {self.sessions.result_ttl_s:g}s, or started over another "
                "connection or before the server restarted)",
            )
        return session, handle, pending

    def query_prefetch(self, req: p.QueryPrefetchStatus, identity: bytes, frames: Frames) -> Response:
        session, handle, pending = self._pending(identity, req.handle)
        if not self._settled(handle, pending):
            return p.PrefetchStatusReply(req.req_id, hits=None), ()
        hits = self._collect(session, handle, pending)
        return self._collected((p.PrefetchStatusReply(req.req_id, hits=hits), ()), session, pending)

    def wait_prefetch(
        self, req: p.WaitPrefetchStatus, identity: bytes, frames: Frames
    ) -> Response | Deferred:
        session, handle, pending = self._pending(identity, req.handle)
        if handle in self._waited:
            raise HandlerError(
                p.ErrorCode.INVALID_ARGUMENT, f"prefetch {req.handle} is already being waited for"
            )
        if self._settled(handle, pending):
            hits = self._collect(session, handle, pending)
            return self._collected((p.PrefetchStatusReply(req.req_id, hits=hits), ()), session, pending)

        def reply(hits: int | None) -> Response:
            return p.PrefetchStatusReply(req.req_id, hits=hits), ()

        return self._wait(
            identity, req.req_id, handle, time.monotonic() + req.timeout_s, reply, "prefetch_wait"
        )

    def _wait(
        self,
        identity: bytes,
        req_id: int,
        handle: int,
        deadline: float,
        reply: Callable[[int | None], Response],
        kind: str,
    ) -> Deferred:
        """Wait on the pool for a pending prefetch of this client until ``deadline``; the
        reply carries its hit count (collected, with its locks) or None if still running."""

        def work() -> Callable[[], Response]:
            hits = self._wait_until(handle, deadline)

            def finish() -> Response:
                live = self.sessions.peek(identity)
                record = None if live is None else live.prefetches.get(handle)
                if live is None or record is None:
                    # Queries and the sweep leave a waited-for record alone: only a shutdown
                    # (release_everything) removed it, and the storage is closing.
                    return reply(hits)
                if hits is not None and record.hits is None:
                    record.settle(hits)
                if record.hits is None:
                    if kind != "lookup_wait":
                        return reply(None)  # timed out: stays pending, under a handle its client knows
                    # Its handle is told by this reply alone: given back if it is not sent.
                    undelivered = functools.partial(self._prefetch_undelivered, live, handle, record)
                    return Handed(*reply(None), undelivered)
                return self._collected(reply(self._collect(live, handle, record)), live, record)

            return finish

        self._waited.add(handle)
        return self._run_on_pool(identity, req_id, work, kind, cleanup=lambda: self._waited.discard(handle))

    def _wait_until(self, handle: int, deadline: float) -> int | None:
        # Sliced so a shutdown cancels waiting clients promptly instead of after their
        # (possibly long) timeout.
        while True:
            remaining = deadline - time.monotonic()
            hits = self.storage.wait_prefetch(handle, max(0.0, min(remaining, self.WAIT_SLICE_S)))
            if hits is not None or remaining <= self.WAIT_SLICE_S or self.stopping.is_set():
                return hits

    def collect_prefetches(self, now: float) -> None:
        """Settle finished prefetches (kept until their client asks) and give back those
        their client did not collect within the result TTL: locks released, counted."""
        expired = keys = 0
        for session in self.sessions:
            for handle, pending in list(session.prefetches.items()):
                if handle in self._waited:
                    continue  # a pool thread is collecting this one
                self._settled(handle, pending)
                if pending.deadline > now:
                    continue
                del session.prefetches[handle]
                expired += 1
                keys += self._give_back(handle, pending)
        if expired:
            self.stats.failures["prefetch_result_expired"] += expired
            self._expired_results.event(
                expired,
                f"prefetch results not collected by their clients within {self.sessions.result_ttl_s:g}s; "
                f"their read locks on {keys} keys were released",
            )

    def _give_back(self, handle: int, pending: PendingPrefetch) -> int:
        """Release what a pending record holds (or will hold); returns the keys released."""
        if pending.hits is None:
            self.storage.discard_prefetch(handle)  # released when it finishes
            return 0
        if pending.locked:
            # The prefetch took them after the LOOKUP arrived: they expire no earlier.
            self._release_locks(pending.locked, 1, self.sessions.prefetch_lock_deadline(pending.started))
        return len(pending.locked)

    # -- store ------------------------------------------------------------------------------

    def store_reserve(self, req: p.StoreReserve, identity: bytes, frames: Frames) -> Response:
        self._require_shm("STORE_RESERVE")
        keys, sizes = req.keys, req.sizes
        if len(keys) != len(sizes):
            raise HandlerError(p.ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(sizes)} sizes")
        layouts = _layouts(req.layouts, len(keys))
        now = time.monotonic()
        session = self.sessions.get(identity, now)
        connection = self._connection()
        if self._of_another_connection(session, connection):
            raise HandlerError(
                p.ErrorCode.INVALID_ARGUMENT,
                "this routing identity holds the reservations of another connection, which dropped; "
                "connect under another identity",
            )
        self._refuse_while_fenced(session, keys, now)
        reserved = self.storage.reserve_write(keys, sizes, layouts)
        replaced = session.fence_replaced(reserved)
        if replaced:
            # As for an expired reservation the session saw expire (``_refuse_while_fenced``):
            # its commit or abort must name one reservation of the key.  Counted as the
            # sweep counts the reservations it sees expire.
            self.storage.abort_reserved(reserved)
            self.stats.failure("store_reservation_expired", len(replaced))
            raise HandlerError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"this client's earlier reservation of key {replaced[0]} expired uncommitted and may "
                "still be copied into; commit or abort it before storing the key again",
            )
        if self.storage.l1.fence_writers(list(reserved.values())):
            # Reaped before this client was handed them (a write TTL shorter than this
            # request took): unfenced, their extents may be reused once their grace ends.
            self.storage.abort_reserved(reserved)
            raise HandlerError(
                p.ErrorCode.OUT_OF_MEMORY, "the reservations expired before they could be handed out"
            )
        try:
            if reserved:
                self._note_writer(session, identity)
                session.writer_connection = connection
            session.add_writes(reserved, self.sessions.write_deadline(now))
            reply, skips = self._reserve_reply(req, reserved)
            answer: Response = (reply, ())
            if reserved:
                undelivered = functools.partial(self._reservations_undelivered, session, reserved)
                answer = Handed(reply, (), undelivered)
        except BaseException:
            self._reservations_not_handed(session, reserved)
            raise
        # Counted once nothing more can raise: a STORE_RESERVE refused is counted with
        # every key it named among the refused ones, those L1 skipped too.
        self._count_skips(skips)
        return answer

    def _reservations_not_handed(self, session: Session, reserved: Mapping[ObjectKey, Any]) -> None:
        """A STORE_RESERVE raised after L1 reserved and fenced ``reserved``: its client is
        answered with the error (counted by its code, its keys among the refused ones) and
        never told their slots, so nobody copies into them, commits or aborts them.  Left,
        they stayed reserved until the write TTL, then fenced until the server stopped: the
        session, whose commit, abort or writer's exit lifts a fence, may not even hold
        them.  Given back now, those the session holds forgotten first."""
        if not reserved:
            return
        session.take_reserved(reserved)
        self._give_back_reserved(session, reserved)
        self._unhanded_reservations.warn(
            "reservations",
            "a STORE_RESERVE failed after L1 reserved its keys: its %d reservations were given "
            "back, their keys not stored (counted as refused under the request's error)",
            len(reserved),
        )

    def _reserve_reply(
        self, req: p.StoreReserve, reserved: dict[ObjectKey, Any]
    ) -> tuple[p.StoreReserveReply, Counter[str]]:
        """The slots of ``reserved``, one per key ``req`` names (NO_SLOT where none), and
        why the others were skipped (counted by the caller once the reply is built)."""
        keys, sizes = req.keys, req.sizes
        if len(reserved) == len(keys):
            # Every key reserved, so none named twice: one slot per key in order, without
            # the per-key bookkeeping below (a store of many small chunks pays it per key).
            every_slot = self._slots_of([reserved[key] for key in keys])
            return p.StoreReserveReply(req.req_id, slots=every_slot), Counter()
        skips = self._skips(keys, reserved)
        generations = dict(zip(reserved, self.storage.l1.generations(list(reserved.values())), strict=True))
        slots: list[p.Slot] = []
        handed_out: set[ObjectKey] = set()
        for key, size in zip(keys, sizes, strict=True):
            obj = reserved.get(key)
            if obj is None or key in handed_out:
                slots.append(p.Slot(p.NO_SLOT, size))
            else:
                handed_out.add(key)
                slots.append(p.Slot(obj.offset, obj.size, generations[key]))
        return p.StoreReserveReply(req.req_id, slots=slots), skips

    def _refuse_while_fenced(self, session: Session, keys: Sequence[ObjectKey], now: float) -> None:
        """Fail closed rather than let a client that may still be copying into expired
        reservations take more: past its bound of fenced bytes, or for a key whose expired
        reservation it has not committed or aborted yet (that commit or abort is what
        gives the fenced extent back, so there must be one reservation of the key it can
        name), or, for a client whose exit cannot be seen, while such clients' fenced bytes
        reach their bound (``FencedBytes``).
        Refused stores are counted (``store_keys_refused{reason="out_of_memory"}``) and
        logged by the RPC loop."""
        fenced_bytes = session.fenced_bytes
        if fenced_bytes >= self.fenced_bytes_per_client:
            raise HandlerError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"this client holds {fenced_bytes} bytes of expired write reservations it "
                f"may still be copying into (limit {self.fenced_bytes_per_client}); commit or abort "
                "them before storing more",
            )
        key = session.expired_reservation_of(keys, now)
        if key is not None:
            raise HandlerError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"this client's earlier reservation of key {key} expired uncommitted and may still "
                "be copied into; commit or abort it before storing the key again",
            )
        all_fenced = self.sessions.fenced
        if all_fenced.refuses(session, self._unwatched_requester, self._unwatched):
            self.stats.failure("store_refused_fenced")
            raise HandlerError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"clients whose exit cannot be seen hold {all_fenced.unwatched} bytes of L1 in expired "
                f"write reservations (limit {all_fenced.bound}); their stores, this one's among them, "
                "are refused until they commit or abort them (a client whose process is still being "
                "looked up stores once that ends)",
            )

    def _unwatched(self, session: Session) -> bool:
        """Whether the exit of ``session``'s writers cannot be seen (``writers.py``)."""
        return self.writers.unwatched(session.identity, session.writers)

    def _unwatched_requester(self, session: Session) -> bool:
        """Whether the client storing now, on this connection, is one whose exit cannot be
        seen, or not yet known: a pending lookup counts as unwatched.  The connection's
        lookup is sent to the scan worker here, never run on the loop thread, which serves
        every client: an episode may last until the server stops, and a /proc scan at each
        new connection's first store would hold everyone's requests up for good.  A
        watched client's new connection is refused (a miss) only until its lookup ends."""
        current = self.writers.of_request(self._source_fd(), session.identity)
        holds = bool(session.writes or session.fenced)
        return self.writers.unwatched(session.identity, [*session.writers, current], holds=holds)

    def _skips(self, keys: Sequence[ObjectKey], reserved: Mapping[ObjectKey, Any]) -> Counter[str]:
        """Why the keys of a store that L1 did not reserve were skipped.  Only asked when
        some were (a store that reserved every key skipped none), so its per-key work is
        the skipped keys'; callable from a pool thread (it counts nothing itself)."""
        named = set(keys)
        unreserved = named.difference(reserved)
        being_written = self.storage.l1.count_being_written(unreserved)
        return Counter(
            repeated=len(keys) - len(named),
            being_written=being_written,
            present=len(unreserved) - being_written,
        )

    def _count_skips(self, skips: Counter[str]) -> None:
        # ``update`` adds; zero counts keep every usual reason's series present
        self.stats.store_keys_skipped.update(skips)

    def _slots_of(self, objects: list[Any]) -> list[p.Slot]:
        """The slot of each reserved L1 object, in order."""
        generations = self.storage.l1.generations(objects)
        return [
            p.Slot(obj.offset, obj.size, generation)
            for obj, generation in zip(objects, generations, strict=True)
        ]

    def _require_shm(self, what: str) -> None:
        # Slots would point into memory nobody can map: refuse instead of pinning L1.
        if not self.data_plane.shm_name:
            raise HandlerError(
                p.ErrorCode.INVALID_ARGUMENT,
                f"{what} needs the shared-memory data plane, which this server does not offer; "
                "send bytes inline",
            )

    def store_commit(self, req: p.StoreCommit, identity: bytes, frames: Frames) -> Response:
        mine, flags = self._take_writes(identity, req.keys)
        # By identity: L1 may have reaped a reservation the session still holds live (its
        # deadline was read a moment earlier), and the key may be another writer's now.
        stored = set(self.storage.commit_reserved(mine, to_l2=not req.l1_only)) if mine else set()
        if len(stored) == len(req.keys):
            # Every key was this client's to commit and is stored (so none named twice):
            # no per-key look-ups, which a store of many small chunks would pay per key.
            done = [True] * len(stored)
            stored_bytes = sum(obj.size for obj in mine.values())
        else:
            done = [flag and key in stored for key, flag in zip(req.keys, flags, strict=True)]
            stored_bytes = sum(mine[key].size for key in stored)
            self._count_lost_reservations(req.keys, len(stored), identity)
            # L1 reaped them before the session saw them expire: fenced, and over now.
            self._copies_ended([obj for key, obj in mine.items() if key not in stored], identity)
        if stored:
            self.stats.stores += 1
            self.stats.store_chunks += len(stored)
            self.stats.store_bytes += stored_bytes
        return p.StoreReply(req.req_id, done=done), ()

    def _count_lost_reservations(self, committed: Sequence[ObjectKey], stored: int, identity: bytes) -> None:
        """Count the keys of a commit that were not stored: the client's reservation is
        gone (reaped at the write TTL), or never was.  Each key once: a key the commit
        names twice is one key of its STORE_RESERVE, stored or lost at its first position."""
        lost = len(set(committed)) - stored
        if lost:
            self._refuse_lost(
                lost,
                f"a STORE_COMMIT from {identity.hex()} named {lost} keys it holds no live reservation of "
                "(never reserved, another client's, or reaped at the write TTL)",
            )

    def _refuse_lost(self, keys: int, why: str) -> None:
        """Count and explain keys a store did not store because their reservation was gone."""
        self.stats.store_keys_refused["reservation_lost"] += keys
        self._lost_reservations.warn(
            "reservation_lost",
            "%s: not stored (store_keys_refused reason reservation_lost)",
            why,
            count=keys,
        )

    def _take_writes(
        self, identity: bytes, keys: Sequence[ObjectKey]
    ) -> tuple[dict[ObjectKey, Any], list[bool]]:
        """The caller's live reservations among ``keys`` (see Session.take_writes); a
        client that reserved nothing gets no session for asking."""
        session = self.sessions.existing(identity)
        if session is not None and self._of_another_connection(session, self._connection()):
            # Another connection under the identity of one that dropped: it holds none of
            # them (a process coming back is matched below, by the kernel's word).
            session = None
        now = time.monotonic()
        held: set[ObjectKey] = set()
        if session is None:
            mine: dict[ObjectKey, Any] = {}
            flags = [False] * len(keys)
        else:
            mine, flags = self._take_live_writes(session, keys, now)
            fenced = session.take_fenced(keys)
            self._copies_ended(fenced, identity)
            self._forget_writers_if_idle(session)
            if len(mine) + len(fenced) >= len(keys):
                return mine, flags
            held = {obj.key for obj in fenced}
        # Rare: keys this client holds no reservation of.
        unheld = [key for key, live in zip(keys, flags, strict=True) if not live and key not in held]
        if unheld:
            self._take_from_earlier_connection(identity, unheld, now, mine, flags, keys)
        return mine, flags

    def _take_live_writes(
        self, session: Session, keys: Sequence[ObjectKey], now: float
    ) -> tuple[dict[ObjectKey, Any], list[bool]]:
        """``session.take_writes``, counting the reservations it finds expired (fenced
        there) as the sweep counts those it finds: a commit or abort can come past the
        write TTL before the sweep saw it pass, and the reservation is not the sweep's to
        count any more."""
        fenced = len(session.fenced)  # a key fenced already is never reserved again: no overlap
        mine, flags = session.take_writes(keys, now)
        expired = len(session.fenced) - fenced
        if expired:
            self.stats.failure("store_reservation_expired", expired)
            self._expired_reservations.event(
                expired,
                f"store reservations committed or aborted past the write TTL "
                f"({self.sessions.write_ttl_s:g}s): forgotten, their keys not stored",
            )
        return mine, flags

    def _take_from_earlier_connection(
        self,
        identity: bytes,
        unheld: list[ObjectKey],
        now: float,
        mine: dict[ObjectKey, Any],
        flags: list[bool],
        keys: Sequence[ObjectKey],
    ) -> None:
        """A commit or abort of keys this client holds no reservation of: a client whose
        connection dropped came back under a new identity and names the reservations it
        made under the old one.  Those of an earlier identity whose process, watched and
        alive, is this client's are taken as this client's (live ones committed or
        aborted; expired ones, fenced until this word or its exit, given back), or their
        extents would stay fenced while the process lives.  Another client reserving and
        committing a key holds its own reservation of it, so it never lifts the fence of a
        writer that may still be copying."""
        current = self.writers.of_request(self._source_fd(), identity)
        for earlier in self.sessions:
            if earlier.identity == identity or not (earlier.writes or earlier.fenced):
                continue
            if not self.writers.same_process(earlier.identity, earlier.writers, identity, current):
                continue
            live, _ = self._take_live_writes(earlier, unheld, now)
            for index, key in enumerate(keys):
                if key in live and key not in mine:
                    flags[index] = True
                    mine[key] = live[key]
            self._copies_ended(earlier.take_fenced(unheld), identity)
            self._forget_writers_if_idle(earlier)

    def release_fences_of_exited_writers(self) -> None:
        """Give back the fenced extents of clients whose process exited (``writers.py``):
        nothing of theirs can copy into them any more.  Loop thread, at each sweep, which
        also has the unwatched clients' fenced bytes walked again at the next store past
        the bound (lookups ended meanwhile)."""
        self.sessions.fenced.watches_changed()
        for session in self.sessions:
            if not session.fenced or not self.writers.exited(session.identity, session.writers):
                continue
            objs = session.take_fenced(list(session.fenced))
            self._forget_writers_if_idle(session)
            given_back = self.storage.l1.writers_done(objs)
            logger.warning(
                "client %s exited holding %d expired reservations: their %d fenced L1 extents are given back",
                session.identity.hex(),
                len(objs),
                given_back,
            )
        self.writers.count_failures(self.stats.failure)

    def _note_writer(self, session: Session, identity: bytes) -> None:
        """Keep the watch of the process reserving for ``session`` now (``writers.py``)."""
        watch = self.writers.of_request(self._source_fd(), identity)
        if not (session.writes or session.fenced):
            session.writers.clear()  # what reserved before is done with: its exit lifts nothing
        self.writers.note(identity, session.writers, watch)

    def _forget_writers_if_idle(self, session: Session) -> None:
        """A session holding no reservation forgets who reserved: their exits lift nothing."""
        if not (session.writes or session.fenced):
            session.writers.clear()
            self.writers.forget(session.identity)

    def _connection(self) -> int:
        """The socket inode of the connection the request being handled came in on (0: not
        known): unlike its descriptor's number, never another connection's while it is open."""
        fd = self._source_fd()
        if fd < 0:
            return 0
        try:
            return os.fstat(fd).st_ino
        except OSError:
            return 0

    @staticmethod
    def _of_another_connection(session: Session, connection: int) -> bool:
        """Whether ``session``'s reservations were made over a connection other than
        ``connection`` (both known), under the same routing identity."""
        holds = session.writes or session.fenced
        return bool(holds and connection and session.writer_connection not in (0, connection))

    def _source_fd(self) -> int:
        """The descriptor of the connection the request being handled came in on (-1: not
        known); read while it is handled, as libzmq closes it when the connection ends."""
        source = self.source
        if source is None:
            return -1
        try:
            return int(source.get(zmq.SRCFD))
        except zmq.ZMQError:  # a libzmq that does not say: the kernel is not asked
            return -1

    def _copies_ended(self, objs: list[Any], identity: bytes) -> None:
        """The client committed or aborted these reservations, so it has stopped copying
        into them: those L1 fenced when they expired go back."""
        if not objs:
            return
        given_back = self.storage.l1.writers_done(objs)
        if given_back:
            logger.info(
                "client %s committed or aborted %d reservations after they expired: their "
                "fenced L1 extents are given back",
                identity.hex(),
                given_back,
            )

    def store_abort(self, req: p.StoreAbort, identity: bytes, frames: Frames) -> Response:
        mine, flags = self._take_writes(identity, req.keys)
        if mine:
            self.storage.abort_reserved(mine)
            self._copies_ended(list(mine.values()), identity)  # those L1 reaped meanwhile
            self.stats.store_keys_skipped["aborted"] += len(mine)
        return p.StoreReply(req.req_id, done=flags), ()

    def store_inline(self, req: p.StoreInline, identity: bytes, frames: Frames) -> Deferred:
        keys = req.keys
        if len(frames) != len(keys):
            raise HandlerError(
                p.ErrorCode.INVALID_ARGUMENT, f"{len(keys)} keys but {len(frames)} payload frames"
            )
        views = [memoryview(frame) for frame in frames]
        if any(view.nbytes == 0 for view in views):
            raise HandlerError(p.ErrorCode.INVALID_ARGUMENT, "empty payload frame")
        layouts = _layouts(req.layouts, len(keys))
        store = PoolRequest(identity, req.req_id, len(keys))
        return self._on_pool(store, lambda: self._write_inline(store, req, views, layouts), "store_inline")

    def _write_inline(
        self, store: PoolRequest, req: p.StoreInline, views: list[memoryview], layouts: list[str] | None
    ) -> bool:
        """On the pool: reserve, copy and commit a STORE_INLINE's payloads, settling
        ``store`` with how it ended; False (nothing committed, its reservations given
        back) when the stop gave up on it first."""
        keys, storage = req.keys, self.storage
        reserved = storage.reserve_write(keys, [view.nbytes for view in views], layouts)
        skips = self._skips(keys, reserved) if len(reserved) < len(keys) else Counter()
        copy_in = self._copier_in()
        fresh: dict[ObjectKey, int] = {}  # key -> bytes written
        try:
            for key, view in zip(keys, views, strict=True):
                obj = reserved.get(key)
                if obj is None or key in fresh:
                    continue  # already stored, or a repeat of a key in this batch
                copy_in(obj, view)
                fresh[key] = obj.size
        except BaseException:
            storage.abort_reserved(reserved)
            raise
        # Only the objects reserved here are committed: a reservation that expired
        # during the copy may be another writer's by now (``commit_reserved``).
        mine = {key: reserved[key] for key in fresh}

        def commit() -> Callable[[], Response]:
            try:
                stored = set(storage.commit_reserved(mine, to_l2=not req.l1_only))
            except BaseException:
                storage.abort_reserved(reserved)  # not left write-locked until the write TTL
                raise
            return lambda: self._count_inline(req, fresh, stored, skips)

        if store.settle(commit):
            return True
        # Given up at the stop, its keys counted as refused: never made visible now.
        storage.abort_reserved(reserved)
        return False

    def _count_inline(
        self, req: p.StoreInline, fresh: dict[ObjectKey, int], stored: set[ObjectKey], skips: Counter[str]
    ) -> Response:
        """Loop thread: count a STORE_INLINE that ran, as a shared-memory STORE_COMMIT
        counts (what was stored, if anything), and build its reply."""
        if stored:
            self.stats.stores += 1
            self.stats.store_chunks += len(stored)
            self.stats.store_bytes += sum(fresh[key] for key in stored)
        if skips:
            self._count_skips(skips)
        if len(stored) < len(fresh):
            lost = len(fresh) - len(stored)
            self._refuse_lost(
                lost,
                f"a STORE_INLINE's {lost} keys were reaped at the write TTL while their bytes were copied in",
            )
        done = []
        for key in req.keys:  # a key repeated in the batch was stored once, at its first position
            done.append(key in stored)
            stored.discard(key)
        return p.StoreReply(req.req_id, done=done), ()

    # -- the pool's requests ----------------------------------------------------------------

    def _on_pool(
        self,
        request: PoolRequest,
        run: Callable[[], bool],
        kind: str,
        cleanup: Callable[[], None] | None = None,
    ) -> Deferred:
        """``request`` for the pool: ``run`` does its work and settles it (False: the stop
        gave up on it first).  It is answered once, by whichever of its completion and
        the stop comes first (:meth:`give_up_pool_requests`)."""
        self._pool_requests.add(request)

        def work() -> Finish:
            # Given up by the stop (before it ran, or while it ran): counted and answered
            # there, so its ``answer`` here sends nothing -- not a second reply, nor one
            # to a request of the client's that reuses the id.
            if not request.given_up:
                try:
                    run()
                except BaseException as exc:
                    # Its ending raises the error, on the loop thread, where it is refused
                    # (a store's keys counted under the error's code): at its completion,
                    # or at the stop when that completion is never handled.
                    failed = functools.partial(_raise, exc)
                    request.settle(lambda: failed)
            return request.answer

        def forget() -> None:
            self._pool_requests.discard(request)
            if cleanup is not None:
                cleanup()

        return Deferred(work, kind, cleanup=forget)

    def _run_on_pool(
        self,
        identity: bytes,
        req_id: int,
        work: Callable[[], Callable[[], Response]],
        kind: str,
        cleanup: Callable[[], None] | None = None,
    ) -> Deferred:
        """:meth:`_on_pool` for a request whose ``work`` returns its loop-thread finisher,
        kept as its ending."""
        request = PoolRequest(identity, req_id)

        def run() -> bool:
            ending = work()  # not under the request's lock: the stop never waits for the work
            return request.settle(lambda: ending)

        return self._on_pool(request, run, kind, cleanup)

    def give_up_pool_requests(self) -> list[PoolRequest]:
        """At the stop: the pool's requests not answered yet, for the stop to answer (a
        forced stop never handles their completions).  Those still running when the drain
        ended, or dropped from the pool's queue before they ran, are given up: never
        committed, answered SHUTTING_DOWN so that their clients do not wait for their own
        timeouts, and counted as refused here with a store's keys (not again if one
        finishes later).  Those that ended are answered and counted as they ended."""
        requests, self._pool_requests = self._pool_requests, set()
        given_up = [request for request in requests if request.give_up()]
        if not given_up:
            return list(requests)
        stores = [request.keys for request in given_up if request.keys]
        self.stats.failure("shutting_down", len(given_up))
        if stores:
            self.stats.store_keys_refused["shutting_down"] += sum(stores)
        logger.warning(
            "%d pool requests given up at the stop (still running at the drain deadline, or not "
            "started): answered SHUTTING_DOWN; %d of them STORE_INLINEs, none of their %d keys stored",
            len(given_up),
            len(stores),
            sum(stores),
        )
        return list(requests)

    # -- retrieve and release ---------------------------------------------------------------

    def retrieve(self, req: p.Retrieve, identity: bytes, frames: Frames) -> Response | Deferred:
        if req.inline:
            return self._retrieve_inline(req, identity)
        self._require_shm("RETRIEVE without inline")
        now = time.monotonic()
        session = self.sessions.get(identity, now)
        wanted = _reader_layouts(req)
        # Taken with the locks: read after L1 let go of its lock, a forced delete and a
        # release of the key credited to the quarantined extent could have given the extent
        # back already, and its new generation would vouch for the next object's bytes.
        generations: list[int] = []
        objects = self.storage.read(req.keys, generations=generations)
        deadline = self.sessions.read_lock_deadline(now)
        objects = self._of_reader_layouts(req.keys, objects, wanted, deadline)
        locked = req.keys[: len(objects)]
        if len(set(objects)) < len(objects):
            # L1 locks a key repeated in the prefix once: counted twice here, a RELEASE
            # would drop another client's lock on it as well.
            locked = list(dict.fromkeys(locked))
        session.add_read_locks(locked, deadline)
        self.stats.retrieves += 1
        self.stats.retrieve_chunks += len(objects)
        self.stats.retrieve_bytes += sum(obj.size for obj in objects)
        # Not strict: ``generations`` also covers the objects a layout mismatch cut.
        slots = [p.Slot(obj.offset, obj.size, gen) for obj, gen in zip(objects, generations, strict=False)]
        reply = p.RetrieveReply(req.req_id, slots=slots)
        if not locked:
            return reply, ()
        undelivered = functools.partial(self._locks_undelivered, session, locked, deadline, "RETRIEVE")
        return Handed(reply, (), undelivered)

    def _retrieve_inline(self, req: p.Retrieve, identity: bytes) -> Deferred:
        storage, limit, unsent = self.storage, self.max_inline_bytes, self.unsent_inline
        self._refuse_if_unread(identity)
        wanted = _reader_layouts(req)

        def work() -> Callable[[], Response]:
            # Asked again here: a burst of requests sent at once all passed the loop's
            # check before the pool copied anything.
            self._refuse_if_unread(identity)
            not_before = self.sessions.read_lock_deadline(time.monotonic())  # of the locks read takes
            objects = storage.read(req.keys)
            payloads: list[Any] = []
            total = 0
            lost = False
            # Objects cut here keep their locks until the finally below, as the rest do.
            mismatch = _first_mismatch(objects, wanted)
            objects_served = objects[:mismatch]
            try:
                copy_out = self._copier_out()
                for obj in objects_served:
                    if payloads and total + obj.size > limit:
                        break
                    try:
                        payloads.append(unsent.track(identity, copy_out(obj)))
                    except KeyError as exc:
                        # L1 could not vouch for the bytes copied (the object left L1 and
                        # its extent may have changed hands meanwhile): the prefix ends
                        # here, a miss rather than another object's bytes.
                        logger.warning("inline retrieve cut short: %s", exc)
                        lost = True
                        break
                    total += obj.size
            finally:
                self._release_locks(req.keys[: len(objects)], 1, not_before)
            truncated = not lost and len(payloads) < len(objects_served)
            returned = req.keys[: len(payloads)]

            def finish() -> Response:
                if lost:
                    self.stats.failure("retrieve_object_lost")
                if wanted is not None and len(payloads) == mismatch < len(objects):
                    # Only a reply whose prefix ends at the mismatch counts it: one cut
                    # short by the byte limit before it is followed by another request.
                    self._count_layout_mismatch(objects[mismatch], wanted[mismatch])
                # The client has its bytes: drop whatever it still held on them (its
                # LOOKUP's locks), as a shared-memory client's RELEASE would.
                self._release(identity, returned)
                self.stats.retrieves += 1
                self.stats.retrieve_chunks += len(payloads)
                self.stats.retrieve_bytes += total
                slots = [p.Slot(p.NO_SLOT, len(payload)) for payload in payloads]
                return p.RetrieveReply(req.req_id, slots=slots, truncated=truncated), payloads

            return finish

        return self._run_on_pool(identity, req.req_id, work, "retrieve_inline")

    def _refuse_if_unread(self, identity: bytes) -> None:
        """Refuse an inline RETRIEVE from a client whose inline replies not read yet
        reach its bound (``unsent.py``)."""
        unsent = self.unsent_inline
        held = unsent.held(identity)
        if held >= unsent.bound:
            raise HandlerError(
                p.ErrorCode.OUT_OF_MEMORY,
                f"this client's inline replies not read yet hold {held} bytes of the server's memory "
                f"(limit {unsent.bound}): read them before asking for more",
            )

    def _of_reader_layouts(
        self, keys: Sequence[ObjectKey], objects: list[Any], wanted: list[str] | None, not_before: float
    ) -> list[Any]:
        """The leading ``objects`` (read-locked for ``keys``) a reader of the ``wanted``
        layouts may read; the locks on the rest are given back, the miss counted."""
        mismatch = _first_mismatch(objects, wanted)
        if wanted is None or mismatch == len(objects):
            return objects
        kept = set(keys[:mismatch])
        # L1 locked a key repeated in the prefix once: a repeat of a kept key keeps its lock.
        cut = [key for key in dict.fromkeys(keys[mismatch : len(objects)]) if key not in kept]
        self._release_locks(cut, 1, not_before)
        self._count_layout_mismatch(objects[mismatch], wanted[mismatch])
        return objects[:mismatch]

    def _count_layout_mismatch(self, obj: Any, wanted: str) -> None:
        self.stats.failure("retrieve_layout_mismatch")
        stored = obj.layout or f"an unknown layout of {obj.size} bytes"
        self._layout_mismatches.event(
            1,
            f"retrieves cut short: a chunk holds {stored}, its reader reads {wanted} (a miss)",
        )

    # Pool threads copy inline payloads through L1 loans, which work for every L1 backing;
    # copy_into and the loan's detach() release the GIL, so the loop keeps serving.

    def _copier_in(self) -> Callable[[Any, memoryview], None]:
        lend = self.storage.lend

        def copy_in(obj: Any, data: memoryview) -> None:
            loan = lend(obj, fill=True)
            copy_into(loan.buffer, data)
            loan.commit()

        return copy_in

    def _copier_out(self) -> Callable[[Any], Any]:
        lend = self.storage.lend

        def copy_out(obj: Any) -> memoryview | bytearray:
            return lend(obj).detach()

        return copy_out

    def release(self, req: p.Release, identity: bytes, frames: Frames) -> Response:
        if req.once:
            return p.ReleaseReply(req.req_id, released=self._release_once(identity, req.keys)), ()
        return p.ReleaseReply(req.req_id, released=self._release(identity, req.keys)), ()

    def _release_once(self, identity: bytes, keys: Sequence[ObjectKey]) -> int:
        # What one request took (its reply came after its caller gave up): the client's
        # other locks on these keys may be under views it is reading right now.
        session = self.sessions.peek(identity)
        if session is None:
            return 0
        taken = session.take_one_read_lock(keys, time.monotonic())
        for not_before, group in taken.items():
            self._release_locks(group, 1, not_before)
        return sum(len(group) for group in taken.values())

    def _release(self, identity: bytes, keys: Sequence[ObjectKey]) -> int:
        session = self.sessions.peek(identity)
        if session is None:
            return 0
        groups = session.take_read_locks(keys, time.monotonic())
        for (count, not_before), group in groups.items():
            self._release_locks(group, count, not_before)
        released = sum(len(group) for group in groups.values())
        if session.prefetches:
            # A finished prefetch the client never asked about holds locks for it too.
            held = session.take_prefetch_locks(keys, self.sessions.prefetch_lock_deadline)
            for (count, not_before), group in held.items():
                self._release_locks(group, count, not_before)
            if held:
                released = len({key for part in (groups, held) for group in part.values() for key in group})
        return released

    def _release_locks(self, keys: Sequence[ObjectKey], count: int, not_before: float) -> None:
        """Release a client's locks on ``keys``, the earliest expiring at ``not_before`` (the
        session's deadline, never later than L1's): L1 then drops locks of this client's,
        not one a vanished client left to expire, which would live on in their place."""
        self.storage.l1.finish_read(keys, count, not_before=not_before)

    # -- maintenance ------------------------------------------------------------------------

    def clear(self, req: p.Clear, identity: bytes, frames: Frames) -> Deferred:
        # Clients keep their records of locks on objects cleared by force: L1 holds those
        # extents until the locks are released (RELEASE frees them early) or expire.
        storage, force = self.storage, req.force

        def work() -> Callable[[], Response]:
            cleared = storage.clear(force=force)
            return lambda: (p.ClearReply(req.req_id, cleared=cleared), ())

        return self._run_on_pool(identity, req.req_id, work, "clear")

    def evict(self, req: p.Evict, identity: bytes, frames: Frames) -> Response:
        return p.EvictReply(req.req_id, evicted=self.storage.evict(req.keys)), ()

    def release_everything(self) -> None:
        """Shutdown: give back every lock and reservation any client still holds."""
        now = time.monotonic()
        self.collect_prefetches(now)
        locks = writes = 0
        for session in self.sessions:
            if session.writes:
                writes += len(session.writes)
                self.storage.abort_reserved({key: obj for key, (_, obj) in session.writes.items()})
            for (count, not_before), group in session.take_read_locks(list(session.read_locks), now).items():
                self._release_locks(group, count, not_before)
                locks += len(group)
            for handle, pending in session.prefetches.items():
                locks += self._give_back(handle, pending)
            session.writes.clear()
            session.prefetches.clear()
        self.writers.close()
        self.writers.count_failures(self.stats.failure)  # lookups given up at the stop
        self.stats.released_at_stop_locks = locks
        self.stats.released_at_stop_reservations = writes


class PoolRequest:
    """A request handed to the pool, until it is counted and answered -- exactly once: at
    its completion on the loop thread, or at the stop when that never comes (the drain
    gave up on it, the pool's queue dropped it before it ran, or it ended after the
    loop's last turn).

    The pool thread settles it (a store commits, or not; every request keeps how it
    ended) under the lock the stop takes to give up on it, so exactly one of the two
    happens: a store given up on is never committed, and a request that ended is counted
    and answered as it ended, by whichever of its completion and the stop comes first."""

    def __init__(self, identity: bytes, req_id: int, keys: int = 0) -> None:
        self.identity = identity
        self.req_id = req_id
        #: the keys a STORE_INLINE names, to be counted as refused when it is given up
        self.keys = keys
        self._lock = threading.Lock()
        self.given_up = False
        self._ended = False
        #: how it ended: counts it and builds its reply, or raises the error it failed
        #: with (the loop refuses it); run once, on the loop thread
        self._ending: Callable[[], Response] | None = None
        self._answered = False

    def settle(self, end: Callable[[], Callable[[], Response]]) -> bool:
        """Pool thread: run ``end`` (a store's commit) and keep the ending it returns, or
        the error it raises, as one step the stop sees whole -- unless the stop gave up on
        the request first: then False, and ``end`` is not run."""
        with self._lock:
            if self.given_up:
                return False
            try:
                self._ending = end()
            except BaseException as exc:
                self._ending = functools.partial(_raise, exc)
            self._ended = True
            return True

    def give_up(self) -> bool:
        """Loop thread, at the stop: True if the request had not ended (now it never does:
        it is the caller's to count, and its answer is SHUTTING_DOWN); False if it had.
        Either way it is the stop's to answer, since its completion may never be handled."""
        with self._lock:
            if self._ended:
                return False
            self.given_up = True
            req_id = self.req_id
            # Counted by the caller: the reply alone.
            self._ending = lambda: (p.ErrorReply(req_id, p.ErrorCode.SHUTTING_DOWN.value, GIVEN_UP), ())
            return True

    def answer(self) -> Response | None:
        """Loop thread: count how the request ended and build its reply (or raise its
        error), once; None to whichever of its completion and the stop asks second."""
        if self._answered:
            return None
        self._answered = True
        assert self._ending is not None, "answered before it settled"
        return self._ending()


def _raise(error: BaseException) -> Response:
    raise error


def _reader_layouts(req: p.Retrieve) -> list[str] | None:
    """The layout per key a RETRIEVE's reader reads ("" for any), None when it names
    none (plain bytes, or an older client); refused unless valid."""
    if not req.layouts:
        return None
    if len(req.layouts) != len(req.keys):
        raise HandlerError(
            p.ErrorCode.INVALID_ARGUMENT, f"{len(req.keys)} keys but {len(req.layouts)} layouts"
        )
    for layout in req.layouts:
        if layout:
            _layout_nbytes(layout)  # ValueError: INVALID_ARGUMENT
    return req.layouts


# Readers ask for the same few layouts again and again; only valid ones are remembered.
@functools.lru_cache(maxsize=256)
def _layout_nbytes(layout: str) -> int:
    return TensorLayout.parse(layout).nbytes


def _first_mismatch(objects: Sequence[Any], wanted: Sequence[str] | None) -> int:
    """Index of the first object a reader of its ``wanted`` layout may not read (one of
    another known layout, or of unknown layout and another size); ``len(objects)`` if none."""
    if wanted is None:
        return len(objects)  # a plain-bytes reader: no per-object walk on its hot path
    for index, (obj, layout) in enumerate(zip(objects, wanted, strict=False)):
        if layout and (obj.size != _layout_nbytes(layout) or (obj.layout and obj.layout != layout)):
            return index
    return len(objects)


def _layouts(layouts: list[str], count: int) -> list[str] | None:
    """A request's layouts: None when it sent none, else exactly one per key."""
    if not layouts:
        return None
    if len(layouts) != count:
        raise HandlerError(p.ErrorCode.INVALID_ARGUMENT, f"{count} keys but {len(layouts)} layouts")
    return layouts


def error_for(exc: BaseException) -> tuple[p.ErrorCode, str]:
    """Map an exception raised while serving a request to an error code and message."""
    if isinstance(exc, HandlerError):
        return exc.code, str(exc)
    if isinstance(exc, L1OutOfMemoryError):
        return p.ErrorCode.OUT_OF_MEMORY, str(exc)
    if isinstance(exc, KeyValidationError | ValueError):
        return p.ErrorCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, KeyError):
        return p.ErrorCode.NOT_FOUND, f"unknown: {exc}"
    return p.ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"
