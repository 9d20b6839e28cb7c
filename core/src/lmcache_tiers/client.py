"""Python client of the lmcache-tiers server, used by engines, tests and benchmarks.

::

    from lmcache_tiers.client import Client

    with Client("tcp://127.0.0.1:5555") as client:
        client.store(keys, tensors)               # bytes, memoryview, numpy, torch CPU
        hits = client.lookup(keys, timeout=5.0)   # prefix hits in L1+L2, waits for prefetch
        with client.retrieve(keys[:hits]) as views:
            for view, out in zip(views, outputs):
                out[:] = view                       # one copy out of the server's memory

On the same host the client maps the server's L1 shared-memory segment: a store reserves
extents, copies the caller's bytes in and commits; a retrieve read-locks objects, hands out
read-only views into the segment and releases the locks when the ``with`` block ends, so
no payload byte crosses the socket.  Elsewhere (or with ``shm=False``) the bytes travel
inline in the messages and the same calls work unchanged.

A ``lookup`` leaves its hit prefix read-locked for this client so the objects cannot be
evicted before they are retrieved; ``retrieve`` (on exit) and ``release`` drop those
locks, and the server's lock TTL reclaims them from a client that never does.

A shared-memory view is valid while its lock lives (its *lease*).  The server never
reuses a locked extent, and holds it back for a while even when a lock was broken (a
forced clear, the lock TTL); should a reader still outlast that, the segment's
generation table shows the extent changed hands, and ``retrieve`` raises
:class:`StaleReadError` at the end of its block (``retrieve_into`` retries first)
instead of letting wrong bytes pass as the object's.

One Client is one ZeroMQ socket: calls are serialized with a lock, so sharing a client
between threads is safe but not parallel; use one client per thread for parallelism.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import msgspec
import numpy as np
import zmq

from lmcache_tiers.errors import TiersError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.layout import check_layout, layout_of
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.shm import (
    BufferLike,
    MappedSegment,
    SegmentMismatch,
    as_byte_array,
    as_writable_byte_array,
)

__all__ = [
    "AUTH_TOKEN_ENV",
    "Client",
    "ClientError",
    "ProtocolError",
    "RequestTimeoutError",
    "ServerError",
    "StaleReadError",
]

AUTH_TOKEN_ENV = "LMCACHE_TIERS_AUTH_TOKEN"

_R = TypeVar("_R", bound=p._Reply)

# Plain ints: pyzmq's flags are Python enums, and combining them runs enum code on every
# request, a noticeable share of a LOOKUP round trip.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE | zmq.NOBLOCK)
_OK = p.ErrorCode.OK.value


class ClientError(TiersError):
    """Base class of every error the client raises."""


class RequestTimeoutError(ClientError, TimeoutError):
    """The server did not answer in time (not running, overloaded, or unreachable)."""


class ProtocolError(ClientError):
    """The server answered something this client cannot understand."""


class ServerError(ClientError):
    """The server answered with an error code."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.server_message = message


class StaleReadError(ClientError):
    """Objects whose extents changed hands while this client read them (its lease was
    broken by a forced clear or outlived by the lock TTL): the bytes read for ``keys``
    may belong to other objects and must not be used."""

    def __init__(self, keys: Sequence[ObjectKey]) -> None:
        first = keys[0]
        super().__init__(
            f"the bytes of {len(keys)} retrieved objects may have changed while they were held "
            f"(first: model {first.model_name!r}, chunk {first.chunk_hash.hex()[:16]}); "
            "their lease ended early (a forced clear, or held past the lock TTL): retrieve them again"
        )
        self.keys = list(keys)


def _sent_layouts(layouts: Sequence[str]) -> list[str]:
    """What goes on the wire: nothing at all when no object has a known layout."""
    return list(layouts) if any(layouts) else []


def _copy_into(target: np.ndarray[Any, Any], source: np.ndarray[Any, Any]) -> None:
    if target.nbytes < source.nbytes:
        raise ValueError(f"buffer of {target.nbytes} bytes is too small for {source.nbytes}")
    target[: source.nbytes] = source


def _error_code(value: int) -> p.ErrorCode:
    try:
        return p.ErrorCode(value)
    except ValueError:
        return p.ErrorCode.INTERNAL


