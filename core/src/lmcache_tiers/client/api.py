"""The :class:`Client`: store, lookup, retrieve and release over one :class:`Connection`."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from lmcache_tiers.client.connection import (
    CLEANUP_TIMEOUT_S,
    Connection,
    checked_handle,
    checked_keys,
    checked_timeout,
    checked_wait,
)
from lmcache_tiers.client.errors import (
    ClientError,
    ConnectionLostError,
    ProtocolError,
    RequestTimeoutError,
    ServerError,
    StaleReadError,
)
from lmcache_tiers.client.lock_epochs import LockEpochs
from lmcache_tiers.client.spin import REPLY_SPIN_S
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.layout import check_layout, layout_of, reader_layout_of
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.shm import (
    BufferLike,
    MappedSegment,
    SegmentMismatch,
    as_byte_array,
    as_writable_byte_array,
)


def _sent_layouts(layouts: Sequence[str]) -> list[str]:
    """What goes on the wire: nothing at all when no object has a known layout."""
    return list(layouts) if any(layouts) else []


def _checked_layouts(layouts: Sequence[str], count: int) -> list[str]:
    """``layouts`` as a list of one string per key.  Anything else failed deep inside the
    call (an AttributeError of ``startswith``, a TypeError of the layout parser) or, for
    None, went out as no layout at all."""
    if isinstance(layouts, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"layouts must be a sequence of strings, one per key, not a {type(layouts).__name__}")
    listed = list(layouts)
    for position, layout in enumerate(listed):
        if not isinstance(layout, str):
            raise TypeError(
                f"layouts[{position}] is a {type(layout).__name__}, not a str ('' for plain bytes)"
            )
    if len(listed) != count:
        raise ValueError(f"{count} keys but {len(listed)} layouts")
    return listed


logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class _ServerChanged(ClientError):
    """The connection dropped while a request that names arena offsets was answered: the
    reply may come from a restarted server, whose offsets are not in the mapped segment.
    What it took has been given back; the client greets the server and tries once more."""

    def __init__(self, url: str) -> None:
        super().__init__(
            f"the connection to {url} dropped while the request was answered (a server restart?), "
            "twice in a row; nothing was kept from it: call again"
        )


class _ReleaseProgress:
    """How far a ``release`` got: the keys whose requests were answered, and how many of
    them the server released."""

    def __init__(self) -> None:
        self.keys_done = 0
        self.released = 0


class _StoreProgress:
    """How far a shared-memory store got in ``segment``, kept across its attempts (see
    ``Client._on_current_server``): the keys whose batches were committed, and how many
    of them were newly stored."""

    def __init__(self) -> None:
        self.segment: MappedSegment | None = None
        self.keys_done = 0
        self.stored = 0


def _segment_identity(hello: p.HelloReply) -> tuple[Any, ...]:
    return (
        hello.shm_name,
        hello.shm_size,
        hello.shm_device,
        hello.shm_inode,
        hello.shm_dir,
        hello.generation_offset,
        hello.generation_block,
    )


def _check_slots(segment: MappedSegment, slots: list[p.Slot]) -> None:
    """The slots the server named must lie in the mapped arena: else the server and this
    mapping disagree, which is the server's answer at fault, not the caller's."""
    try:
        segment.check_slots(slots)
    except ValueError as exc:
        raise ProtocolError(f"the server named {exc}") from None


def _stored_count(request: str, reply: p.StoreReply, keys: Sequence[ObjectKey]) -> int:
    """How many of ``keys`` the reply to their STORE_COMMIT or STORE_INLINE (``request``)
    says were newly stored: one flag per key sent, in order.  Flags of another count cannot
    be matched to the keys -- one more counted a key stored that was never sent -- so that
    is the server's answer at fault, and nothing of it is counted."""
    if len(reply.done) != len(keys):
        raise ProtocolError(f"{request} answered {len(reply.done)} flags for {len(keys)} keys")
    return sum(reply.done)


def _copy_into(target: np.ndarray[Any, Any], source: np.ndarray[Any, Any]) -> None:
    if target.nbytes < source.nbytes:
        raise ValueError(f"buffer of {target.nbytes} bytes is too small for {source.nbytes}")
    target[: source.nbytes] = source


def _names_a_dtype(buffer: object) -> bool:
    """Whether a reader of ``buffer`` reads numbers (a tensor or array other than uint8),
    told without building its layout: only asked for a log line."""
    dtype = getattr(buffer, "dtype", None)
    return dtype is not None and str(dtype) not in ("uint8", "torch.uint8")


