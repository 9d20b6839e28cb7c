"""ZeroMQ ROUTER plumbing for front ends: one socket, one loop thread, a pool for blocking work.

ZeroMQ sockets are not thread-safe, so only the loop thread receives and sends on the
ROUTER.  The loop blocks in a plain ``recv`` (with a receive timeout for housekeeping):
on small VMs that is about twice as fast per request as polling the socket next to other
file descriptors.  Pool threads therefore hand finished work back through a queue and
wake the loop with an empty message from an in-process DEALER connected to the same
ROUTER, whose identity the loop recognises (:meth:`RouterLoop.is_waker`).  After a turn
that found a request, the loop polls that socket alone for a moment before it blocks
(:class:`~lmcache_tiers.request_spin.RequestSpin`).

A front end owns a :class:`RouterLoop`, receives with its ``socket`` in the
``receive_one`` it passes to :meth:`RouterLoop.run`, hands blocking work to
:meth:`RouterLoop.submit` (with the size of the request's message) and replies with
:meth:`RouterLoop.send`.  While the pool holds its bound of requests, or of their bytes,
the loop reads none (:meth:`RouterLoop._hold_reading`).

Both report to :data:`~lmcache_tiers.activity.DATA_PLANE` (work in the pool is a span, a
reply a touch), which is how write-back knows to stay out of the way of requests.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import itertools
import logging
import os
import re
import resource
import secrets
import socket
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from lmcache_tiers.activity import DATA_PLANE
from lmcache_tiers.burst import BurstLog
from lmcache_tiers.config import FRONTEND_POOL_MAX_MB
from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.request_spin import RequestSpin
from lmcache_tiers.server.priority import share_priority, thread_ids, threads_named
from lmcache_tiers.sweep_cadence import sweep_interval

__all__ = ["RouterLoop"]

logger = logging.getLogger(__name__)

_instances = itertools.count()
# Plain ints: pyzmq's flags are Python enums, and combining them (``SNDMORE | NOBLOCK``)
# runs enum code costing about a microsecond per request on the loop thread.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
# The backend's send, without the sugar wrapper (which only adds routing_id/group support,
# for socket types this server does not use): half a microsecond per frame saved.
_raw_send = zmq.backend.Socket.send
#: frames at least this large are handed to libzmq without a copy
_ZERO_COPY_BYTES = 64 << 10

#: what ``submit``'s ``done`` gets on the loop thread: the work's result, or what it raised
Done = Callable[[Any, "BaseException | None"], None]
#: a pool request ended: its ``done``, its result or what it raised, its span token and its
#: message's size
_Completion = tuple[Done, Any, BaseException | None, object, int]
#: ``submit``'s ``counted_at_stop``: whether the front end counts a request the stop gives
#: up on itself (asked at the loop's end, after ``on_shutdown``)
CountedAtStop = bool | Callable[[], bool]
#: the failure reason of a pool request never answered that no front end counted
ABANDONED_REASON = "pool_request_abandoned"
#: complete messages libzmq queues per connection before the loop reads them (its default
#: is 1000).  Until the loop gets to a request nobody has checked its token, so this times
#: the largest message is what one connection, authenticated or not, can make the server
#: hold.  A full queue stops libzmq reading that connection (TCP pushes back on the
#: sender; nothing is dropped), and 64 is the native client's default pipelining window
#: (``lookup_many``), so its pipelining does not wait on it; a wider window only waits.
RECEIVE_QUEUE_MESSAGES = 64
#: the loop must have turned within this long for its front end to count as healthy
HEARTBEAT_LIMIT_S = 5.0
#: after a graceful drain the socket stays open (refusing requests) this long before it
#: closes, so clients read the drain's last replies before the connection drops
REPLY_SETTLE_S = 0.05
#: how long ``start`` waits for ZeroMQ's I/O thread to have named itself (it is found by
#: name); a moment, longer only on a machine too busy to run the new thread
IO_THREAD_NAME_WAIT_S = 1.0
#: requests the pool may hold (running and queued) per pool thread: at that many the loop
#: stops reading new requests until the pool is down to ``POOL_RESUME_SHARE`` of it.  Far
#: above the thread count, so that while waits hold every thread the requests queued behind
#: them have room, and only a queue that keeps growing reaches it (1024 requests for the
#: native front end's 8 threads; a client's pipelining window is 64)
POOL_REQUESTS_PER_WORKER = 128
#: the share of its bound the pool must be down to before the loop reads again: a few
#: requests' room at a time would stop and restart reading for every request that ends
POOL_RESUME_SHARE = 0.75
#: the bytes of request messages the pool may hold when the front end gives no bound
#: (ServerConfig's ``frontend_pool_max_mb``): the request bound alone is no memory bound,
#: as one request may carry up to the front end's largest message
DEFAULT_POOL_BYTES = FRONTEND_POOL_MAX_MB << 20


class RouterLoop:
    """A bound ROUTER socket and the loop that serves it until :meth:`request_stop`."""

    def __init__(
        self,
        endpoint: str,
        *,
        name: str,
        stats: FrontendStats,
        pool_workers: int,
        max_frame_bytes: int,
        sweep_interval_s: float,
        drain_timeout_s: float,
        sweep_ttls: Sequence[float] = (),
        max_pool_requests: int | None = None,
        max_pool_bytes: int | None = None,
    ) -> None:
        """``sweep_interval_s`` is the sweep's period, shortened to a quarter of the
        shortest of ``sweep_ttls`` (the TTLs the front end's sweep enforces) when that is
        shorter (at least ``SWEEP_FLOOR_S``, ``sweep_cadence.py``).  ``max_pool_requests``
        (default ``POOL_REQUESTS_PER_WORKER`` per pool thread) bounds the requests on the
        pool, ``max_pool_bytes`` (default ``DEFAULT_POOL_BYTES``) the sum of their
        messages' sizes (as ``submit`` is told them): see :meth:`_hold_reading`."""
        max_pool_requests = (
            max_pool_requests if max_pool_requests is not None else pool_workers * POOL_REQUESTS_PER_WORKER
        )
        # Refused before anything is bound: a socket made here would outlive the refusal.
        if max_pool_requests < 1:
            raise ValueError(f"max_pool_requests must be at least 1, not {max_pool_requests}")
        max_pool_bytes = max_pool_bytes if max_pool_bytes is not None else DEFAULT_POOL_BYTES
        if max_pool_bytes < 1:
            raise ValueError(f"max_pool_bytes must be at least 1, not {max_pool_bytes}")
        self.name = name
        self.stats = stats
        self.sweep_interval_s = sweep_interval(sweep_ttls, ceiling=sweep_interval_s)
        self._open_files_log = BurstLog(logger, "open_files_exhausted")
        self.drain_timeout_s = drain_timeout_s
        before = thread_ids()
        self._context = zmq.Context()
        _seed_routing_ids(name)
        self.socket = self._context.socket(zmq.ROUTER)  # starts the context's I/O thread
        # Every request and reply passes through libzmq's I/O thread: it gets the priority
        # of the thread that starts the loop, as the loop thread and the pool do.  Told
        # apart by name at start: a new thread names itself a moment after it starts.
        self._started_threads = thread_ids() - before
        # Unroutable replies raise instead of vanishing, so a vanished client is logged.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer sending a frame over the limit is disconnected by libzmq before the
        # frame is ever buffered in full.
        self.socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE_MESSAGES)
        self.socket.setsockopt(zmq.LINGER, 500)
        self.socket.setsockopt(zmq.RCVTIMEO, int(self.sweep_interval_s * 1000))
        if "[" in endpoint:
            self.socket.setsockopt(zmq.IPV6, 1)
        # The wake-up socket connects before the public endpoint exists, so the first
        # message the ROUTER ever receives is its greeting: that is how its identity is known.
        inproc = f"inproc://tiers-router-wake-{next(_instances)}"
        self.socket.bind(inproc)
        self._waker = self._context.socket(zmq.DEALER)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._waker.connect(inproc)
        self._waker.send(b"")
        self._wake_identity = self.socket.recv()
        self.socket.recv()
        self._waker_lock = threading.Lock()
        # ipc://@name is a Linux abstract socket: no file, no mode (any local user, as on
        # loopback TCP), and a chmod of the name would reach a file of that name instead.
        if endpoint.startswith("ipc://") and not endpoint.startswith(("ipc://@", "ipc://*")):
            self._bind_private_ipc(endpoint[len("ipc://") :])
        else:
            self._bind_public(endpoint)
        self._pool = ThreadPoolExecutor(max_workers=pool_workers, thread_name_prefix=f"tiers-{name}")
        self._completions: collections.deque[_Completion] = collections.deque()
        self.in_pool = 0
        self.max_pool_requests = max_pool_requests
        self._resume_at = int(max_pool_requests * POOL_RESUME_SHARE)
        #: the sizes of the messages of the requests on the pool, added up (loop thread)
        self.pool_bytes = 0
        self.max_pool_bytes = max_pool_bytes
        self._resume_at_bytes = int(max_pool_bytes * POOL_RESUME_SHARE)
        #: whether the loop has stopped reading requests for want of room on the pool
        self.reading_held = False
        #: set by a pool thread that finishes work while the loop waits for room: the loop
        #: then reads nothing, so the wake-up message would not reach it
        self._room = threading.Event()
        self._waiting_for_room = False
        self._held_log = BurstLog(logger, "pool_backpressure")
        #: requests on the pool whose ``done`` has not run, by their span token (loop thread)
        self._unanswered: dict[object, CountedAtStop] = {}
        self._stop_requested = False
        self._force_stop = False
        self.draining = False
        self.heartbeat = time.monotonic()
        self._thread: threading.Thread | None = None
        self._closed = False

    def is_waker(self, identity: bytes) -> bool:
        """Whether a received message is a pool thread's wake-up (nothing to answer)."""
        return identity == self._wake_identity

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
        # A queue of wake-ups already pending, or the loop closing: either way nothing to do.
        with self._waker_lock, contextlib.suppress(zmq.ZMQError):
            self._waker.send(b"", zmq.NOBLOCK)

    def close(self) -> None:
        """Release the socket of a loop that will not run (start-up failed later on)."""
        self._pool.shutdown(wait=False)
        self._close_sockets(0)

    def _bind_public(self, endpoint: str) -> None:
        try:
            self.socket.bind(endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets(0)
            raise OSError(exc.errno, f"cannot listen on {endpoint}: {exc.strerror}") from None
        raw = self.socket.getsockopt(zmq.LAST_ENDPOINT)
        self.endpoint = raw.decode() if isinstance(raw, bytes) else str(raw)
        if self.endpoint.startswith("ipc://") and not self.endpoint.startswith("ipc://@"):
            # ipc://*: libzmq made the file in a 0700 directory of its own; 0600 all the same.
            try:
                os.chmod(self.endpoint[len("ipc://") :], 0o600)
            except OSError as exc:
                self._close_sockets(0)
                raise OSError(exc.errno, f"cannot make {self.endpoint} private: {exc.strerror}") from None

    def _bind_private_ipc(self, path: str) -> None:
        """Bind an ipc:// socket file that only the server's user (and root) can connect to.

        Connecting to a Unix socket takes write permission on its file, which libzmq
        creates under the umask (0775 under 002 lets the group in), and an ipc:// endpoint
        asks no token, like loopback.  libzmq binds and listens in one call, so a chmod
        after it leaves the file open for an instant.  The socket is therefore bound in a
        fresh 0700 directory next to ``path`` (nobody else can reach it there), made 0600
        and only then linked at ``path`` (same filesystem: atomic).  The link, unlike a
        rename, fails on a name that exists: a server that took the path since the
        start-up pre-flight keeps it (see :func:`_place_socket`).  The process umask is
        left alone: other threads create files meanwhile.  Failing that, the server does
        not start."""
        directory = os.path.dirname(path) or "."
        _remove_dead_bind_directories(directory, self.name)
        try:
            private, lock = _make_locked_bind_directory(directory)
        except OSError as exc:
            self._close_sockets(0)
            raise OSError(exc.errno, f"cannot listen on ipc://{path}: {exc.strerror}") from None
        staged = os.path.join(private, STAGED_SOCKET_NAME)
        aside = os.path.join(private, _ASIDE_NAME)
        try:
            # Held until the directory is gone, taken before anything is put in it: the
            # start-up clean-up of leftovers leaves a directory whose lock is held alone.
            try:
                _lock_bind_directory(lock, private, self.name)
            except OSError as exc:
                self._close_sockets(0)
                raise OSError(exc.errno, f"cannot listen on ipc://{path}: {exc.strerror}") from None
            self._bind_staged_and_place(staged, path, aside)
        finally:
            for leftover in (staged, aside):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(leftover)
            try:
                os.rmdir(private)
            except OSError as exc:  # empty and private: harmless, but said
                logger.warning(
                    "%s: cannot remove the bind directory %s: %s", self.name, private, exc.strerror
                )
            os.close(lock)
        self.endpoint = f"ipc://{path}"

    def _bind_staged_and_place(self, staged: str, path: str, aside: str) -> None:
        try:
            try:
                self.socket.bind(f"ipc://{staged}")
            except zmq.ZMQError as exc:
                raise OSError(exc.errno, f"cannot listen on ipc://{path}: {exc.strerror}") from None
            try:
                os.chmod(staged, 0o600)
                _place_socket(staged, path, aside)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot listen on ipc://{path}: {exc.strerror}") from None
            self._socket_inode = os.lstat(staged).st_ino
        except OSError:
            self._close_sockets(0)
            raise

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
            self._remove_own_socket_file(bound[len("ipc://") :])

    def _remove_own_socket_file(self, path: str) -> None:
        """Remove the socket file at ``path`` if it is still the one this loop bound: one
        put there since (another server's, once this one's was removed) is not ours."""
        inode = getattr(self, "_socket_inode", None)
        try:
            if inode is not None and os.lstat(path).st_ino != inode:
                logger.warning("%s: %s is no longer this server's socket: left in place", self.name, path)
                return
            os.unlink(path)
        except FileNotFoundError:
            pass

    # -- the loop thread ---------------------------------------------------------------------

    def start(
        self,
        receive_one: Callable[[], None],
        *,
        sweep: Callable[[float], None],
        on_drain: Callable[[], None],
        on_shutdown: Callable[[], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        """:meth:`run` on a thread of its own; a loop that dies (a bug) logs and calls
        ``on_failure``."""

        def serve() -> None:
            try:
                self.run(receive_one, sweep=sweep, on_drain=on_drain, on_shutdown=on_shutdown)
            except BaseException as exc:
                logger.exception("%s: the request loop failed", self.name)
                on_failure(exc)

        share_priority(threads_named(self._started_threads, "ZMQbg/IO", wait_s=IO_THREAD_NAME_WAIT_S))
        self._thread = threading.Thread(target=serve, name=f"tiers-{self.name}", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """After :meth:`request_stop`: wait for the loop to end (True once it has); a loop
        that never started has its socket closed here."""
        if self._thread is None:
            if not self._closed:
                self._closed = True
                self.close()
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def health(self) -> tuple[bool, str]:
        if self.draining:
            return False, "shutting down"
        stalled = time.monotonic() - self.heartbeat
        if self._thread is not None and stalled > HEARTBEAT_LIMIT_S:
            return False, f"request loop has not turned for {stalled:.1f}s"
        return True, "ok"

    # -- the loop --------------------------------------------------------------------------

    def run(
        self,
        receive_one: Callable[[], None],
        *,
        sweep: Callable[[float], None],
        on_drain: Callable[[], None],
        on_shutdown: Callable[[], None],
    ) -> None:
        """Serve until a stop is requested and in-flight work is finished or abandoned.

        ``receive_one`` receives and handles one message (or returns at the receive
        timeout); ``sweep`` runs every sweep interval, ``on_drain`` once when the stop
        begins, ``on_shutdown`` (give back what clients hold) before the socket closes.
        """
        next_sweep = time.monotonic() + self.sweep_interval_s
        drain_deadline = 0.0
        # Polls for the next request after a turn that found one (``request_spin.py``): a
        # turn as long as the receive timeout found nothing, and an idle loop sleeps on
        # its socket.  Nor while the pool runs work: its threads need the GIL, which the
        # poll holds while it looks, and their wake-up is what the loop waits for.
        spin = RequestSpin(self.socket)
        # half the receive timeout: libzmq counts it in whole milliseconds of its own clock
        idle_ns = int(self.sweep_interval_s * 1000) * 500_000
        polling = True
        try:
            while True:
                if self.reading_held:
                    self._wait_for_room(next_sweep)
                elif (
                    self.in_pool >= self.max_pool_requests or self.pool_bytes >= self.max_pool_bytes
                ) and not self._stop_requested:
                    self._hold_reading()
                    self._wait_for_room(next_sweep)
                else:
                    if polling and not self.in_pool:
                        spin.poll()
                    turn = time.perf_counter_ns()
                    receive_one()
                    polling = time.perf_counter_ns() - turn < idle_ns
                if self._completions:
                    self._finish_completions()
                now = time.monotonic()
                self.heartbeat = now
                if now >= next_sweep:
                    try:
                        self._note_open_files()
                        sweep(now)
                        self.stats.pool_tasks = self.in_pool
                    except Exception:
                        logger.exception("%s: periodic maintenance failed", self.name)
                    next_sweep = now + self.sweep_interval_s
                if self._stop_requested and not self.draining:
                    self.draining = True
                    on_drain()
                    drain_deadline = now + self.drain_timeout_s
                    logger.info("%s stopping: refusing new requests, %d in flight", self.name, self.in_pool)
                if self.draining and (self.in_pool == 0 or now >= drain_deadline or self._force_stop):
                    break
        finally:
            if self.in_pool:
                logger.warning(
                    "%s: abandoning %d requests still running at the drain deadline", self.name, self.in_pool
                )
            self._pool.shutdown(wait=False, cancel_futures=True)
            try:
                on_shutdown()
            except Exception:
                logger.exception("%s: releasing client locks at shutdown failed", self.name)
            if self.draining and not self._force_stop:
                self._let_replies_land(receive_one)
            self._count_abandoned()
            self._close_sockets()

    def _hold_reading(self) -> None:
        """Stop reading requests: the pool holds its bound of them, or of their bytes.

        Every request read may go to the pool, so a client sending pool requests faster
        than the pool ends them grew its queue (and the memory of what they carry) without
        bound.  The request bound alone caps no memory (one request may carry the front
        end's largest message: a gigabyte), so the sizes of the requests' messages are
        bounded too.  A message's size is known only once it is read: one larger than what
        is left under the byte bound is read all the same, so the pool holds at most the
        byte bound plus one largest message (and one larger than the whole bound is served
        alone, never refused).  Not read, requests wait in libzmq's queue of their connection
        (``RECEIVE_QUEUE_MESSAGES``), then in the senders' own queues: their sends block or
        wait, and nothing is dropped or reordered.  Replies still go out, the pool's work
        is finished and the sweep runs; reading starts again once the pool is down to
        ``POOL_RESUME_SHARE`` of both bounds, or as the stop begins (a draining front end
        sends nothing more to the pool, it refuses).

        Work that a later request would end (a wait woken when the loop settles the
        prefetch for another request) cannot hold the loop for ever: every wait has a
        deadline of its own, at which it ends and the pool drains, and the sweep, which
        settles prefetches too, still runs.  The bound, far above the thread count, is
        reached only when queued work piles up behind running work anyway."""
        self.reading_held = True
        self.stats.pool_backpressure += 1
        if self.pool_bytes >= self.max_pool_bytes:
            self.stats.pool_backpressure_bytes += 1
            self._held_log.warn(
                "held_bytes",
                "%s: %d bytes of requests on the pool (its bound: %d): not reading new requests "
                "until it is down to %d bytes and %d requests; clients' requests wait in their "
                "connections' queues (pool_backpressure_bytes_total, pool_backpressure_total, "
                "pool_backpressure_seconds_total)",
                self.name,
                self.pool_bytes,
                self.max_pool_bytes,
                self._resume_at_bytes,
                self._resume_at,
            )
            return
        self._held_log.warn(
            "held",
            "%s: %d requests on the pool (its bound): not reading new requests until it is "
            "down to %d; clients' requests wait in their connections' queues "
            "(pool_backpressure_total, pool_backpressure_seconds_total)",
            self.name,
            self.in_pool,
            self._resume_at,
        )

    def _wait_for_room(self, next_sweep: float) -> None:
        """While reading is held: wait for the pool to end something (or for the next
        sweep, which is also when a stop is noticed), finish what it ended, and read
        again if that made room."""
        started = time.monotonic()
        self._room.clear()
        # A pool thread appends its completion, then looks at this flag; the loop sets it,
        # then looks for completions: one of the two sees the other.
        self._waiting_for_room = True
        if not self._completions and not self._stop_requested:
            self._room.wait(max(0.0, next_sweep - started))
        self._waiting_for_room = False
        if self._completions:
            self._finish_completions()
        self.stats.pool_backpressure_seconds += time.monotonic() - started
        room = self.in_pool <= self._resume_at and self.pool_bytes <= self._resume_at_bytes
        if room or self._stop_requested:
            self.reading_held = False

    def _note_open_files(self) -> None:
        """At the descriptor limit libzmq's accept fails with EMFILE and is retried without
        a word to the application: new clients only time out.  A sweep that cannot open one
        descriptor (while clients wait, libzmq takes each one freed at once) counts
        ``open_files_exhausted`` and logs it once per burst."""
        try:
            probe = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno != errno.EMFILE:
                return
        else:
            os.close(probe)
            return
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.stats.failure("open_files_exhausted")
        self._open_files_log.warn(
            "open_files",
            "%s: open files limit reached (ulimit -n is %d): new clients cannot connect and "
            "wait until their timeout, nor can /metrics be scraped; raise ulimit -n",
            self.name,
            soft,
        )

    def _let_replies_land(self, receive_one: Callable[[], None]) -> None:
        """Keep refusing requests for a moment before the socket closes.

        A client whose socket sets ``IMMEDIATE`` (ours does) discards what it has received
        but not yet read when its connection drops, so a reply sent just before the close
        (the answer to the drain's last in-flight request) could be lost although it left
        the server.  The drain's last replies get ``REPLY_SETTLE_S`` to be read first."""
        try:
            self.socket.setsockopt(zmq.RCVTIMEO, 10)
            end = time.monotonic() + REPLY_SETTLE_S
            while time.monotonic() < end:
                receive_one()
                if self._completions:  # abandoned work finishing late: answered too
                    self._finish_completions()
        except Exception:
            logger.exception("%s: refusing requests while the last replies land failed", self.name)

    def _count_abandoned(self) -> None:
        """At the loop's end, when no completion is handled any more: a pool request whose
        ``done`` never ran (dropped from the queue, still running, or ended after the last
        turn) is never answered.  Front ends count those they give up on themselves (with
        their own reasons, keys and log lines); the rest are counted here, once, as
        ``pool_request_abandoned``, so none leaves /metrics unaccounted."""
        unanswered, self._unanswered = self._unanswered, {}
        if not unanswered:
            return
        DATA_PLANE.end_many(unanswered)  # their spans never end otherwise
        uncounted = sum(1 for counted in unanswered.values() if not self._counted_by_front_end(counted))
        if uncounted:
            self.stats.failure(ABANDONED_REASON, uncounted)
            logger.warning(
                "%s: %d requests on the pool never answered, still running or queued when the "
                "stop ended (drain deadline or forced stop) [%s]",
                self.name,
                uncounted,
                ABANDONED_REASON,
            )

    def _counted_by_front_end(self, counted: CountedAtStop) -> bool:
        if isinstance(counted, bool):
            return counted
        try:
            return counted()
        except Exception:  # a bug: counted here rather than nowhere
            logger.exception("%s: asking whether a request was counted at the stop failed", self.name)
            return False

    # -- pool hand-off ---------------------------------------------------------------------

    def submit(
        self,
        work: Callable[[], Any],
        done: Done,
        *,
        counted_at_stop: CountedAtStop = False,
        message_bytes: int = 0,
    ) -> None:
        """Run ``work`` on the pool; then, on the loop thread, ``done(result, None)`` or
        ``done(None, exception)``.

        ``counted_at_stop`` (a flag, or a question asked at the loop's end) says whether
        the front end counts the request itself if the stop gives up on it before ``done``
        runs; if not, the router counts it (:meth:`_count_abandoned`).  ``message_bytes``
        is the size of the request's message, held on the pool's byte bound until ``done``."""

        token = object()  # this request's span in DATA_PLANE

        def run() -> None:
            try:
                item: _Completion = (done, work(), None, token, message_bytes)
            except BaseException as exc:
                item = (done, None, exc, token, message_bytes)
            self._completions.append(item)
            self._wake()
            if self._waiting_for_room:
                self._room.set()

        self.in_pool += 1
        self.pool_bytes += message_bytes
        self._unanswered[token] = counted_at_stop
        DATA_PLANE.begin(token)
        self._pool.submit(run)

    def _finish_completions(self) -> None:
        while self._completions:
            done, result, error, token, message_bytes = self._completions.popleft()
            self.in_pool -= 1
            self.pool_bytes -= message_bytes
            self._unanswered.pop(token, None)
            DATA_PLANE.end(token)
            try:
                done(result, error)
            except Exception:
                logger.exception("%s: finishing a pool request failed", self.name)

    # -- replying --------------------------------------------------------------------------

    def send(self, frames: Sequence[Any]) -> bool:
        """Send ``[identity, ...]`` as one message without blocking; a reply that cannot go
        (the client is gone, or not reading) is counted as ``reply_dropped`` and logged."""
        DATA_PLANE.touch()
        sock = self.socket
        identity = frames[0]
        last = len(frames) - 1
        index = 0
        try:
            if last == 1 and type(frames[1]) is bytes and len(frames[1]) < _ZERO_COPY_BYTES:
                # The usual reply, a header alone: no per-frame tests.
                _raw_send(sock, identity, _SNDMORE_NOBLOCK)
                _raw_send(sock, frames[1], _NOBLOCK)
                return True
            for index, frame in enumerate(frames):
                flags = _SNDMORE_NOBLOCK if index < last else _NOBLOCK
                if isinstance(frame, bytes) and len(frame) < _ZERO_COPY_BYTES:
                    _raw_send(sock, frame, flags)
                else:
                    sock.send(frame, flags, copy=False)
            return True
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
        except Exception:
            # A frame libzmq cannot take (a bad type, a released buffer).  Frames already
            # sent leave a message open: it is ended here, or the next reply's frames would
            # join it and go to this client instead of their own.  It must not arrive with
            # the reply's own frame count: an empty frame in place of the last payload
            # would pass for that object's bytes, so the last one failing ends with two.
            if index > 0:
                with contextlib.suppress(zmq.ZMQError):
                    if index == last:
                        _raw_send(sock, b"", _SNDMORE_NOBLOCK)
                    _raw_send(sock, b"", _NOBLOCK)
            self.stats.failure("reply_dropped")
            logger.exception(
                "%s: dropped a reply to %s: a frame could not be sent", self.name, identity.hex()
            )
        return False


#: how often a stale socket file at the path is replaced before the bind gives up
_PLACE_ATTEMPTS = 3
#: an ipc:// socket is bound in a private directory next to its path named this and 8
#: random characters: by it the next start knows one a server killed while binding left
BIND_DIRECTORY_PREFIX = ".tiers-"
#: the socket's name in that directory
STAGED_SOCKET_NAME = "s"
#: where a stale socket found at the path is moved, in that directory, to be removed
_ASIDE_NAME = "stale"
#: a name as ``tempfile.mkdtemp`` makes it with that prefix (8 of ``[a-z0-9_]``): a
#: directory named otherwise is a user's, whatever it starts with
_BIND_DIRECTORY_NAME = re.compile(re.escape(BIND_DIRECTORY_PREFIX) + "[a-z0-9_]{8}")
#: how long a probe of a socket file waits for its listener before taking it as live
SOCKET_PROBE_TIMEOUT_S = 1.0


def socket_file_listened(path: str) -> bool:
    """Whether something listens on the Unix socket file at ``path`` (False: connections
    are refused, a stale file; a file gone raises FileNotFoundError, as do other errors).

    The connect does not block: a listener whose backlog is full (a live server that
    cannot accept, at its open files limit) answers EAGAIN at once where a blocking
    connect would wait for room, possibly for ever.  That, and a connect not done within
    :data:`SOCKET_PROBE_TIMEOUT_S`, count as listened on: a live server is never taken
    for a stale one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(SOCKET_PROBE_TIMEOUT_S)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return False
        except (BlockingIOError, TimeoutError):
            return True
    return True


def _make_locked_bind_directory(directory: str) -> tuple[str, int]:
    """A fresh 0700 bind directory in ``directory`` and a descriptor open on it (for its lock)."""
    private = tempfile.mkdtemp(prefix=BIND_DIRECTORY_PREFIX, dir=directory)
    try:
        return private, os.open(private, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        os.rmdir(private)
        raise


# flock's answers on a filesystem without file locks (NFS without a lock manager).
_NO_FILE_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP})


def _lock_bind_directory(lock: int, private: str, owner: str) -> None:
    """Take the bind directory's lock, or bind without it where the filesystem has none.

    The lock only keeps a start-up clean-up off a directory a server is binding in, and
    the clean-up takes no directory whose lock it cannot ask for: without file locks
    nothing removes this one either, so binding goes on (refusing would stop every server
    whose socket is on such a filesystem); leftovers of killed servers then stay there."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as exc:
        if exc.errno not in _NO_FILE_LOCKS:
            raise
        logger.warning(
            "%s: no file locks for %s (%s): binding without the bind directory's lock; "
            "directories left there by servers killed while binding are not removed",
            owner,
            private,
            exc.strerror,
        )


def _remove_dead_bind_directories(directory: str, owner: str) -> None:
    """Remove the private bind directories in ``directory`` left by servers killed while
    they bound their socket (SIGKILL between the bind and the removal of the directory).

    A racing server's directory is never taken: it holds the directory's lock from
    before it puts anything in it until the directory is gone (the kernel drops the lock
    with the process), so one whose lock is held is in use, and an empty one may be
    about to be locked.  Only a directory such as the bind makes -- named as
    ``tempfile.mkdtemp`` names it, this user's, mode ``0700`` -- locked here, not a
    symlink, and holding nothing but the bind's own socket names, each a socket that
    refuses connections, is removed: a user's directory that only looks like one keeps
    what it holds."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        logger.warning(
            "%s: cannot look for leftover bind directories in %s: %s", owner, directory, exc.strerror
        )
        return
    for name in names:
        if _BIND_DIRECTORY_NAME.fullmatch(name):
            _remove_bind_directory_if_dead(os.path.join(directory, name), owner)


def _remove_bind_directory_if_dead(private: str, owner: str) -> None:
    try:
        lock = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return  # gone meanwhile, or not a directory of ours
    try:
        if not _made_by_a_bind(os.fstat(lock)):
            return  # another user's, or a directory this user made otherwise
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # a server binding right now
        except OSError as exc:
            if exc.errno not in _NO_FILE_LOCKS:
                raise
            logger.warning(
                "%s: cannot tell whether %s is in use (no file locks here: %s): left in place",
                owner,
                private,
                exc.strerror,
            )
            return
        entries = os.listdir(lock)
        if not entries or not set(entries) <= {STAGED_SOCKET_NAME, _ASIDE_NAME}:
            return  # empty (about to be locked), or holding what a bind never puts there
        if not all(_dead_socket_file(os.path.join(private, entry)) for entry in entries):
            return
        for entry in entries:  # in the directory opened and judged, wherever it is now
            os.unlink(entry, dir_fd=lock)
        os.rmdir(private)
        logger.info("%s: removed %s, left by a server killed while it bound its socket", owner, private)
    except OSError as exc:
        logger.warning(
            "%s: cannot remove %s, left by a server killed while it bound its socket: %s",
            owner,
            private,
            exc.strerror,
        )
    finally:
        os.close(lock)


def _made_by_a_bind(found: os.stat_result) -> bool:
    """This user's, with the ``0700`` mode ``tempfile.mkdtemp`` gives and the bind keeps."""
    return found.st_uid == os.geteuid() and stat.S_IMODE(found.st_mode) == 0o700


def _dead_socket_file(path: str) -> bool:
    """A socket file nothing listens on; anything else (or an error looking) is left."""
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode) and not socket_file_listened(path)
    except OSError:
        return False


def _place_socket(staged: str, path: str, aside: str) -> None:
    """Link the bound socket file ``staged`` at ``path``, replacing only a stale socket.

    A live server's socket there (one started with this one, both past the pre-flight)
    refuses the bind with EADDRINUSE, as does any other file.  A socket nothing listens
    on (a killed server's) is first moved to ``aside``, in the private directory, and
    removed only if it is the very file found stale: were it a racing server's fresh
    socket, it goes back where it was.

    Putting it back leaves one narrow window, only when three servers start on one path
    at the same instant over a stale socket: between the move and the link back the path
    is free, and a third server linking its socket there keeps it; the racing server's
    socket then has nowhere to go (the link back fails, this server is refused) and that
    server serves on, unreachable, until stopped.  Closing it takes an atomic exchange
    (``renameat2`` with ``RENAME_EXCHANGE``), which Python does not offer and not every
    filesystem supports; docs/server.md says so."""
    for _ in range(_PLACE_ATTEMPTS):
        try:
            os.link(staged, path)
            return
        except FileExistsError:
            stale_inode = _stale_socket_inode(path)
            if stale_inode is None:
                raise OSError(errno.EADDRINUSE, "already in use (another server?), or not a socket") from None
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue  # gone meanwhile: link again
        if os.lstat(aside).st_ino != stale_inode:
            # Another server placed its socket between the look and the move: give it back.
            os.link(aside, path)
            raise OSError(errno.EADDRINUSE, "already in use (another server?)")
        os.unlink(aside)
    raise OSError(errno.EADDRINUSE, "another server keeps taking the path")


def _stale_socket_inode(path: str) -> int | None:
    """The inode of the socket file at ``path`` when nothing listens on it, else None."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    return found.st_ino if _dead_socket_file(path) else None


def _seed_routing_ids(name: str) -> None:
    """Seed the C library's ``rand()`` from the OS's randomness, just before a ROUTER is made.

    libzmq numbers a ROUTER's connections (those whose peer chose no routing identity) from
    a start drawn from ``rand()`` when the socket is made, which nothing seeds: every
    server handed out the same identities (``006b8b4567`` and on, one more per connection).
    A peer may choose its identity, one of those too, and libzmq aborts the whole process
    (an assertion in its table of peers) when it hands a new connection an identity a peer
    holds: a local client claiming the next few hundred identities, then connecting once
    more (or any ordinary client connecting next), killed the server.  Seeded, the start is
    one of 2^32 that no peer can hold connections enough to cover."""
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError) as exc:  # no C library to call: the start stays known
        logger.warning(
            "%s: could not seed the C library's rand() (%s): a client choosing the routing "
            "identities this ROUTER hands out next can make libzmq abort the server",
            name,
            exc,
        )