class Client:
    """Connection to one lmcache-tiers server.

    ``timeout`` bounds every request (seconds).  ``auth_token`` defaults to
    ``$LMCACHE_TIERS_AUTH_TOKEN``.  ``shm``: use the server's shared-memory segment when
    it offers one and this process can map it (same host, same ``/dev/shm``), else send
    bytes inline; False always sends bytes inline.  ``uses_shm`` tells which it is.
    """

    #: how many times ``retrieve_into`` asks again for objects whose extents changed hands
    STALE_RETRIES = 2

    def __init__(
        self,
        url: str = p.DEFAULT_URL,
        *,
        timeout: float = 10.0,
        auth_token: str | None = None,
        shm: bool = True,
        name: str = "",
    ) -> None:
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        self.url = url
        self.timeout = timeout
        self._token = auth_token if auth_token is not None else os.environ.get(AUTH_TOKEN_ENV, "")
        if len(self._token) > p.MAX_TOKEN_LEN or len(name) > p.MAX_TOKEN_LEN:
            raise ClientError(f"auth token and client name are limited to {p.MAX_TOKEN_LEN} characters")
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._segment: MappedSegment | None = None
        self._closed = False
        # requests that timed out, by id, in case their replies still arrive
        self._orphans: dict[int, p._Request] = {}
        self._receive_timeout_ms = -1
        # ids of requests sent and not yet answered, and answers that came in early
        self._outstanding: set[int] = set()
        self._early: dict[int, tuple[p.Reply, list[Any]]] = {}
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Fail fast instead of queueing requests forever for a peer that never appears.
        self._socket.setsockopt(zmq.IMMEDIATE, 1)
        try:
            try:
                self._socket.connect(url)
            except zmq.ZMQError as exc:
                raise ClientError(f"invalid server URL {url!r}: {exc}") from None
            self.server = self._call(
                p.Hello(0, self._token, p.PROTOCOL_VERSION, name, os.getpid()), p.HelloReply
            )
            self._segment = self._map_segment(shm)
        except BaseException:
            self.close()
            raise
        self.max_keys = max(1, self.server.max_keys)

    # -- connection ------------------------------------------------------------------------

    def _map_segment(self, shm: bool) -> MappedSegment | None:
        server = self.server
        if not shm or not server.shm_name:
            return None  # inline: asked for, or no segment offered (--no-shm, NVMe L1)
        try:
            return MappedSegment(
                server.shm_name,
                server.shm_size,
                server.shm_device,
                server.shm_inode,
                generation_offset=server.generation_offset,
                generation_block=server.generation_block,
            )
        except SegmentMismatch:
            return None  # another host or /dev/shm namespace: inline

    @property
    def uses_shm(self) -> bool:
        """True when bytes move through the mapped segment, False when they travel inline."""
        return self._segment is not None

    def close(self) -> None:
        """Close the socket and unmap the segment. Locks still held expire on the server."""
        if self._closed:
            return
        self._closed = True
        if self._segment is not None:
            self._segment.close()
            self._segment = None
        self._socket.close(0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "closed" if self._closed else ("shm" if self.uses_shm else "inline")
        return f"Client({self.url!r}, {mode})"

    # -- request/reply -----------------------------------------------------------------------

    def _call(
        self,
        request: p._Request,
        expect: type[_R],
        payloads: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> _R:
        reply, _ = self._exchange(request, expect, payloads, timeout)
        return reply

    def _exchange(
        self,
        request: p._Request,
        expect: type[_R],
        payloads: Sequence[Any] = (),
        timeout: float | None = None,
    ) -> tuple[_R, list[Any]]:
        with self._lock:
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            self._start(request, payloads, deadline)
            return self._await(request, expect, deadline)

    def _start(self, request: p._Request, payloads: Sequence[Any], deadline: float) -> None:
        """Send one request (caller holds the lock); its reply is collected by ``_await``."""
        if self._closed:
            raise ClientError("the client is closed")
        if os.getpid() != self._pid:
            raise ClientError("a Client cannot be used in a forked child; create a new one there")
        request.req_id = next(self._ids)
        request.token = self._token
        header = p.encode(request)
        if len(header) > p.MAX_HEADER_BYTES:
            # The server would refuse it anyway; say so now rather than after a round trip.
            raise ClientError(
                f"{type(request).__name__} encodes to {len(header)} bytes, over the protocol's "
                f"{p.MAX_HEADER_BYTES}-byte header limit"
            )
        self._send(header, payloads, deadline)
        self._outstanding.add(request.req_id)

    def _await(self, request: p._Request, expect: type[_R], deadline: float) -> tuple[_R, list[Any]]:
        """Receive until the reply to ``request`` arrives; replies to other outstanding
        requests of this client are kept for their own ``_await``."""
        req_id = request.req_id
        # Zero-copy frames only where payloads come back; plain bytes are cheaper.
        zero_copy = isinstance(request, p.Retrieve) and request.inline
        arrived = self._early.pop(req_id, None)
        while arrived is None:
            remaining = deadline - time.monotonic()
            frames = self._receive(remaining, zero_copy) if remaining > 0 else None
            if frames is None:
                self._outstanding.discard(req_id)
                self._remember_orphan(request)
                raise RequestTimeoutError(f"no reply from {self.url} to {type(request).__name__} in time")
            try:
                reply = p.reply_decoder.decode(frames[0])
            except msgspec.DecodeError as exc:
                raise ProtocolError(f"undecodable reply from {self.url}: {exc}") from None
            if reply.req_id == req_id:
                arrived = reply, frames
            elif reply.req_id in self._outstanding:
                self._early[reply.req_id] = (reply, frames)
            else:
                self._settle_orphan(reply)
        self._outstanding.discard(req_id)
        reply, frames = arrived
        if reply.code != _OK:
            raise ServerError(_error_code(reply.code), reply.message)
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected {expect.__name__} but got {type(reply).__name__}")
        return reply, frames[1:]

    def _receive(self, seconds: float, zero_copy: bool) -> list[Any] | None:
        # A blocking receive with a timeout wakes up faster than polling first.
        timeout_ms = max(1, int(seconds * 1000))
        if timeout_ms != self._receive_timeout_ms:
            self._socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._receive_timeout_ms = timeout_ms
        # Frames carry their "more" flag; recv_multipart would ask getsockopt(RCVMORE),
        # which runs pyzmq's Python-level option lookup, for every part.
        sock = self._socket
        try:
            part = sock.recv(copy=False)
            frames: list[Any] = [part if zero_copy else part.bytes]
            while part.more:
                part = sock.recv(copy=False)
                frames.append(part if zero_copy else part.bytes)
        except zmq.Again:
            return None
        return frames

    def _send(self, header: bytes, payloads: Sequence[Any], deadline: float) -> None:
        sock = self._socket
        while True:
            try:
                sock.send(header, _SNDMORE_NOBLOCK if payloads else _NOBLOCK)
                break
            except zmq.Again:
                # IMMEDIATE: nothing is queued while the server is unreachable, so a request
                # never reaches a server long after its caller gave up on it.
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not sock.poll(max(1, int(remaining * 1000)), zmq.POLLOUT):
                    raise RequestTimeoutError(f"cannot reach the server at {self.url}") from None
        last = len(payloads) - 1
        for index, payload in enumerate(payloads):
            sock.send(payload, _SNDMORE if index < last else 0, copy=False)

    def _remember_orphan(self, request: p._Request) -> None:
        if isinstance(request, (p.StoreReserve, p.Retrieve, p.Lookup)):
            self._orphans[request.req_id] = request
            while len(self._orphans) > 1024:
                self._orphans.pop(next(iter(self._orphans)))

    def _settle_orphan(self, reply: p._Reply) -> None:
        """A reply arrived after its request timed out: give back what it took on our
        behalf (reservations, read locks), which nobody will otherwise release before the
        server's TTL.  The follow-up request's own reply is discarded like this one."""
        request = self._orphans.pop(reply.req_id, None)
        if request is None or reply.code != p.ErrorCode.OK:
            return
        follow_up: p._Request | None = None
        if isinstance(request, p.StoreReserve) and isinstance(reply, p.StoreReserveReply):
            keys = [k for k, slot in zip(request.keys, reply.slots, strict=False) if slot.offset != p.NO_SLOT]
            follow_up = p.StoreAbort(next(self._ids), self._token, keys) if keys else None
        elif isinstance(request, p.Retrieve) and isinstance(reply, p.RetrieveReply) and not request.inline:
            follow_up = p.Release(next(self._ids), self._token, request.keys[: len(reply.slots)])
        elif isinstance(request, p.Lookup) and isinstance(reply, p.LookupReply) and reply.hits:
            follow_up = p.Release(next(self._ids), self._token, request.keys[: reply.hits])
        if follow_up is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._socket.send(p.encode(follow_up), zmq.NOBLOCK)

    def _batches(self, count: int) -> Iterator[slice]:
        for start in range(0, count, self.max_keys):
            yield slice(start, min(count, start + self.max_keys))

    # -- API ---------------------------------------------------------------------------------

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time in seconds."""
        start = time.perf_counter()
        self._call(p.Ping(0, ""), p.PingReply, timeout=timeout)
        return time.perf_counter() - start

    def status(self) -> dict[str, Any]:
        """The server's state, the same document as its HTTP ``/status``."""
        return self._call(p.Status(0, ""), p.StatusReply).status

    def clear(self, *, force: bool = False) -> int:
        """Delete every unlocked object from L1 (every object with ``force``)."""
        return self._call(p.Clear(0, "", force), p.ClearReply).cleared

    def store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[BufferLike],
        layouts: Sequence[str] | None = None,
    ) -> int:
        """Store ``buffers[i]`` under ``keys[i]``; returns how many keys were newly stored.

        Keys already on the server are skipped, and so are keys another client is storing
        at the same moment: those become readable when that client commits them, so a
        lookup right after this call may not find them yet.

        ``layouts`` name each object's tensor layout (``"bfloat16[2,16,256,1024]"``, see
        :mod:`lmcache_tiers.layout`) for serdes that need it; by default they are taken
        from torch tensors and numpy arrays, and are unknown for plain bytes.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if layouts is None:
            layouts = [layout_of(buffer) for buffer in buffers]
        elif len(layouts) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(layouts)} layouts")
        arrays = [as_byte_array(buffer) for buffer in buffers]
        if any(array.nbytes == 0 for array in arrays):
            raise ValueError("cannot store an empty buffer")
        for layout, array in zip(layouts, arrays, strict=True):
            check_layout(layout, array.nbytes)
        stored = 0
        if self._segment is not None:
            for part in self._batches(len(keys)):
                stored += self._store_shm(
                    list(keys[part]), arrays[part], _sent_layouts(layouts[part]), self._segment
                )
        else:
            for batch_keys, batch_arrays, batch_layouts in self._inline_batches(
                list(keys), arrays, list(layouts)
            ):
                request = p.StoreInline(0, "", batch_keys, _sent_layouts(batch_layouts))
                reply = self._call(request, p.StoreReply, payloads=batch_arrays)
                stored += sum(reply.done)
        return stored

    def _inline_batches(
        self, keys: list[ObjectKey], arrays: list[np.ndarray[Any, Any]], layouts: list[str]
    ) -> Iterator[tuple[list[ObjectKey], list[np.ndarray[Any, Any]], list[str]]]:
        limit = max(1, self.server.max_inline_bytes)
        largest = max(array.nbytes for array in arrays)
        if largest > limit:
            raise ClientError(
                f"a {largest}-byte chunk is over the server's inline limit of {limit} bytes: "
                "store smaller chunks, or from the server's host through shared memory"
            )
        start = 0
        while start < len(keys):
            end, total = start, 0
            while (
                end < len(keys)
                and end - start < self.max_keys
                and (end == start or total + arrays[end].nbytes <= limit)
            ):
                total += arrays[end].nbytes
                end += 1
            yield keys[start:end], arrays[start:end], layouts[start:end]
            start = end

    def _store_shm(
        self,
        keys: list[ObjectKey],
        arrays: list[np.ndarray[Any, Any]],
        layouts: list[str],
        segment: MappedSegment,
    ) -> int:
        sizes = [array.nbytes for array in arrays]
        reply = self._call(p.StoreReserve(0, "", keys, sizes, layouts), p.StoreReserveReply)
        if len(reply.slots) != len(keys):
            raise ProtocolError(f"STORE_RESERVE answered {len(reply.slots)} slots for {len(keys)} keys")
        reserved = [key for key, slot in zip(keys, reply.slots, strict=True) if slot.offset != p.NO_SLOT]
        if not reserved:
            return 0
        try:
            # A reservation that already changed hands (this process stalled past the write
            # TTL and its grace period) is not written into: that extent is someone else's
            # now.  Its commit is refused by the server, which expired it.
            lost = {reply.slots[index].offset for index in segment.changed(reply.slots)}
            target = segment.array
            for array, slot in zip(arrays, reply.slots, strict=True):
                if slot.offset == p.NO_SLOT or slot.offset in lost:
                    continue
                if slot.size != array.nbytes:
                    raise ProtocolError(f"reserved {slot.size} bytes for a {array.nbytes}-byte buffer")
                segment.check_slot(slot.offset, slot.size)
                target[slot.offset : slot.offset + slot.size] = array
        except BaseException:
            with contextlib.suppress(ClientError):
                self._call(p.StoreAbort(0, "", reserved), p.StoreReply)
            raise
        done = self._call(p.StoreCommit(0, "", reserved), p.StoreReply).done
        return sum(done)

    def lookup(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> int:
        """How many leading keys the server holds in L1 or L2, waiting (up to ``timeout``,
        default the client's) for their prefetch from L2 into L1.  The hit prefix stays
        read-locked for this client until ``retrieve`` finishes with it or ``release``.

        More keys than the server takes in one request are looked up part by part, each
        part only while the one before it was a full hit (the answer is a prefix).
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        keys = list(keys)
        hits = 0
        for part in self._batches(len(keys)):
            found = self._lookup_part(keys[part], deadline, limit)
            hits += found
            if found < part.stop - part.start:
                break
        return hits

    def _lookup_part(self, keys: list[ObjectKey], deadline: float, limit: float) -> int:
        remaining = max(0.0, deadline - time.monotonic())
        reply = self._call(p.Lookup(0, "", keys), p.LookupReply, timeout=remaining)
        if reply.hits is not None:
            return reply.hits
        hits = self.wait_prefetch(reply.handle, max(0.0, deadline - time.monotonic()))
        if hits is None:
            raise RequestTimeoutError(f"prefetch of {len(keys)} keys did not finish within {limit:g}s")
        return hits

    def lookup_many(
        self, key_lists: Sequence[Sequence[ObjectKey]], timeout: float | None = None, window: int = 64
    ) -> list[int]:
        """``lookup`` for several prompts at once (e.g. one scheduler step), with up to
        ``window`` requests in flight: one round trip's latency instead of one per prompt."""
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        results: list[int | None] = [None] * len(key_lists)
        waiting: list[tuple[int, int]] = []  # (position, prefetch handle)
        with self._lock:
            for begin in range(0, len(key_lists), max(1, window)):
                batch = range(begin, min(len(key_lists), begin + max(1, window)))
                # Prompts longer than one request start with their first part here and
                # continue below, once that part is known to be a full hit.
                requests = [p.Lookup(0, "", list(key_lists[i])[: self.max_keys]) for i in batch]
                for request in requests:
                    self._start(request, (), deadline)
                try:
                    for position, request in zip(batch, requests, strict=True):
                        reply, _ = self._await(request, p.LookupReply, deadline)
                        if reply.hits is None:
                            waiting.append((position, reply.handle))
                        else:
                            results[position] = reply.hits
                except BaseException:
                    # Lookups still in flight lock keys for us: release them when they land.
                    for request in requests:
                        if request.req_id in self._outstanding:
                            self._outstanding.discard(request.req_id)
                            self._remember_orphan(request)
                            arrived = self._early.pop(request.req_id, None)
                            if arrived is not None:
                                self._settle_orphan(arrived[0])
                    raise
            for position, handle in waiting:
                hits = self.wait_prefetch(handle, max(0.0, deadline - time.monotonic()))
                if hits is None:
                    raise RequestTimeoutError(f"prefetch did not finish within {limit:g}s")
                results[position] = hits
            for position, keys in enumerate(key_lists):
                first = results[position] or 0
                if len(keys) > self.max_keys and first == self.max_keys:
                    rest = list(keys)[self.max_keys :]
                    left = max(0.0, deadline - time.monotonic())
                    results[position] = first + self.lookup(rest, timeout=left)
        return [hits or 0 for hits in results]

    def start_lookup(self, keys: Sequence[ObjectKey]) -> tuple[int, int | None]:
        """Start a lookup without waiting: (handle, hits or None while the prefetch runs).

        One handle covers one request, so at most ``max_keys`` keys (``lookup`` takes any
        number)."""
        if len(keys) > self.max_keys:
            raise ValueError(
                f"start_lookup takes at most {self.max_keys} keys (the server's limit per request), "
                f"got {len(keys)}: use lookup(), which looks longer prompts up part by part"
            )
        reply = self._call(p.Lookup(0, "", list(keys)), p.LookupReply)
        return reply.handle, reply.hits

    def query_prefetch(self, handle: int) -> int | None:
        """Non-blocking: the hit count of a started lookup, or None while it runs."""
        return self._call(p.QueryPrefetchStatus(0, "", handle), p.PrefetchStatusReply).hits

    def wait_prefetch(self, handle: int, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for a started lookup; None if still running."""
        request = p.WaitPrefetchStatus(0, "", handle, min(max(timeout, 0.0), 3600.0))
        # The server answers at its deadline; allow for the round trip on top.
        return self._call(request, p.PrefetchStatusReply, timeout=timeout + max(1.0, self.timeout)).hits

    @contextlib.contextmanager
    def retrieve(self, keys: Sequence[ObjectKey]) -> Iterator[list[memoryview]]:
        """Read-only views of the hit prefix of ``keys`` (possibly fewer than asked).

        Shared-memory views point into the server's memory and are valid only inside the
        ``with`` block; on exit they are released together with every lock this client
        holds on ``keys`` (including its LOOKUP's), so do not nest retrieves of the same
        keys.  If the lease of some objects ended early (a forced clear, or held past the
        lock TTL) and their extents changed hands while the block ran, leaving it raises
        :class:`StaleReadError` naming them: whatever was read from those views is void.
        """
        keys = list(keys)
        segment = self._segment
        if segment is None:
            yield self._retrieve_inline(keys)
            return
        with self._lease(keys, segment) as slots:
            views = [segment.buffer[slot.offset : slot.offset + slot.size].toreadonly() for slot in slots]
            try:
                yield views
                # Checked while the locks still hold: after RELEASE the extents may be
                # reused legitimately.
                stale = segment.changed(slots)
            finally:
                for view in views:
                    with contextlib.suppress(BufferError):
                        view.release()  # any later use raises instead of reading reused memory
        if stale:
            raise StaleReadError([keys[index] for index in stale])

    @contextlib.contextmanager
    def _lease(self, keys: list[ObjectKey], segment: MappedSegment) -> Iterator[list[p.Slot]]:
        """Read-lock the hit prefix of ``keys`` (RETRIEVE, part by part) and yield its arena
        slots; on exit release every lock this client holds on ``keys``."""
        slots: list[p.Slot] = []
        try:
            for part in self._batches(len(keys)):
                batch = keys[part]
                reply = self._call(p.Retrieve(0, "", batch), p.RetrieveReply)
                if len(reply.slots) > len(batch):
                    raise ProtocolError(f"RETRIEVE answered {len(reply.slots)} slots for {len(batch)} keys")
                for slot in reply.slots:
                    segment.check_slot(slot.offset, slot.size)
                slots.extend(reply.slots)
                if len(reply.slots) < len(batch):
                    break
            yield slots
        finally:
            if slots and not self._closed:
                self.release(keys)

    def _retrieve_inline(self, keys: list[ObjectKey]) -> list[memoryview]:
        views: list[memoryview] = []
        position = 0
        while position < len(keys):
            batch = keys[position : position + self.max_keys]
            reply, frames = self._exchange(p.Retrieve(0, "", batch, inline=True), p.RetrieveReply)
            if len(frames) != len(reply.slots):
                raise ProtocolError(f"{len(reply.slots)} slots but {len(frames)} payload frames")
            views.extend(frame.buffer.toreadonly() for frame in frames)
            position += len(frames)
            if len(frames) < len(batch) and not reply.truncated:
                break
            if not frames:
                break
        return views

    def retrieve_into(self, keys: Sequence[ObjectKey], buffers: Sequence[BufferLike]) -> int:
        """Copy the hit prefix of ``keys`` into ``buffers`` (one copy per object); returns the
        number of keys copied.  Each buffer must be at least as large as its object.

        Each copy is checked against the generation the server handed out with its slot;
        objects whose extent changed hands meanwhile are retrieved again (up to
        ``STALE_RETRIES`` times), then :class:`StaleReadError` is raised.
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        targets = [as_writable_byte_array(buffer) for buffer in buffers]
        segment = self._segment
        if segment is None:
            with self.retrieve(keys) as views:
                for view, target in zip(views, targets, strict=False):
                    _copy_into(target, np.frombuffer(view, dtype=np.uint8))
                return len(views)
        keys = list(keys)
        done = 0
        for _ in range(self.STALE_RETRIES + 1):
            rest = keys[done:]
            with self._lease(rest, segment) as slots:
                source = segment.array
                for slot, target in zip(slots, targets[done:], strict=False):
                    _copy_into(target, source[slot.offset : slot.offset + slot.size])
                stale = segment.changed(slots)
            if not stale:
                return done + len(slots)
            done += stale[0]  # the copies before the first stale one are good
            lost = [rest[index] for index in stale]
        raise StaleReadError(lost)

    def release(self, keys: Sequence[ObjectKey]) -> int:
        """Drop every lock this client holds on ``keys``; returns how many keys had one."""
        released = 0
        keys = list(keys)
        for part in self._batches(len(keys)):
            released += self._call(p.Release(0, "", keys[part]), p.ReleaseReply).released
        return released