class Client(Connection):
    """Connection to one lmcache-tiers server.

    ``timeout`` bounds every request (seconds).  ``cleanup_timeout`` bounds, within it,
    the calls that clean up after a failed or interrupted one (the RELEASE or STORE_ABORT
    it leads to, the settling of late replies on ``close``): those often face a server
    that did not answer.  ``auth_token`` defaults to
    ``$LMCACHE_TIERS_AUTH_TOKEN``.  ``shm``: use the server's shared-memory segment when
    it offers one and this process can map it (same host, same ``/dev/shm``), else send
    bytes inline; False always sends bytes inline.  ``uses_shm`` tells which it is.
    ``reply_spin_s``: how long a call polls for its reply before sleeping on it (default
    0.5 ms; 0: never), which spares it the wake-up of an idle CPU
    (:mod:`lmcache_tiers.client.spin`).
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
        cleanup_timeout: float = CLEANUP_TIMEOUT_S,
        reply_spin_s: float = REPLY_SPIN_S,
    ) -> None:
        self._segment: MappedSegment | None = None
        # how many open retrieve blocks of this client read each key (see _stop_reading)
        self._reading: Counter[ObjectKey] = Counter()
        # for each key an open block reads, the newest connection a block of it took its
        # locks over (the drops seen before, see _leased): the last block out releases over
        # that one, which may be newer than its own (see _stop_reading)
        self._newest_lease: dict[ObjectKey, int] = {}
        # over which connection the newest read lock on each key was taken (see release)
        self._lock_epochs = LockEpochs()
        self._shm = shm
        # the HELLO whose segment is mapped (a server that restarted offers another one)
        self._mapped_from: p.HelloReply | None = None
        # the HELLO of the last server told it leaves readers' layouts unchecked
        self._layouts_unchecked_by: p.HelloReply | None = None
        super().__init__(
            url,
            timeout=timeout,
            auth_token=auth_token,
            name=name,
            cleanup_timeout=cleanup_timeout,
            reply_spin_s=reply_spin_s,
        )
        # Asked on every lookup: decided once (older servers would ignore the wait).
        self._lookup_waits = "lookup_wait" in self.server.features
        try:
            self._segment = self._map_segment(shm)
        except BaseException:
            self.close()
            raise

    def _map_segment(self, shm: bool) -> MappedSegment | None:
        server = self.server
        if not shm or not server.shm_name:
            return None  # inline: asked for, or no segment offered (--no-shm, NVMe L1)
        self._mapped_from = server
        try:
            return MappedSegment(
                server.shm_name,
                server.shm_size,
                server.shm_device,
                server.shm_inode,
                directory=server.shm_dir,
                generation_offset=server.generation_offset,
                generation_block=server.generation_block,
            )
        except SegmentMismatch as exc:
            # Another host or /dev/shm namespace, or another user (the segment is mode
            # 0600: it holds prompt-derived data): every byte goes through the socket.
            logger.warning("the server's L1 segment is not mapped (%s): bytes travel inline", exc)
            return None
        except OSError as exc:
            # The segment is this server's but the mapping failed (no address space or
            # map count left, say).  Raised from the call that followed a restarted
            # server, it left every later call inline without a word: say it once here.
            logger.warning(
                "the server's L1 segment %s could not be mapped (%s): bytes travel inline",
                server.shm_name,
                exc,
            )
            return None

    def _follow_server(self, timeout: float | None = None) -> None:
        """Before a request that names arena offsets: if the connection dropped since the
        last HELLO, greet the server again and, when it offers another segment than the
        mapped one (it restarted), map that one instead (or go inline).  Without this,
        offsets from a restarted server would be read from, and written into, the old
        server's memory: wrong bytes out, and stores acknowledged whose bytes never
        arrived.  ``timeout`` bounds the HELLO (None: the client's timeout)."""
        if not self._connection_dropped():
            return
        with self._lock:
            # Cleared before the HELLO, so that a drop seen during it sets it again; set
            # again if anything cuts this short (a signal handler's exception after the
            # HELLO too): until the segment the reply names is mapped, the old one must
            # not be trusted.
            try:
                self._dropped = False
                self._greeted_again(timeout)
            except BaseException:
                self._dropped = True
                raise

    def _follow_server_for_limits(self, timeout: float | None = None) -> None:
        """``_follow_server`` before a call that names no arena offsets but goes by the
        limits and features of the last HELLO (a lookup): a server restarted at the address
        may take fewer keys per request (it refuses a longer one as TOO_LARGE).  The
        connection events are read here only when the call's send would read them (see
        ``Connection._link_epoch``), so a lookup makes no system call more for it; a drop
        since that read, less than half a reconnect interval ago, is left to
        ``_refused_for_old_limits``.  ``timeout``: the bound of its HELLO, as in
        ``_follow_server``."""
        if self._dropped or not self._events_read_lately():
            self._follow_server(timeout)

    def _refused_for_old_limits(
        self, failure: ServerError, greeted: p.HelloReply, timeout: float | None = None
    ) -> bool:
        """Whether ``failure``, the refusal of a call cut by the limits of ``greeted``, came
        from a server restarted at the address since, with a lower key limit (the restart
        came after the call's look at the connection): that server is greeted now (within
        ``timeout``, the rest of the call's time; None: the client's), and the call is
        worth making once more, by its limits."""
        if failure.code is not p.ErrorCode.TOO_LARGE:
            return False
        self._follow_server(None if timeout is None else max(0.0, timeout))
        return self.server is not greeted

    def _greeted_again(self, timeout: float | None = None) -> None:
        """``_follow_server``'s HELLO and remapping (caller holds the lock)."""
        hello = self._greet(timeout)
        self.server = hello
        self.max_keys = max(1, hello.max_keys)
        self._lookup_waits = "lookup_wait" in hello.features
        mapped = self._mapped_from
        if mapped is not None and _segment_identity(mapped) == _segment_identity(hello):
            return  # the same server: the mapping stays right
        old, self._segment, self._mapped_from = self._segment, None, None
        if old is not None:
            old.close()  # unmapped once the retrieve blocks still reading it end
        self._segment = self._map_segment(self._shm)

    def _answered_elsewhere(self, segment: MappedSegment) -> bool:
        """Whether the offsets of a reply just received may name another segment than
        ``segment``: the connection dropped since the last HELLO, or another thread has
        greeted the server since ``segment`` was taken and mapped another one (a restarted
        server's) -- which clears the drop, so the drop alone would not tell."""
        with self._lock:
            return self._connection_dropped() or self._segment is not segment

    @contextlib.contextmanager
    def _mapped(self) -> Iterator[MappedSegment | None]:
        """The mapped segment (None: bytes travel inline), kept mapped until the block
        ends even if ``close`` or ``_follow_server`` (on any thread) closes it meanwhile.
        Taken under the lock they close it under, so it is never one already closed."""
        with contextlib.ExitStack() as stack:
            with self._lock:
                segment = self._segment
                if segment is not None:
                    stack.enter_context(segment.in_use())
            yield segment

    def _on_current_server(self, operation: Callable[[], _T]) -> _T:
        """Run ``operation`` after ``_follow_server``; once more if the connection dropped
        while it ran (it raised ``_ServerChanged`` after giving back what it took)."""
        self._follow_server()
        try:
            return operation()
        except _ServerChanged:
            self._follow_server()
            return operation()

    @property
    def uses_shm(self) -> bool:
        """True when bytes move through the mapped segment, False when they travel inline
        (it may change when the server restarts with another data plane)."""
        return self._segment is not None

    def close(self) -> None:
        """Close the socket and unmap the segment. Locks still held expire on the server;
        those that late replies to calls given up on hand over are given back first, for
        up to the clean-up bound (see ``Connection.close``).

        A call in progress on another thread is waited for (see ``Connection.close``); a
        ``retrieve`` block still open keeps the segment mapped until it ends, and its views
        stay readable until then."""
        with self._lock:
            segment, self._segment = self._segment, None
            if segment is not None:
                segment.close()
            super().close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "closed" if self._closed else ("shm" if self.uses_shm else "inline")
        return f"Client({self.url!r}, {mode})"

    # -- API ---------------------------------------------------------------------------------

    def ping(self, timeout: float | None = None) -> float:
        """Round-trip time in seconds."""
        seconds = self._call_seconds(timeout)
        start = time.perf_counter()
        self._call(p.Ping(0, ""), p.PingReply, timeout=seconds)
        return time.perf_counter() - start

    def status(self) -> dict[str, Any]:
        """The server's state, the same document as its HTTP ``/status``."""
        return self._call(p.Status(0, ""), p.StatusReply).status

    def clear(self, *, force: bool = False) -> int:
        """Delete every unlocked object from L1; returns how many.  With ``force`` also the
        read-locked ones: they leave L1 at once, but their readers keep their bytes until
        they release them.  Objects being written are left to their writers."""
        return self._call(p.Clear(0, "", force), p.ClearReply).cleared

    def evict(self, keys: Sequence[ObjectKey]) -> int:
        """Delete these keys from L1 (those nobody holds locked); L2 copies stay.  Returns
        how many were deleted.  Raises ClientError on a server without EVICT."""
        keys = checked_keys(keys)
        # Asked of the server the call goes to: one restarted at the address may be another
        # release, with other limits.
        self._follow_server()
        greeted = self.server
        try:
            return self._evict(keys)
        except ServerError as exc:
            if not self._refused_for_old_limits(exc, greeted):
                raise
        return self._evict(keys)

    def _evict(self, keys: list[ObjectKey]) -> int:
        if "evict" not in self.server_features:
            raise ClientError(f"the server at {self.url} has no EVICT request (it is older)")
        evicted = 0
        for part in self._batches(len(keys)):
            evicted += self._call(p.Evict(0, "", list(keys[part])), p.EvictReply).evicted
        return evicted

    @property
    def server_features(self) -> frozenset[str]:
        """What the server announced in HELLO (``protocol.FEATURES``); empty for older servers."""
        return frozenset(self.server.features)

    def store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[BufferLike],
        layouts: Sequence[str] | None = None,
        *,
        l1_only: bool = False,
    ) -> int:
        """Store ``buffers[i]`` under ``keys[i]``; returns how many keys were newly stored.

        Keys already on the server are skipped, and so are keys another client is storing
        at the same moment: those become readable when that client commits them, so a
        lookup right after this call may not find them yet.

        ``layouts`` name each object's tensor layout (``"bfloat16[2,16,256,1024]"``, see
        :mod:`lmcache_tiers.layout`) for serdes that need it; by default they are taken
        from torch tensors and numpy arrays, and are unknown for plain bytes.
        ``l1_only``: the server keeps them in L1 and never copies them to L2 (raises
        ClientError if it cannot promise that).

        A :class:`RequestTimeoutError` (a :class:`ConnectionLostError` too) leaves unknown
        which of the keys were stored: the server may have committed them just before
        or after the client gave up on its reply (a lost STORE_COMMIT or inline store).
        Calling ``store`` again is safe: keys already stored are skipped, never written
        twice.  A key whose reservation the lost commit left open counts as being stored
        until the server's write TTL drops it, so a retry within that time skips it too;
        ``lookup`` tells which keys are there.
        """
        keys = checked_keys(keys)
        if l1_only:
            self._follow_server()  # asked of the server the store goes to, restarted or not
        self._check_l1_only(l1_only)
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        if layouts is None:
            layouts = [layout_of(buffer) for buffer in buffers]
        else:
            layouts = _checked_layouts(layouts, len(keys))
        arrays = [as_byte_array(buffer) for buffer in buffers]
        sizes = [array.nbytes for array in arrays]
        if 0 in sizes:
            raise ValueError("cannot store an empty buffer")
        # A store's chunks are mostly of one layout and size: each pair is checked once
        # (in the order given, so the first one at fault is the one named).
        for layout, size in dict.fromkeys(zip(layouts, sizes, strict=True)):
            check_layout(layout, size)
        chosen = list(layouts)
        progress = _StoreProgress()
        return self._on_current_server(lambda: self._store_now(keys, arrays, chosen, l1_only, progress))

    def _check_l1_only(self, l1_only: bool) -> None:
        """Raise ClientError for an ``l1_only`` store the server greeted last cannot keep
        out of L2: an earlier release ignores the flag (its decoder drops the field)."""
        if l1_only and "l1_only_store" not in self.server_features:
            raise ClientError(f"the server at {self.url} cannot keep stores out of L2 (it is older)")

    def _store_now(
        self,
        keys: Sequence[ObjectKey],
        arrays: list[np.ndarray[Any, Any]],
        layouts: list[str],
        l1_only: bool,
        progress: _StoreProgress,
    ) -> int:
        # Asked again of the server followed here (``store`` asked the one greeted before):
        # one restarted at the address may be an earlier release.
        self._check_l1_only(l1_only)
        stored = 0
        with self._mapped() as segment:
            if segment is not None:
                if progress.segment is not segment:
                    # A first attempt, or one after a restart: nothing committed before is here.
                    progress.segment, progress.keys_done, progress.stored = segment, 0, 0
                # Again on the same server (after a drop, not a restart), the batches
                # committed before hold their keys: reserved again, they would be skipped
                # as present and left out of the count, so the store goes on from the
                # batch that failed.
                while progress.keys_done < len(keys):
                    part = slice(progress.keys_done, min(len(keys), progress.keys_done + self.max_keys))
                    progress.stored += self._store_shm(
                        list(keys[part]), arrays[part], _sent_layouts(layouts[part]), segment, l1_only
                    )
                    progress.keys_done = part.stop
                return progress.stored
        for batch_keys, batch_arrays, batch_layouts in self._inline_batches(list(keys), arrays, layouts):
            request = p.StoreInline(0, "", batch_keys, _sent_layouts(batch_layouts), l1_only)
            reply = self._call(request, p.StoreReply, payloads=batch_arrays)
            stored += _stored_count("STORE_INLINE", reply, batch_keys)
        return stored

    def _inline_batches(
        self, keys: list[ObjectKey], arrays: list[np.ndarray[Any, Any]], layouts: list[str]
    ) -> Iterator[tuple[list[ObjectKey], list[np.ndarray[Any, Any]], list[str]]]:
        limit = max(1, self.server.max_inline_bytes)
        largest = max((array.nbytes for array in arrays), default=0)  # no keys: no batch
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
        l1_only: bool,
    ) -> int:
        sizes = [array.nbytes for array in arrays]
        reply = self._call(p.StoreReserve(0, "", keys, sizes, layouts), p.StoreReserveReply)
        answered_over = self._answered_over()
        if len(reply.slots) != len(keys):
            raise ProtocolError(f"STORE_RESERVE answered {len(reply.slots)} slots for {len(keys)} keys")
        reserved = [key for key, slot in zip(keys, reply.slots, strict=True) if slot.offset != p.NO_SLOT]
        if not reserved:
            return 0
        # whether the reservations are known to be the mapped segment's server's
        verified = False
        try:
            if self._answered_elsewhere(segment):
                raise _ServerChanged(self.url)  # the slots may be another segment's
            verified = True
            slots: list[p.Slot] = []
            sources: list[np.ndarray[Any, Any]] = []
            for array, slot in zip(arrays, reply.slots, strict=True):
                if slot.offset == p.NO_SLOT:
                    continue
                if slot.size != array.nbytes:
                    raise ProtocolError(f"reserved {slot.size} bytes for a {array.nbytes}-byte buffer")
                slots.append(slot)
                sources.append(array)
            _check_slots(segment, slots)
            # A reservation that already changed hands (this process stalled past the write
            # TTL and its grace period) is not written into: that extent is someone else's
            # now.  Its commit is refused by the server, which expired it.
            lost = set(segment.changed(slots))
            segment.write_many(
                [
                    (slot.offset, source)
                    for index, (slot, source) in enumerate(zip(slots, sources, strict=True))
                    if index not in lost
                ]
            )
        except BaseException:
            # Under the lock from the look at the server to the send: no other thread
            # greets a restarted server, and reserves the same keys there, in between.
            with contextlib.suppress(ClientError), self._lock:
                self._greet_again_if_dropped()
                # Reservations whose server is not known (their reply may have come from a
                # restarted one) are aborted on the server greeted now, which may hold them
                # -- unless their reply came over a connection that has dropped since, and
                # the server greeted now is another one: they went with the old server,
                # and an abort by key would free the extents of this client's reservations
                # of the same keys there (another thread's) under their copy.
                if self._reserved_here(segment) or (not verified and not self._link_lost(answered_over)):
                    self._call(p.StoreAbort(0, "", reserved), p.StoreReply, timeout=self._cleanup_seconds())
            raise
        with self._lock:
            self._greet_again_if_dropped()
            if not self._reserved_here(segment):
                raise _ServerChanged(self.url)  # the bytes went into the old server's segment
            committed = self._call(p.StoreCommit(0, "", reserved, l1_only), p.StoreReply)
        return _stored_count("STORE_COMMIT", committed, reserved)

    def _greet_again_if_dropped(self) -> None:
        """Before a commit or abort: a connection that dropped since the reservation came
        back under a new identity, which the server ties to the reservations made under
        the old one only once a HELLO tells it this process's pid (else they stay fenced
        while this process lives)."""
        self._follow_server()

    def _reserved_here(self, segment: MappedSegment) -> bool:
        """After ``_greet_again_if_dropped``, before a commit or abort of reservations in
        ``segment``: whether the server greeted last is the one that made them.  A server
        that restarted meanwhile (this call's greeting, or another thread's, mapped its
        segment instead) holds none of them, and may hold this client's reservations of
        the same keys made since, whose bytes are not copied yet: a commit by key would
        hand those out unwritten, an abort would free their extents under their copies.
        (A client closed meanwhile sends neither: the call says so.)"""
        with self._lock:
            return self._segment is segment or self._closed

    def lookup(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> int:
        """How many leading keys the server holds in L1 or L2, waiting (up to ``timeout``,
        default the client's) for their prefetch from L2 into L1.  The hit prefix stays
        read-locked for this client until ``retrieve`` finishes with it or ``release``.

        More keys than the server takes in one request are looked up part by part, each
        part only while the one before it was a full hit (the answer is a prefix).
        """
        listed = checked_keys(keys)
        limit = self.timeout if timeout is None else checked_timeout(timeout)  # _call_seconds, inline
        deadline = time.monotonic() + limit
        # Within the call's bound: a greeting bounded by the client's timeout would hold a
        # call with a shorter one past it while the server is not back yet.
        self._follow_server_for_limits(limit)
        greeted = self.server
        try:
            if 0 < len(listed) <= self.max_keys:  # one request, the usual case: no hop through _lookup
                # The whole limit is left (a microsecond less at most): the wait sent is the
                # same on every call, so the request's header is kept encoded but for its id.
                return self._lookup_part(listed, time.monotonic() + limit, limit, limit)
            return self._lookup(listed, limit)
        except ServerError as exc:
            if not self._refused_for_old_limits(exc, greeted, deadline - time.monotonic()):
                raise
        return self._lookup(listed, max(0.0, deadline - time.monotonic()))

    def _lookup(self, keys: list[ObjectKey], limit: float) -> int:
        """``lookup`` within ``limit`` seconds (zero: no wait for a prefetch)."""
        deadline = time.monotonic() + limit
        if 0 < len(keys) <= self.max_keys:  # one request, the usual case
            return self._lookup_part(keys, deadline, limit, limit)
        hits = 0
        asked = 0
        try:
            for part in self._batches(len(keys)):
                asked = part.stop
                found = self._lookup_part(keys[part], deadline, limit, max(0.0, deadline - time.monotonic()))
                hits += found
                if found < part.stop - part.start:
                    break
        except BaseException as exc:
            # The parts before hold locks the caller cannot know about: give them back.  A
            # part the server refused took none (one refused by a restarted server would
            # otherwise be released there by key).
            if hits:
                self._give_back(keys[: hits if isinstance(exc, ServerError) else asked], exc)
            raise
        return hits

    def _lookup_part(self, keys: list[ObjectKey], deadline: float, limit: float, remaining: float) -> int:
        """One LOOKUP request of ``lookup`` (``remaining``: the time left before ``deadline``)."""
        if self._lookup_waits:
            # One round trip when the prefix is in L2: the server waits for the prefetch
            # before answering (and answers at its deadline at the latest).
            wait = min(remaining, p.MAX_WAIT_S)
            request = p.Lookup(0, "", keys, wait)
            reply = self._call(request, p.LookupReply, (), wait + max(1.0, self.timeout))
        else:
            reply = self._call(p.Lookup(0, "", keys), p.LookupReply, timeout=remaining)
        hits = reply.hits
        if hits is not None:
            if not 0 <= hits <= len(keys):
                return self._checked_hits(hits, keys)
            if hits:
                self._note_locked(keys[:hits] if hits < len(keys) else keys)
            return hits
        self._running_prefetch(reply.handle, keys)
        hits = self.wait_prefetch(reply.handle, max(0.0, deadline - time.monotonic()))
        if hits is None:
            # Given up on: the server gives its locks back when no one collects it.
            self._prefetch_settled(reply.handle)
            raise RequestTimeoutError(f"prefetch of {len(keys)} keys did not finish within {limit:g}s")
        return hits

    def lookup_many(
        self, key_lists: Sequence[Sequence[ObjectKey]], timeout: float | None = None, window: int = 64
    ) -> list[int]:
        """``lookup`` for several prompts at once (e.g. one scheduler step), with up to
        ``window`` requests in flight: one round trip's latency instead of one per prompt."""
        limit = self._call_seconds(timeout)
        # All checked before the first is sent: those sent would lock keys meanwhile.
        listed = [checked_keys(keys, f"prompt {index}: ") for index, keys in enumerate(key_lists)]
        deadline = time.monotonic() + limit
        # Within the call's bound too: the client's whole timeout (infinite, maybe) spent
        # waiting for a server not back yet would stall the caller's step past its own.
        self._follow_server_for_limits(limit)
        greeted = self.server
        try:
            return self._lookup_many_or_give_back(listed, deadline, limit, window)
        except ServerError as exc:
            # Sent by the key limit of a server restarted since (see lookup): once more,
            # by the new one, within what is left of the call's time.
            if not self._refused_for_old_limits(exc, greeted, deadline - time.monotonic()):
                raise
        return self._lookup_many_or_give_back(listed, deadline, limit, window)

    def _lookup_many_or_give_back(
        self, key_lists: list[list[ObjectKey]], deadline: float, limit: float, window: int
    ) -> list[int]:
        results: list[int | None] = [None] * len(key_lists)
        try:
            return self._lookup_many(key_lists, results, deadline, limit, window)
        except BaseException as exc:
            # Prompts answered before the failure hold locks (on their hit prefixes) the
            # caller cannot know about.
            held = list(
                dict.fromkeys(
                    key for position, hits in enumerate(results) if hits for key in key_lists[position][:hits]
                )
            )
            if held:
                self._give_back(held, exc)
            raise

    def _lookup_many(
        self,
        key_lists: Sequence[Sequence[ObjectKey]],
        results: list[int | None],
        deadline: float,
        limit: float,
        window: int,
    ) -> list[int]:
        waiting: list[tuple[int, int]] = []  # (position, prefetch handle)
        with self._lock:
            for begin in range(0, len(key_lists), max(1, window)):
                batch = range(begin, min(len(key_lists), begin + max(1, window)))
                # Prompts longer than one request start with their first part here and
                # continue below, once that part is known to be a full hit.
                requests = [p.Lookup(0, "", list(key_lists[i])[: self.max_keys]) for i in batch]
                try:
                    # Inside: when a send fails, those sent before it lock keys all the same.
                    for request in requests:
                        self._start(request, (), deadline)
                    for position, request in zip(batch, requests, strict=True):
                        reply, _ = self._await(request, p.LookupReply, deadline)
                        if reply.hits is None:
                            self._running_prefetch(reply.handle, request.keys)
                            waiting.append((position, reply.handle))
                        else:
                            found = self._checked_hits(reply.hits, request.keys)
                            if found:
                                self._note_locked(request.keys[:found])
                            results[position] = found
                except BaseException:
                    # Lookups still in flight lock keys for us: release them when they land.
                    for request in requests:
                        self._give_up(request)
                    raise
            for position, handle in waiting:
                hits = self.wait_prefetch(handle, max(0.0, deadline - time.monotonic()))
                if hits is None:
                    # Given up on, with those not waited for yet: the server gives their
                    # locks back when no one collects them.
                    for _, running in waiting:
                        self._prefetch_settled(running)
                    raise RequestTimeoutError(f"prefetch did not finish within {limit:g}s")
                results[position] = hits
            for position, keys in enumerate(key_lists):
                first = results[position] or 0
                if len(keys) > self.max_keys and first == self.max_keys:
                    rest = list(keys)[self.max_keys :]
                    left = max(0.0, deadline - time.monotonic())
                    results[position] = first + self._lookup(rest, left)
        return [hits or 0 for hits in results]

    def start_lookup(self, keys: Sequence[ObjectKey]) -> tuple[int, int | None]:
        """Start a lookup without waiting: (handle, hits or None while the prefetch runs).

        One handle covers one request, so at most ``max_keys`` keys (``lookup`` takes any
        number)."""
        keys = checked_keys(keys)
        deadline = time.monotonic() + self.timeout
        self._follow_server_for_limits()
        greeted = self.server
        try:
            return self._start_lookup(keys, self.timeout)
        except ServerError as exc:
            # Sent by the key limit of a server restarted since (see lookup): once more,
            # by the new one, within what is left of the call's time.
            if not self._refused_for_old_limits(exc, greeted, deadline - time.monotonic()):
                raise
        return self._start_lookup(keys, max(0.0, deadline - time.monotonic()))

    def _start_lookup(self, keys: list[ObjectKey], timeout: float) -> tuple[int, int | None]:
        if len(keys) > self.max_keys:
            raise ValueError(
                f"start_lookup takes at most {self.max_keys} keys (the server's limit per request), "
                f"got {len(keys)}: use lookup(), which looks longer prompts up part by part"
            )
        request = p.Lookup(0, "", keys)
        reply = self._call(request, p.LookupReply, timeout=timeout)
        if reply.hits is None:
            self._running_prefetch(reply.handle, request.keys)
            return reply.handle, None
        hits = self._checked_hits(reply.hits, request.keys)
        if hits:
            self._note_locked(request.keys[:hits])
        return reply.handle, hits

    def query_prefetch(self, handle: int) -> int | None:
        """Non-blocking: the hit count of a started lookup, or None while it runs."""
        return self._prefetch_status(p.QueryPrefetchStatus(0, "", checked_handle(handle)), handle, None)

    def wait_prefetch(self, handle: int, timeout: float) -> int | None:
        """Wait up to ``timeout`` seconds for a started lookup; None if still running."""
        wait = min(checked_wait(timeout), p.MAX_WAIT_S)
        request = p.WaitPrefetchStatus(0, "", checked_handle(handle), wait)
        # The server answers at its deadline; allow for the round trip on top.  A reply that
        # comes later still hands over the prefetch's locks: they are released then.
        return self._prefetch_status(request, handle, timeout + max(1.0, self.timeout))

    def _prefetch_status(self, request: p._Request, handle: int, timeout: float | None) -> int | None:
        """A QUERY or WAIT of ``handle``; its keys are forgotten once its result is
        collected, or when an error reply says the server holds no such prefetch (any more)."""
        keys = self._prefetch_keys.get(handle)  # forgotten once collected, checked against after
        try:
            hits = self._call(request, p.PrefetchStatusReply, timeout=timeout).hits
        except ServerError:
            self._prefetch_settled(handle)
            raise
        if hits is None:
            return None
        self._prefetch_settled(handle)
        hits = self._checked_hits(hits, keys)
        if hits and keys:
            self._note_locked(keys[:hits])
        return hits

    def _checked_hits(self, hits: int, keys: list[ObjectKey] | None) -> int:
        """``hits``, a LOOKUP's answer for ``keys`` (or its prefetch's; None: keys not
        remembered), if it can be a prefix of them.  Another count is not handed to the
        caller, who would retrieve that many objects or take keys past the prefix as cached:
        it is a ProtocolError, once the locks the server may have taken on the keys are
        given back."""
        if 0 <= hits <= (len(keys) if keys is not None else hits):
            return hits
        asked = f"{len(keys)} keys" if keys is not None else "its keys"
        failure = ProtocolError(f"{self.url} answered a lookup with {hits} hits for {asked}")
        if keys:
            self._give_back(keys, failure)
        raise failure

    @contextlib.contextmanager
    def retrieve(
        self, keys: Sequence[ObjectKey], layouts: Sequence[str] | None = None
    ) -> Iterator[list[memoryview]]:
        """Read-only views of the hit prefix of ``keys`` (possibly fewer than asked).

        ``layouts``: what the caller will read each object as (``"float16[2,32,256,128]"``,
        "" for plain bytes); the prefix then ends at an object of another layout, as in
        :meth:`retrieve_into`.  A server without feature ``retrieve_layouts`` (an older
        release) cannot check them: it hands out the views as before, and the client logs
        that once per server greeted.

        Shared-memory views point into the server's memory and are valid only inside the
        ``with`` block; on exit they are released together with every lock this client
        holds on ``keys`` (including its LOOKUP's), except the locks on keys another open
        block of this client reads (nested, or on another thread): the last block of a key
        releases it.  If the lease of some objects ended early (a forced clear, or held
        past the lock TTL) and their extents changed hands while the block ran, leaving it
        raises :class:`StaleReadError` naming them: whatever was read from those views is
        void.
        """
        keys = checked_keys(keys)
        reader = [] if layouts is None else _checked_layouts(layouts, len(keys))
        with contextlib.ExitStack() as held:  # the segment stays mapped until the views go
            segment, slots, taken_over = self._on_current_server(
                lambda: self._acquire_mapped(keys, held, reader)
            )
            if segment is None:
                # Decided after _on_current_server greeted the server it reads from.
                yield self._retrieve_inline(keys, self._reader_layouts(reader))
                return
            with self._leased(keys, taken_over):
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

    def _acquire_mapped(
        self, keys: list[ObjectKey], held: contextlib.ExitStack, layouts: list[str]
    ) -> tuple[MappedSegment | None, list[p.Slot], int]:
        """``_acquire`` in the mapped segment, for a reader of ``layouts`` (one per key, or
        none): (segment, slots, the drops seen before the locks were taken: see
        ``_leased``), or (None, [], 0) when bytes travel inline.  On success ``held`` keeps
        the segment mapped (see ``_mapped``)."""
        with contextlib.ExitStack() as attempt:
            segment = attempt.enter_context(self._mapped())
            if segment is None:
                return None, [], 0
            taken_over = self._drops
            # Decided per attempt: the server greeted last (a restarted, maybe upgraded,
            # one) is the one that must check them.
            slots = self._acquire(keys, segment, taken_over, self._reader_layouts(layouts))
            held.enter_context(attempt.pop_all())
            return segment, slots, taken_over

    def _acquire(
        self, keys: list[ObjectKey], segment: MappedSegment, taken_over: int, layouts: list[str] | None = None
    ) -> list[p.Slot]:
        """Read-lock the hit prefix of ``keys`` (RETRIEVE, part by part) and return its
        slots in ``segment``; ``taken_over``: the drops seen before (see ``_leased``);
        ``layouts``: what the caller reads each object as (see ``_reader_layouts``).  On
        failure every lock this client holds on ``keys`` is given back (its LOOKUP's too),
        judged by this connection's drops, not by those of a block that left meanwhile."""
        slots: list[p.Slot] = []
        with self._lock:
            self._reading.update(keys)
            # Noted before the RETRIEVEs, by the connection ``_leased`` goes by: one that
            # fails after it took its locks gives them back over it (see ``release``).
            self._lock_epochs.note(keys, taken_over, self._drops)
        try:
            for part in self._batches(len(keys)):
                batch = keys[part]
                request = p.Retrieve(0, "", batch, layouts=layouts[part] if layouts else [])
                reply = self._call(request, p.RetrieveReply)
                if self._answered_elsewhere(segment):
                    raise _ServerChanged(self.url)  # the slots may be another segment's
                if len(reply.slots) > len(batch):
                    raise ProtocolError(f"RETRIEVE answered {len(reply.slots)} slots for {len(batch)} keys")
                _check_slots(segment, reply.slots)
                slots.extend(reply.slots)
                if len(reply.slots) < len(batch):
                    break
        except BaseException as exc:
            self._stop_reading(keys, exc, taken_over)
            raise
        return slots

    @contextlib.contextmanager
    def _leased(self, keys: list[ObjectKey], taken_over: int) -> Iterator[None]:
        """On exit release every lock this client holds on ``keys`` -- the LOOKUP's too,
        also when RETRIEVE found none of them (a forced clear in between) -- so that the
        extents a forced clear holds back are not held until the lock TTL.

        ``taken_over``: the connection drops seen before the RETRIEVE went out.  The
        block's exceptions are the caller's, perhaps another client's (a ConnectionLostError
        of another server's): whether the locks went with a dropped connection is told by
        the drops seen since, not by the exception.  No drop seen between that count and
        the reply's check goes unnoticed (``_acquire`` raises ``_ServerChanged``)."""
        with self._lock:
            newest = self._newest_lease
            for key in keys:
                if newest.get(key, -1) < taken_over:
                    newest[key] = taken_over
        try:
            yield
        except BaseException as exc:
            self._stop_reading(keys, exc, taken_over)
            raise
        self._stop_reading(keys, None, taken_over)

    def _stop_reading(
        self, keys: list[ObjectKey], failure: BaseException | None, taken_over: int | None = None
    ) -> None:
        """A block reading ``keys`` (counted by ``_acquire``) ends, its RETRIEVE failed or
        the block left (after ``failure``, or normally): the locks on the keys that no
        other open block of this client reads are given back.  A RELEASE drops every lock
        the client holds on a key, so blocks of the same keys that overlap -- on threads
        sharing the client, or nested -- would end each other's leases, and their extents
        could change hands under the views still read: the last block out releases them.
        Under the lock throughout, so that no block starts or ends in between.

        The last block out may have taken its locks over a connection that dropped since,
        while a block that left before it took the same keys' locks over the next one:
        those are released over that connection rather than left to the lock TTL, so
        the locks go by the newest connection any block of the key took them over."""
        with self._lock:
            self._reading.subtract(keys)
            free = [key for key in dict.fromkeys(keys) if self._reading[key] <= 0]
            by_connection: dict[int | None, list[ObjectKey]] = {}
            for key in free:
                del self._reading[key]
                # A block's own is noted as it starts (_leased); a RETRIEVE failing before
                # that has only its own, perhaps newer than a block's that left meanwhile.
                noted = self._newest_lease.pop(key, None)
                newest = noted if taken_over is None else max(taken_over, -1 if noted is None else noted)
                by_connection.setdefault(newest, []).append(key)
            for taken_over_last, group in by_connection.items():
                self._leave(group, failure, taken_over_last)

    def _leave(self, keys: list[ObjectKey], failure: BaseException | None, taken_over: int | None) -> None:
        """``_stop_reading``'s give-back of ``keys``, whose newest locks were taken after
        ``taken_over`` drops (None: not known, see ``_give_back``)."""
        if failure is not None:
            self._give_back(keys, failure, taken_over)
        elif keys and not self._closed:
            if taken_over is not None and self._link_dropped_since(taken_over):
                self._locks_left_to_ttl(len(keys))
            else:
                self._release_on_leaving(keys)

    def _link_dropped_since(self, taken_over: int) -> bool:
        """Whether the connection that took locks after ``taken_over`` drops has dropped."""
        with self._lock:
            return not self._closed and self._link_lost(taken_over)

    def _release_on_leaving(self, keys: list[ObjectKey]) -> None:
        """RELEASE at the end of a ``retrieve`` block.  A client closed meanwhile (by
        another thread) cannot send it: leaving the block does not fail for that, since
        the server's lock TTL takes the locks back."""
        try:
            self.release(keys)
        except ClientError:
            if not self._closed:
                raise
            logger.info(
                "client for %s closed while a retrieve block was open: the read locks on its %d "
                "keys expire on the server",
                self.url,
                len(keys),
            )

    def _give_back(
        self, keys: Sequence[ObjectKey], failure: BaseException, taken_over: int | None = None
    ) -> None:
        """After ``failure``: drop this client's locks on ``keys`` without hiding the
        failure, and without waiting another timeout for a server that did not answer.
        ``taken_over`` (see ``_leased``): for a failure that may not be this client's, the
        drops seen before the locks were taken."""
        with self._lock:  # not the keys an open retrieve block reads: it releases them
            keys = [key for key in keys if not self._reading[key]]
        if self._closed or not keys:
            return
        lost = (
            isinstance(failure, ConnectionLostError)
            if taken_over is None
            else self._link_dropped_since(taken_over)
        )
        if lost:
            self._locks_left_to_ttl(len(keys))
            return
        keys = self._locked_over_this_connection(keys)
        if not keys:
            return
        if isinstance(failure, RequestTimeoutError):
            self._release_without_waiting(keys, list(self._batches(len(keys))))
            return
        with contextlib.suppress(ClientError):
            self.release(keys, timeout=self._cleanup_seconds())

    def _note_locked(self, keys: Sequence[ObjectKey]) -> None:
        """The request whose reply this thread took last read-locked ``keys``."""
        with self._lock:
            self._lock_epochs.note(keys, self._answered_over(), self._drops)

    def _locked_over_this_connection(self, keys: list[ObjectKey]) -> list[ObjectKey]:
        """``keys`` less those whose newest lock this client took over a connection that
        has dropped since (see ``lock_epochs``): a release over this one cannot reach those
        locks, which expire with the server's lock TTL (logged)."""
        with self._lock:
            if not self._lock_epochs:
                return keys
            if not (self._closed or self._inherited or self._events_read_lately()):
                # (Read less than half a reconnect interval ago, the events left no other
                # connection to have come up since.)
                self._read_link_events()
            kept, left_out = self._lock_epochs.release(keys, self._drops)
        if left_out:
            self._locks_left_to_ttl(left_out)
        return kept

    def _locks_left_to_ttl(self, count: int) -> None:
        """After a lost connection: the locks this client took over it live in that
        connection's session on the server (sessions are per connection), which no request
        over the next connection can reach.  A RELEASE by key over it would drop only locks
        taken since, in the new session, perhaps by another thread of this client that
        still reads under them; so none is sent, and the old locks expire on the server."""
        logger.info(
            "the connection to %s was lost: the locks it held on %d keys are not released over "
            "the next connection; they expire with the server's lock TTL",
            self.url,
            count,
        )

    def _retrieve_inline(self, keys: list[ObjectKey], layouts: list[str] | None = None) -> list[memoryview]:
        views: list[memoryview] = []
        position = 0
        try:
            while position < len(keys):
                part = slice(position, position + self.max_keys)
                request = p.Retrieve(0, "", keys[part], inline=True, layouts=layouts[part] if layouts else [])
                batch = keys[part]
                reply, frames = self._exchange(request, p.RetrieveReply)
                if len(frames) != len(reply.slots):
                    raise ProtocolError(f"{len(reply.slots)} slots but {len(frames)} payload frames")
                if len(reply.slots) > len(batch):
                    # Which payload is which key's cannot be told: none is handed out.
                    raise ProtocolError(f"RETRIEVE answered {len(reply.slots)} slots for {len(batch)} keys")
                # Each frame must be its slot's size: a reply the server could not finish
                # sending is closed with empty frames, never taken for an object.
                for slot, frame in zip(reply.slots, frames, strict=True):
                    if len(frame) != slot.size:
                        raise ProtocolError(f"a {len(frame)}-byte payload frame for a {slot.size}-byte slot")
                views.extend(frame.buffer.toreadonly() for frame in frames)
                position += len(frames)
                if len(frames) < len(batch) and not reply.truncated:
                    break
                if not frames:
                    break
        except BaseException as exc:
            self._give_back(keys[position:], exc)
            raise
        if position < len(keys):
            # The server dropped the locks on the keys it returned; the rest may still be
            # locked by this client's LOOKUP (a forced clear in between, say).
            self.release(keys[position:])
        return views

    def retrieve_into(self, keys: Sequence[ObjectKey], buffers: Sequence[BufferLike]) -> int:
        """Copy the hit prefix of ``keys`` into ``buffers`` (one copy per object); returns the
        number of keys copied.  Each buffer must be at least as large as its object.

        A torch tensor or numpy array (of any dtype but ``uint8``, which stands for plain
        bytes) is read only from an object of its own layout: the hit prefix ends at an
        object stored with another one, or stored without one and of another size (the
        server counts ``retrieve_layout_mismatch``).  Keys name no dtype: without this,
        an engine of another dtype or KV layout would read another's chunk of the same
        tokens as other numbers.  A server of an earlier release (no ``retrieve_layouts``)
        cannot check layouts: the bytes are copied as before, logged once per server.

        Each copy is checked against the generation the server handed out with its slot;
        objects whose extent changed hands meanwhile are retrieved again (up to
        ``STALE_RETRIES`` times), then :class:`StaleReadError` is raised.
        """
        keys = checked_keys(keys)
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        targets = [as_writable_byte_array(buffer) for buffer in buffers]
        return self._on_current_server(lambda: self._retrieve_into_now(keys, targets, buffers))

    def _buffer_layouts(self, buffers: Sequence[BufferLike]) -> list[str] | None:
        """``_reader_layouts`` of ``retrieve_into``'s buffers, building a buffer's layout
        only where it can matter: a server without ``retrieve_layouts`` is sent none, and a
        uint8 or bytes-like buffer names none.  Decided per attempt, as in ``_acquire_mapped``."""
        if "retrieve_layouts" not in self.server_features:
            self._tell_layouts_unchecked(lambda: any(map(_names_a_dtype, buffers)))
            return None
        named = [reader_layout_of(buffer) for buffer in buffers]
        return named if any(named) else None

    def _reader_layouts(self, layouts: list[str]) -> list[str] | None:
        """What a RETRIEVE tells the server of the caller's buffers: the layout of each
        tensor or array ("" for plain bytes), so that it hands out no chunk of another
        layout -- keys name no dtype, and another engine's chunk of the same tokens under
        the same model name would be read as other numbers.  None when no buffer has a
        layout or the server cannot check them (feature ``retrieve_layouts``)."""
        # A uint8 tensor or array takes any object as plain bytes, as a bytearray does.
        named = ["" if layout.startswith("uint8[") else layout for layout in layouts]
        if not any(named):
            return None
        if "retrieve_layouts" not in self.server_features:
            self._tell_layouts_unchecked(lambda: True)
            return None
        return named

    def _tell_layouts_unchecked(self, named_any: Callable[[], bool]) -> None:
        """Log, once per server greeted, that it cannot check the layouts a reader names
        (an earlier release): its chunks of another dtype are handed out as bytes.
        ``named_any`` is asked only then, so the hot path builds no layout for it."""
        hello = self.server
        if self._layouts_unchecked_by is hello or not named_any():
            return
        self._layouts_unchecked_by = hello
        logger.warning(
            "the server at %s does not check the layouts readers read (no feature "
            "retrieve_layouts: an earlier release): a chunk stored in another dtype or shape "
            "under the same key is copied as bytes",
            self.url,
        )

    def _retrieve_into_now(
        self, keys: list[ObjectKey], targets: list[np.ndarray[Any, Any]], buffers: Sequence[BufferLike]
    ) -> int:
        wanted = self._buffer_layouts(buffers)
        with self._mapped() as segment:
            if segment is not None:
                return self._retrieve_shm_into(keys, targets, segment, wanted)
        views = self._retrieve_inline(keys, wanted)
        for view, target in zip(views, targets, strict=False):
            _copy_into(target, np.frombuffer(view, dtype=np.uint8))
        return len(views)

    def _retrieve_shm_into(
        self,
        keys: list[ObjectKey],
        targets: list[np.ndarray[Any, Any]],
        segment: MappedSegment,
        layouts: list[str] | None = None,
    ) -> int:
        done = 0
        for _ in range(self.STALE_RETRIES + 1):
            rest = keys[done:]
            taken_over = self._drops
            slots = self._acquire(rest, segment, taken_over, layouts[done:] if layouts else None)
            with self._leased(rest, taken_over):
                copies = list(zip(slots, targets[done:], strict=False))
                for slot, target in copies:
                    if target.nbytes < slot.size:
                        raise ValueError(f"buffer of {target.nbytes} bytes is too small for {slot.size}")
                segment.read_many([(slot.offset, slot.size, target) for slot, target in copies])
                stale = segment.changed(slots)
            if not stale:
                return done + len(slots)
            done += stale[0]  # the copies before the first stale one are good
            lost = [rest[index] for index in stale]
        raise StaleReadError(lost)

    def release(self, keys: Sequence[ObjectKey], timeout: float | None = None) -> int:
        """Drop every lock this client holds on ``keys``; returns how many keys had one.

        ``timeout`` bounds this call (all its requests together), default the client's:
        a release on the way out may wait less than the calls before it.  When it runs
        out, the batches not sent yet go out without waiting for their replies and
        RequestTimeoutError is raised, naming how many of the keys (the last ones) may
        keep their locks until the server reads those releases, or its lock TTL.  When the
        connection is lost instead, nothing more is sent: the locks taken over it cannot be
        released over another (see ``_locks_left_to_ttl``) and expire with the lock TTL.
        For the same reason, keys whose newest lock this client took over a connection
        that has dropped since (the server restarted, say) are not sent at all."""
        keys = checked_keys(keys)
        deadline = time.monotonic() + self._call_seconds(timeout)
        keys = self._locked_over_this_connection(keys)
        if not keys:
            return 0
        # By the key limit of the server the release goes to: one restarted at the
        # address may take fewer keys per request.
        self._follow_server_for_limits(max(0.0, deadline - time.monotonic()))
        greeted = self.server
        progress = _ReleaseProgress()
        try:
            self._release_parts(keys, deadline, progress)
            return progress.released
        except ServerError as exc:
            if not self._refused_for_old_limits(exc, greeted, deadline - time.monotonic()):
                raise
        # Refused by a server restarted since: the rest once more, by its limit, less the
        # keys whose locks went with the old one.
        rest = self._locked_over_this_connection(keys[progress.keys_done :])
        released, progress = progress.released, _ReleaseProgress()
        self._release_parts(rest, deadline, progress)
        return released + progress.released

    def _release_parts(self, keys: list[ObjectKey], deadline: float, progress: _ReleaseProgress) -> None:
        """``release``'s requests, part by part, by the key limit greeted last."""
        parts = list(self._batches(len(keys)))
        for index, part in enumerate(parts):
            left = max(0.0, deadline - time.monotonic())
            try:
                with self._lock:
                    self._released_every_lock(keys[part])
                    progress.released += self._call(
                        p.Release(0, "", keys[part]), p.ReleaseReply, timeout=left
                    ).released
                progress.keys_done = part.stop
            except ConnectionLostError as exc:
                # The rest of the keys' locks are in the lost connection's session too.
                left = len(keys[part.start :])
                self._locks_left_to_ttl(left)
                raise ConnectionLostError(
                    f"{exc}: the last {left} of these {len(keys)} keys keep the locks taken over "
                    "that connection until the server's lock TTL"
                ) from exc
            except RequestTimeoutError as exc:
                unsent = self._release_without_waiting(keys, parts[index + 1 :])
                raise _unconfirmed_release(exc, len(keys[part.start :]), len(keys), unsent) from exc

    def _release_without_waiting(self, keys: list[ObjectKey], parts: Sequence[slice]) -> int:
        """RELEASE ``keys[part]`` for each part, not waiting for the replies: after a
        timeout, the server did not answer and must not be waited for again.  Returns how
        many keys' releases could not be sent at all (logged: their locks expire with the
        server's lock TTL)."""
        unsent = sum(
            len(keys[part]) for part in parts if not self._send_and_forget(p.Release(0, "", keys[part]))
        )
        if unsent:
            logger.warning(
                "client for %s could not send the release of %d keys (the server is unreachable "
                "or not reading): their locks expire with the server's lock TTL",
                self.url,
                unsent,
            )
        return unsent


def _unconfirmed_release(
    failure: RequestTimeoutError, unconfirmed: int, total: int, unsent: int
) -> RequestTimeoutError:
    """``failure`` (of the same kind) saying which keys of a ``release`` may still be locked:
    the batch that got no reply and those after it, sent without waiting."""
    message = (
        f"{failure}: the last {unconfirmed} of these {total} keys may keep their locks until the "
        "server reads their releases, or until its lock TTL"
    )
    if unsent:
        message += f" ({unsent} of those releases could not be sent: lock TTL)"
    return type(failure)(message)
