"""prepare/commit_store and prepare/commit_retrieve: moving chunks through L1.

Shared memory (the default): ``prepare_store`` reserves L1 extents for the chunks not
there yet, with the instance's tensor layout, and answers their absolute offsets in the
segment; the client gathers straight into them and ``commit_store`` makes them visible
(and queues them for L2).  ``prepare_retrieve`` read-locks every chunk of the range and
answers their offsets; the client scatters from them and ``commit_retrieve`` releases the
locks, and one of the request's lookup locks on each key.

Pickled (``allow_pickle``): ``commit_store`` carries the chunks as pickled tensors and
``prepare_retrieve`` answers them so; see :mod:`lmcache_plugin_lmcache_mp.pickled`.

A chunk already in L1 (stored by anyone, or being stored) is not stored again: a second
``prepare_store`` of chunks another request is still writing gets no slots for them, and
the first writer's reservation is left alone.  Only the same request preparing the same
range again on the same connection (a client that timed out on its first prepare) replaces
its own reservation; a commit finishes only what its own connection prepared, since two
client processes may send the same instance and request ids.
A retrieve answers only when every chunk of its range is in L1 with this instance's
layout, and a miss otherwise (the engine recomputes).  A store L1 cannot make room for is
refused (counted): ``prepare_store`` answers no slots, so the client skips its gather and
commit, and a pickled ``commit_store`` answers false; the client never waits for it.

A shared-memory store's client copies into its slots itself, at any time after the
prepare's answer.  One stalled before its copy for longer than the write TTL (and the
lease grace) would copy into whatever object the reaped extent holds by then.  So the
reservations are fenced (``L1Manager.fence_writers``): an expired one's extent is not
reused until the client's ``commit_store`` of that range on that connection -- which
LMCache's client sends once its gather into the slots has finished -- or its unregister
of the instance on that connection says the copy is over (``writers_done``), or the
client's process has exited (``peers.py``: the protocol carries no pid, so the kernel is
asked who is at the other end of the connection the prepare came in on; a sweep lifts
the fences of stores whose writer exited).  A client whose process cannot be told (a
remote one, one in a pid namespace not visible here) and that never commits keeps its
extents fenced until the server stops, as does a live one whose connection was
re-established under a new identity.  That is bounded: while this front end's fenced
reservations hold ``1/FENCED_SHARE_OF_L1`` of L1 or more, ``prepare_store`` is refused
(no slots), and so is a prepare of a range whose expired reservation its connection has
not committed yet (its commit would not say which copy ended).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from lmcache_plugin_lmcache_mp.base import (
    Deferred,
    Prepared,
    RequestRefused,
    RequestTooLarge,
    Shared,
    failure_reason,
)
from lmcache_plugin_lmcache_mp.chunks import keys_for_rank
from lmcache_plugin_lmcache_mp.lookups import Lookups
from lmcache_plugin_lmcache_mp.peers import ConnectionProcesses
from lmcache_plugin_lmcache_mp.state import (
    MAX_MAPPING_CONNECTIONS,
    Instance,
    LookupJob,
    PendingTransfers,
    Transfer,
)
from lmcache_plugin_lmcache_mp.unread import UnreadReplies
from lmcache_plugin_lmcache_mp.wire import (
    CacheKey,
    EncodedReply,
    PrepareRetrieveReply,
    PrepareStoreReply,
    encode_reply,
)
from lmcache_tiers.plugin import BurstLog, KeyValidationError, L1OutOfMemoryError, ObjectKey, printable

logger = logging.getLogger(__name__)

#: how long before its deadline the sweep gives back a retrieve's read locks (see sweep)
READ_RELEASE_MARGIN_S = 5.0

#: fenced reservations (expired, not committed) past 1/this of L1 refuse new stores: what
#: clients that never come back keep out of L1 (the native front end's bound per client)
FENCED_SHARE_OF_L1 = 8

_MISS = PrepareRetrieveReply(success=False, data=b"", context={})
_ALL_PRESENT: dict[str, Any] = {"slots": [], "chunk_indices": []}


class Transfers:
    def __init__(self, shared: Shared, lookups: Lookups) -> None:
        self.shared = shared
        self.lookups = lookups
        self.storage = shared.storage
        self.writes = PendingTransfers(fence=True)
        #: fenced bytes (``PendingTransfers.fenced_bytes``) past which stores are refused
        self.fenced_bytes_bound = max(1, int(self.storage.l1.capacity_bytes) // FENCED_SHARE_OF_L1)
        self._fence_refusals = BurstLog(logger, "mp_store_refused_fenced")
        #: the process of each connection, whose exit lifts the fences of its stores
        self.peers = ConnectionProcesses(arena=self._arena())
        #: the descriptor the request being handled came in on (``zmq.SRCFD``; -1: not
        #: known), set by the loop around a prepare_store (loop thread only)
        self.source_fd = -1
        self.reads = PendingTransfers()
        self._refusals = BurstLog(logger, "mp_store_refused_l1_full")
        self._mismatches = BurstLog(logger, "mp_retrieve_layout_mismatch")
        self._orphan_commits = BurstLog(logger, "mp_commit_without_reservation")
        self._pickle_refusals = BurstLog(logger, "mp_pickle_refused")
        self._pickle_rejections = BurstLog(logger, "mp_pickle_rejected")
        self._lost_commits = BurstLog(logger, "mp_commit_lost", level=logging.ERROR)
        self._expiries = BurstLog(logger, "mp_transfer_expired")
        self._undelivered = BurstLog(logger, "reply_dropped")
        #: each connection's pickled replies not taken off the server yet (``unread.py``)
        self.unread = UnreadReplies(shared.config.max_message_mb << 20)
        self._unread_refusals = BurstLog(logger, "mp_replies_unread")
        self._uncommitted_refusals = BurstLog(logger, "mp_retrieves_uncommitted")
        self._unmapped = BurstLog(logger, "mp_transfer_unregistered_connection")
        # its own window: a line of one cause must not hide the other's
        self._forgotten = BurstLog(logger, "mp_transfer_unregistered_connection")
        self._abandoned_stores = BurstLog(logger, "mp_shutting_down")
        #: pickled stores handed to the pool whose keys are not counted yet (loop thread only)
        self._pickled_stores: set[_PickledStore] = set()
        #: pickled retrieves handed to the pool and not answered yet (loop thread only)
        self._pickled_retrieves: set[_PickledRetrieve] = set()
        self._abandoned_retrieves = BurstLog(logger, "mp_shutting_down")

    def _resolve(self, key: CacheKey, instance_id: int) -> tuple[Instance, list[ObjectKey]]:
        instance = self.shared.instance(instance_id)
        return instance, self._range_keys(key)

    def _range_keys(self, key: CacheKey) -> list[ObjectKey]:
        """The objects of a transfer's range, for its worker; refused when the range is not
        one LMCache's server takes."""
        chunk_size = self.shared.chunk_size
        if key.start % chunk_size:
            # The client maps the i-th chunk to the one at start + i * chunk_size of its
            # blocks: rounded to a boundary, the range would move another range's bytes.
            raise RequestRefused(
                "mp_bad_request",
                f"a transfer's start ({key.start}) must be a multiple of the chunk size ({chunk_size}); "
                "LMCache's server refuses it too",
            )
        if key.end % chunk_size or key.end > len(key.token_ids):
            # LMCache's client scatters the slots it gets into the blocks of [start, end)
            # and takes the whole range as loaded: answered with the full chunks within
            # the tokens only, the engine would compute on the rest as if it held that KV.
            raise RequestRefused(
                "mp_bad_request",
                f"a transfer's end ({key.end}) must be a multiple of the chunk size ({chunk_size}) "
                f"within its {len(key.token_ids)} tokens; LMCache's server refuses it too",
            )
        return keys_for_rank(key, self.shared.chunks_of(key, ranks=1))

    # -- store ---------------------------------------------------------------------------

    def prepare_store(self, key: CacheKey, instance_id: int, *, peer: bytes = b"") -> Any:
        try:
            instance, keys = self._resolve(key, instance_id)
        except RequestTooLarge as exc:
            if self.shared.shm is None:
                # Pickled: answered as any pickled prepare, as LMCache's server does, which
                # reserves nothing; the commit_store bringing the chunks is refused, counted
                # and logged with its keys (counted here too, one store would count twice).
                return PrepareStoreReply(context={})
            self.shared.refuse_too_large("prepare_store", key, exc)
            self._refuse_keys(exc.reason, exc.keys)
            return PrepareStoreReply(context=_ALL_PRESENT)  # no slots: the client skips its copy
        if not keys:
            return PrepareStoreReply(context=_ALL_PRESENT)  # no full chunk: nothing to store
        if self.shared.shm is None:
            return PrepareStoreReply(context={})  # pickled: the chunks come with commit_store
        if not self._maps_segment(instance, peer, "store"):
            self._refuse_keys("mp_transfer_unregistered_connection", len(keys))
            return PrepareStoreReply(context=_ALL_PRESENT)  # no slots: the client skips its copy
        repeated = self.writes.pop(instance_id, key.request_id, keys, time.monotonic(), peer)
        if repeated is not None and self._abort_unless_reaped(repeated):
            # The same request prepares the same range again on the same connection (it
            # timed out on the first; another process's prepare is not found here):
            # it never got those slots, so nobody writes into them; without this they would
            # stay write-locked for the write TTL.  Another request's reservation is never
            # touched: its client may be copying into it right now.
            self._skip_keys("repeated", len(repeated.reserved))
        elif repeated is not None:
            # L1 reaped (and fenced) it before this front end's deadline passed (read a
            # moment before L1 took it): an expired reservation whose copy may still be
            # going on.  Forgotten here, its extent stayed fenced for good; kept fenced
            # until its commit, counted as the sweep counts those it sees expire, and this
            # prepare refused as for any range whose expired reservation is outstanding.
            self.writes.fence([repeated])
            self._count_expired([repeated], 0)
        if self._refused_while_fenced(instance_id, key.request_id, keys, peer):
            return PrepareStoreReply(context=_ALL_PRESENT)  # no slots: the client skips its copy
        size = instance.object_bytes
        try:
            # Before L1 reserves: this deadline must not outlast L1's own (taken inside),
            # or the transfer would be counted live while L1 has already reaped it.
            deadline = time.monotonic() + self.shared.write_ttl_s
            reserved = self.storage.reserve_write(
                keys, [size] * len(keys), [instance.layout_text] * len(keys)
            )
        except L1OutOfMemoryError as exc:
            self._refuse_l1_full(exc, len(keys))
            # No slots, as from LMCache's server: the client skips its gather and commit.
            return PrepareStoreReply(context=_ALL_PRESENT)
        self._count_skips(self._skips(keys, reserved))
        if not reserved:
            # Every chunk is stored or being stored (by another request): nothing to do.
            return PrepareStoreReply(context=_ALL_PRESENT)
        if self.storage.l1.fence_writers(list(reserved.values())):
            # Reaped before they could be handed out (a write TTL shorter than this call):
            # unfenced, their extents may be reused, so no slot may name them.
            self.storage.abort_reserved(reserved)
            self._count_expired([Transfer(list(reserved), deadline, key.request_id, reserved=reserved)], 0)
            return PrepareStoreReply(context=_ALL_PRESENT)
        layout = instance.layout
        slots, indices = [], []
        for index, object_key in enumerate(keys):
            obj = reserved.get(object_key)
            if obj is not None:
                slots.append(
                    {
                        "offset": obj.offset,
                        "length": obj.size,
                        "shape": list(layout.shape),
                        "dtype": layout.dtype,
                    }
                )
                indices.append(index)
        transfer = Transfer(
            list(reserved),
            deadline,
            key.request_id,
            size * len(reserved),
            reserved=reserved,
            peer=peer,
            writer=self.peers.writer(self.source_fd),
        )
        self.writes.add(instance_id, keys, transfer)
        return Prepared(
            PrepareStoreReply(context={"slots": slots, "chunk_indices": indices}),
            partial(self._store_undelivered, transfer),
        )

    def _abort_unless_reaped(self, transfer: Transfer) -> bool:
        """Abort a store's reservation if L1 still holds every one of its objects as
        reserved; False (nothing aborted) if L1 reaped any: its writer may still copy into
        those, fenced, and an abort would free the others under that copy."""
        l1 = self.storage.l1
        with l1.lock:  # no reap between the look and the abort
            if any(l1.get(object_key) is not obj for object_key, obj in transfer.reserved.items()):
                return False
            self.storage.abort_reserved(transfer.reserved)
            return True

    def _store_undelivered(self, transfer: Transfer) -> None:
        """``prepare_store``'s answer could not be sent (its client is gone, or not reading
        its replies): nobody has its slots, so nobody copies into them or commits them.
        Its reservation goes back at once.  Left pending, its chunks stayed write-locked
        until the write TTL (other clients' stores of them got no slots), and its extents
        then stayed fenced until a commit that never comes -- for good when the client's
        process could not be told, as a client killed before its first scan."""
        if not self.writes.discard(transfer):
            return
        objs = list(transfer.reserved.values())
        self.storage.abort_reserved(transfer.reserved)
        self.storage.l1.writers_done(objs)
        self._refuse_keys("reply_dropped", len(objs))
        self._undelivered.event(
            1,
            "prepare_store answers could not be sent (the client is gone or not reading its "
            "replies): their reservations were given back",
        )

    def _refused_while_fenced(
        self, instance_id: int, request_id: str, keys: list[ObjectKey], peer: bytes
    ) -> bool:
        """Refuse (count, log) a store while fenced reservations reach their bound, or
        one of a range whose expired reservation its connection has not committed: that
        commit is what lifts the fence, and with two reservations of the range it would
        not say which copy ended."""
        writes = self.writes
        if writes.fenced_bytes >= self.fenced_bytes_bound:
            why = (
                f"expired reservations not committed yet hold {writes.fenced_bytes} bytes of L1 "
                f"(limit {self.fenced_bytes_bound}); their clients may still be copying into them"
            )
        elif writes.fenced and writes.is_fenced(writes.ident(instance_id, peer, request_id, keys)):
            why = "the connection's earlier reservation of the range expired and was not committed yet"
        else:
            return False
        self.shared.stats.failure("mp_store_refused_fenced")
        self._refuse_keys("mp_store_refused_fenced", len(keys))
        self._fence_refusals.event(1, f"stores refused: {why}")
        return True

    def _copies_ended(
        self,
        instance_id: int,
        request_id: str,
        keys: list[ObjectKey],
        peer: bytes,
        uncommitted: list[Any] | None = None,
    ) -> None:
        """A commit of this range came on this connection: its client has stopped copying
        into the range's reservations, so the fenced extents of those that expired go back
        (and those of ``uncommitted``, objects of the live transfer the commit found that
        L1 reaped first: its clock, not this front end's deadline, decides)."""
        writes = self.writes
        ident = writes.ident(instance_id, peer, request_id, keys)
        fenced = writes.take_fenced(ident) if writes.fenced else []
        objs = [obj for t in fenced for obj in t.reserved.values()]
        objs.extend(uncommitted or ())
        if not objs:
            return
        given_back = self.storage.l1.writers_done(objs)
        if given_back:
            logger.info(
                "commit_store of request %s came after its reservation expired: "
                "%d fenced L1 extents given back",
                printable(request_id),
                given_back,
            )

    def _commit_keys(self, key: CacheKey, instance_id: int) -> tuple[Instance, list[ObjectKey] | None]:
        """A shared-memory commit's instance and keys; None for keys no prepare accepts,
        which therefore have nothing pending.  LMCache's server answers such a commit (it
        looks the pending transfer up by the key as sent), and LMCache's client commits
        even a retrieve whose prepare got no answer: refused, it would wait out its
        timeout twice."""
        instance = self.shared.instance(instance_id)  # an unregistered one is refused, as in LMCache
        try:
            return instance, self._resolve(key, instance_id)[1]
        except (RequestRefused, KeyValidationError) as exc:
            logger.debug("commit of request %s: %s", printable(key.request_id), exc)
            return instance, None

    def commit_store(self, key: CacheKey, instance_id: int, data: bytes, *, peer: bytes = b"") -> Any:
        if data:
            return self._commit_pickled(key, instance_id, data, peer)
        try:
            _, keys = self._commit_keys(key, instance_id)
        except RequestRefused as exc:
            if exc.reason == "mp_unregistered_instance":
                self._end_store_of_unregistered(key, instance_id, peer)
            raise  # not answered, as by LMCache's server
        pending = (
            None
            if keys is None
            else self.writes.pop(instance_id, key.request_id, keys, time.monotonic(), peer)
        )
        if pending is None:
            if keys is not None:
                self._copies_ended(instance_id, key.request_id, keys, peer)
            self.shared.stats.failure("mp_commit_without_reservation")
            self._orphan_commits.event(
                1, "commit_store calls answered false: no reservation of their request (expired or none)"
            )
            logger.debug(
                "commit_store of request %s: no reservation of instance %d",
                printable(key.request_id),
                instance_id,
            )
            return False
        committed = self.storage.commit_reserved(pending.reserved)
        stored = len(committed)
        assert keys is not None  # a transfer was found by them
        lost: list[Any] = []
        if stored < len(pending.reserved):  # reaped by L1 first: fenced, and over now
            done = set(committed)
            lost = [obj for object_key, obj in pending.reserved.items() if object_key not in done]
        self._copies_ended(instance_id, key.request_id, keys, peer, lost)
        # The size it was reserved with: the instance may have registered another layout since.
        self._count_store(stored, stored * (pending.bytes // len(pending.reserved)))
        self._count_lost(len(pending.reserved) - stored)
        return stored == len(pending.reserved)

    def _end_store_of_unregistered(self, key: CacheKey, instance_id: int, peer: bytes) -> None:
        """A ``commit_store`` of an instance no longer registered (reaped for its silence,
        or unregistered by another connection) is refused, but it still says its client's
        copy into the range has ended: the connection's reservation of the range is given
        back, never made visible, and the fences of those that expired are lifted.  Left,
        the reservation stayed write-locked until the write TTL and was then fenced until
        a commit accepted -- which would not come -- or the client's exit."""
        try:
            keys = self._range_keys(key)
        except (RequestRefused, KeyValidationError):
            return  # a range no prepare reserves
        pending = self.writes.pop(instance_id, key.request_id, keys, time.monotonic(), peer)
        if pending is not None:
            self.storage.abort_reserved(pending.reserved)
            self._refuse_keys("unregistered", len(pending.reserved))
        self._copies_ended(instance_id, key.request_id, keys, peer, _objects_of(pending))

    def refuse_commit_at_stop(
        self, key: CacheKey, instance_id: int, data: bytes, *, peer: bytes = b""
    ) -> None:
        """A ``commit_store`` that came during the drain, refused (the loop counts the request
        and logs it): the keys of its pickled chunks are counted as refused, since nothing
        of them is stored.  A shared-memory commit's keys are those of its reservation,
        which the stop gives back and counts (``release_everything``)."""
        if not data:
            return
        try:
            _, keys = self._resolve(key, instance_id)
        except RequestTooLarge as exc:
            self._refuse_keys("shutting_down", exc.keys)
            return
        except (RequestRefused, KeyValidationError):
            return  # a store no server would take: it names no keys
        # A client that fell back from shared memory: its reservation goes now, as the
        # pickled store would have replaced it (see _start_pickled), not counted again at the stop.
        pending = self.writes.pop(instance_id, key.request_id, keys, time.monotonic(), peer)
        if pending is not None:
            self.storage.abort_reserved(pending.reserved)
        self._copies_ended(instance_id, key.request_id, keys, peer, _objects_of(pending))
        if pending is not None:
            self._skip_keys("repeated", len(pending.reserved))
        self._refuse_keys("shutting_down", len(keys))

    def _commit_pickled(self, key: CacheKey, instance_id: int, data: bytes, peer: bytes) -> Any:
        # LMCache's server reads the range of pickled chunks: a key it cannot read is refused
        try:
            instance, keys = self._resolve(key, instance_id)
        except RequestTooLarge as exc:
            self.shared.refuse_too_large("commit_store", key, exc)
            self._refuse_keys(exc.reason, exc.keys)
            return False
        except RequestRefused as exc:
            if exc.reason == "mp_unregistered_instance":
                # Its client copies into no slot of the range any more (it sent the chunks
                # pickled instead), as a shared-memory commit of such an instance says.
                self._end_store_of_unregistered(key, instance_id, peer)
            raise  # not answered, as by LMCache's server
        try:
            return self._start_pickled(key, instance, keys, data, peer)
        except Exception as exc:
            # Not answered (the loop counts the request and logs it); its keys are known
            # by now and were not stored, so they count under the same reason.
            self._refuse_keys(failure_reason(exc), len(keys))
            raise

    def _start_pickled(
        self, key: CacheKey, instance: Instance, keys: list[ObjectKey], data: bytes, peer: bytes
    ) -> Any:
        pending = self.writes.pop(instance.instance_id, key.request_id, keys, time.monotonic(), peer)
        if pending is not None:
            # A client that fell back from shared memory: its reservation goes now, while
            # it is known to be alive.  On the pool, later, the write TTL may have passed
            # and the key be another writer's, freed under its copy.
            self.storage.abort_reserved(pending.reserved)
        # Sent once the client gave up its shared-memory copy: its fences go too.
        self._copies_ended(instance.instance_id, key.request_id, keys, peer, _objects_of(pending))
        if pending is not None:
            self._skip_keys("repeated", len(pending.reserved))  # named again by this commit
        if self.shared.pickle is None:
            self.shared.stats.failure("mp_pickle_refused")
            self._refuse_keys("mp_pickle_refused", len(keys))
            self._pickle_refusals.event(
                1, 'pickled chunks refused: this front end takes them only with "allow_pickle": true'
            )
            return False
        return self._store_pickled(instance, keys, data)

    def _store_pickled(self, instance: Instance, keys: list[ObjectKey], data: bytes) -> Deferred:
        store = _PickledStore(len(keys))
        self._pickled_stores.add(store)

        def work() -> Callable[[], Any]:
            try:
                if not store.given_up:  # else the stop counted it: nothing to copy
                    self._write_pickled(store, instance, keys, data)
            except Exception as exc:
                error, reason = exc, failure_reason(exc)
                if not store.end_without_commit(partial(self._refuse_keys, reason, len(keys))):
                    # The stop gave up on it first and counted it (mp_shutting_down): its
                    # failure is not counted, nor logged, a second time.
                    return partial(self._answer_pickled, store)

                def failed() -> Any:
                    self._answer_pickled(store)
                    raise error  # the loop counts the request and logs it

                return failed
            return partial(self._answer_pickled, store)

        # One that ended before the stop is counted as it ended, not as given up: unanswered
        # (a forced stop handles no completion), the request itself is the router's to count.
        return Deferred(work, counted_at_stop=lambda: store.given_up)

    def _answer_pickled(self, store: _PickledStore) -> Any:
        """Loop thread: count how a pickled store ended (unless the stop has) and answer it."""
        self._pickled_stores.discard(store)
        return store.count()

    def _write_pickled(
        self, store: _PickledStore, instance: Instance, keys: list[ObjectKey], data: bytes
    ) -> None:
        """On the pool: unpickle, reserve, copy and commit ``data``, settling ``store``
        with how it ended (unless the stop gave up on it first: then nothing is committed)."""
        codec, storage = self.shared.pickle, self.storage
        assert codec is not None
        size, layout = instance.object_bytes, instance.layout_text
        try:
            chunks = codec.load(data, len(keys), instance.layout)
        except ValueError as exc:
            message = str(exc)
            store.end_without_commit(partial(self._reject_pickled, message, len(keys)))
            return
        try:
            fresh = storage.reserve_write(keys, [size] * len(keys), [layout] * len(keys))
        except L1OutOfMemoryError as exc:
            store.end_without_commit(partial(self._refuse_pickled_l1_full, exc, len(keys)))
            return
        try:
            skips = self._skips(keys, fresh)  # here: it asks L1, which the loop must not wait for
            copied = _copy_chunks(storage, keys, chunks, fresh)
        except BaseException:
            storage.abort_reserved(fresh)
            raise

        def commit() -> Callable[[], Any]:
            if not copied:
                # An object left L1, or is no longer being written: its reservation was
                # reaped during the copy.  Nothing of this store is made visible (only its
                # own reservations are acted on: ``abort_reserved``, ``commit_reserved``).
                storage.abort_reserved(fresh)
                return partial(self._count_pickled, skips, 0, len(fresh), size)
            try:
                committed = storage.commit_reserved(fresh)
            except BaseException:
                storage.abort_reserved(fresh)
                raise
            return partial(self._count_pickled, skips, len(committed), len(fresh), size)

        if not store.commit_and_end(commit):
            # Given up at the stop, its keys counted as refused: never made visible now.
            storage.abort_reserved(fresh)

    def _refuse_pickled_l1_full(self, exc: L1OutOfMemoryError, keys: int) -> bool:
        self._refuse_l1_full(exc, keys)
        return False

    def _reject_pickled(self, message: str, keys: int) -> bool:
        self.shared.stats.failure("mp_pickle_rejected")
        self._refuse_keys("mp_pickle_rejected", keys)
        self._pickle_rejections.event(1, f"pickled stores rejected: {message}")
        return False

    def _count_pickled(self, skips: Mapping[str, int], stored: int, reserved: int, size: int) -> bool:
        self._count_skips(skips)
        self._count_store(stored, stored * size)
        self._count_lost(reserved - stored)  # as the shared-memory commit counts them
        return stored == reserved

    def _maps_segment(self, instance: Instance, peer: bytes, what: str) -> bool:
        """Whether the connection registered the instance with this server, and so maps
        this server's segment.  One that did not (a client of the previous server process,
        reconnected by ZeroMQ, or one whose connection was re-established) still maps some
        other memory: given offsets, it would copy its chunks where this server never sees
        them and commit the extents' stale bytes, or read garbage as KV.  Its store gets no
        slots and its retrieve misses until it registers again."""
        if instance.maps_segment(peer):
            return True
        self.shared.stats.failure("mp_transfer_unregistered_connection")
        refused = f"transfers refused ({what} of instance {instance.instance_id}): their connection"
        if peer in instance.forgotten:
            self._forgotten.event(
                1,
                f"{refused}'s registration was forgotten (more than {MAX_MAPPING_CONNECTIONS} "
                "connections registered the instance since its last transfer or ping): it must "
                "register again",
            )
        else:
            self._unmapped.event(
                1,
                f"{refused} did not register the instance with this server process, so it does not "
                "map this server's segment (a client of a restarted server, or a reconnected one, "
                "that has not registered again)",
            )
        return False

    def _refuse_l1_full(self, exc: L1OutOfMemoryError, keys: int) -> None:
        self.shared.stats.failure("mp_store_refused_l1_full")
        self._refuse_keys("mp_store_refused_l1_full", keys)
        self._refusals.event(1, f"stores refused: L1 cannot make room ({exc})")

    def _skips(self, keys: list[ObjectKey], reserved: Mapping[ObjectKey, Any]) -> dict[str, int]:
        """Why the keys of a store that L1 did not reserve were skipped: L1 has them, or
        another writer holds their reservation (they become readable when it commits).
        Asks L1 only when some were skipped; callable from a pool thread."""
        unreserved = set(keys).difference(reserved)
        if not unreserved:
            return {}
        being_written = self.storage.l1.count_being_written(unreserved)
        return {"present": len(unreserved) - being_written, "being_written": being_written}

    def _count_skips(self, skips: Mapping[str, int]) -> None:
        for reason, count in skips.items():
            self._skip_keys(reason, count)

    def _skip_keys(self, reason: str, count: int) -> None:
        """Keys a store named that L1 did not need, per key (``store_keys_skipped``)."""
        if count:
            self.shared.stats.store_keys_skipped[reason] += count

    def _refuse_keys(self, reason: str, count: int) -> None:
        """Keys a store named that were not stored, per key (``store_keys_refused``); the
        request's refusal itself is counted once in the failures, and logged, by the caller."""
        if count:
            self.shared.stats.store_keys_refused[reason] += count

    def _count_lost(self, lost: int) -> None:
        """Reserved chunks L1 no longer held at commit (reaped past the write TTL)."""
        if lost:
            self.shared.stats.failure("mp_commit_lost", lost)
            self._refuse_keys("reservation_lost", lost)
            self._lost_commits.event(lost, "committed chunks were lost: L1 reaped their reservations first")

    def _count_store(self, chunks: int, nbytes: int) -> None:
        if chunks:
            stats = self.shared.stats
            stats.stores += 1
            stats.store_chunks += chunks
            stats.store_bytes += nbytes

    # -- retrieve ------------------------------------------------------------------------

    def prepare_retrieve(self, key: CacheKey, instance_id: int, *, peer: bytes = b"") -> Any:
        try:
            instance, keys = self._resolve(key, instance_id)
        except RequestTooLarge as exc:
            self.shared.refuse_too_large("prepare_retrieve", key, exc)
            return _MISS  # the engine recomputes
        if not keys:
            return _MISS
        if self.shared.shm is not None and not self._maps_segment(instance, peer, "retrieve"):
            return _MISS
        if self.reads.keys_of(peer) >= self.shared.config.max_request_keys:
            return self._refuse_uncommitted(peer)
        if self.shared.shm is None and self.unread.over_bound(peer):
            return self._refuse_unread(peer)
        now = time.monotonic()
        deadline = now + self.shared.lock_ttl_s  # not after L1's own (see prepare_store)
        objects = self.storage.read(keys)
        # No later than the locks' own deadline: their release drops them, never a lock
        # another reader forgot on the same chunk.
        not_before = self.storage.l1.lock_deadline(now)
        size, layout_text = instance.object_bytes, instance.layout_text
        if len(objects) < len(keys) or any(
            obj.size != size or (obj.layout and obj.layout != layout_text) for obj in objects
        ):
            self.storage.release(keys[: len(objects)], not_before=not_before)
            if len(objects) == len(keys):
                self.shared.stats.failure("mp_retrieve_layout_mismatch")
                self._mismatches.event(
                    1, f"retrieves missed: L1 holds the chunks with another layout than {layout_text}"
                )
            return _MISS
        total = size * len(objects)
        lookup = self.lookups.current(key.request_id)
        if self.shared.shm is None:
            return self._retrieve_pickled(key, instance, keys, objects, not_before, lookup, peer)
        transfer = Transfer(keys, deadline, key.request_id, total, not_before, peer=peer, lookup=lookup)
        self.reads.add(instance_id, keys, transfer)
        self._count_retrieve(len(objects), total)
        layout = instance.layout
        slots = [
            {"offset": obj.offset, "length": obj.size, "shape": list(layout.shape), "dtype": layout.dtype}
            for obj in objects
        ]
        return Prepared(
            PrepareRetrieveReply(success=True, data=b"", context={"slots": slots}),
            partial(self._retrieve_undelivered, transfer),
        )

    def _retrieve_undelivered(self, transfer: Transfer) -> None:
        """``prepare_retrieve``'s answer could not be sent: nobody reads out of its slots,
        so its read locks go back at once rather than shortly before the lock TTL (its
        request's lookup keeps its own, for a retrieve that does arrive)."""
        if not self.reads.discard(transfer):
            return
        self.storage.release(transfer.keys, not_before=transfer.not_before)
        self._undelivered.event(
            1,
            "prepare_retrieve answers could not be sent (the client is gone or not reading its "
            "replies): their read locks were given back",
        )

    def _retrieve_pickled(
        self,
        key: CacheKey,
        instance: Instance,
        keys: list[ObjectKey],
        objects: list[Any],
        not_before: float,
        lookup: LookupJob | None,
        peer: bytes,
    ) -> Deferred:
        codec, storage, unread = self.shared.pickle, self.storage, self.unread
        assert codec is not None
        retrieve = _PickledRetrieve(keys, not_before)
        self._pickled_retrieves.add(retrieve)

        def work() -> Callable[[], Any]:
            if not retrieve.start():  # the stop gave up on it and gave its locks back
                return partial(self._end_pickled_retrieve, retrieve, self._lost_retrieve)
            if unread.over_bound(peer):
                # Asked again here: a burst of requests sent at once all passed the loop's
                # check before the pool encoded any reply.
                storage.release(keys, not_before=not_before)
                return partial(self._end_pickled_retrieve, retrieve, partial(self._refuse_unread, peer))
            try:
                try:
                    chunks = [storage.lend(obj).detach() for obj in objects]
                except KeyError as exc:
                    # L1 could not vouch for a copy (the object left L1 and its extent may
                    # have changed hands meanwhile): a miss, never another chunk's bytes.
                    logger.warning("pickled retrieve of request %s answered a miss: %s", key.request_id, exc)
                    return partial(self._end_pickled_retrieve, retrieve, self._lost_retrieve)
                finally:
                    storage.release(keys, not_before=not_before)
                data = codec.dump(chunks, instance.layout)
                del chunks
                reply = unread.track(
                    peer, encode_reply(PrepareRetrieveReply(success=True, data=data, context={}))
                )
                del data
            except Exception as exc:
                error = exc

                def failed() -> Any:
                    self._pickled_retrieves.discard(retrieve)
                    if retrieve.given_up:
                        return _MISS  # counted at the stop, not a second time
                    raise error  # the loop counts the request and logs it

                return failed

            def answer() -> Any:
                self.lookups.consume(lookup, keys)
                self._count_retrieve(len(keys), instance.object_bytes * len(keys))
                return EncodedReply(reply)

            return partial(self._end_pickled_retrieve, retrieve, answer)

        return Deferred(work)

    def _end_pickled_retrieve(self, retrieve: _PickledRetrieve, answer: Callable[[], Any]) -> Any:
        """Loop thread: answer a pickled retrieve; a miss if the stop gave up on it (and
        counted it) meanwhile."""
        self._pickled_retrieves.discard(retrieve)
        return _MISS if retrieve.given_up else answer()

    def _refuse_unread(self, peer: bytes) -> Any:
        """A pickled retrieve of a connection whose replies not read yet reach their bound:
        a miss (the engine recomputes), counted and logged."""
        self.shared.stats.failure("mp_replies_unread")
        self._unread_refusals.event(
            1,
            f"pickled retrieves answered a miss: their connection's replies not read yet hold "
            f"{self.unread.held(peer)} bytes of the server's memory (bound {self.unread.bound}, "
            "max_message_mb); the client must read its replies before asking for more",
        )
        return _MISS

    def _refuse_uncommitted(self, peer: bytes) -> Any:
        """A retrieve of a connection whose retrieves prepared and not committed yet name
        ``max_request_keys`` keys or more: a miss (the engine recomputes), counted and
        logged.  Each keeps its keys and read locks until its commit or the sweep shortly
        before the lock TTL: without a bound, a client that never commits grew the server's
        memory by one per request for that long.  One retrieve is always served."""
        self.shared.stats.failure("mp_retrieves_uncommitted")
        self._uncommitted_refusals.event(
            1,
            f"prepare_retrieve calls answered a miss: their connection's retrieves not committed "
            f"yet name {self.reads.keys_of(peer)} keys (bound {self.shared.config.max_request_keys}, "
            "max_request_keys); the client must commit its retrieves before preparing more",
        )
        return _MISS

    def _lost_retrieve(self) -> Any:
        self.shared.stats.failure("mp_retrieve_object_lost")
        return _MISS

    def commit_retrieve(self, key: CacheKey, instance_id: int, *, peer: bytes = b"") -> Any:
        try:
            _, keys = self._commit_keys(key, instance_id)
        except RequestRefused as exc:
            if exc.reason == "mp_unregistered_instance":
                # Refused, as by LMCache's server, but its client's copy out of the range
                # has ended: the connection's read locks on it go now, not near the lock TTL
                # (an instance unregistered by another connection leaves them pending).
                self._end_retrieve(key, instance_id, peer)
            raise
        if keys is not None:
            self._end_retrieve(key, instance_id, peer, keys)
        return True

    def _end_retrieve(
        self, key: CacheKey, instance_id: int, peer: bytes, keys: list[ObjectKey] | None = None
    ) -> None:
        """Release the read locks of the connection's retrieve of the range, and one of its
        lookup's locks on each chunk."""
        if keys is None:
            try:
                keys = self._range_keys(key)
            except (RequestRefused, KeyValidationError):
                return  # a range no prepare locks
        pending = self.reads.pop(instance_id, key.request_id, keys, time.monotonic(), peer)
        if pending is not None:
            self.storage.release(pending.keys, not_before=pending.not_before)
            self.lookups.consume(pending.lookup, keys)

    def _count_retrieve(self, chunks: int, nbytes: int) -> None:
        stats = self.shared.stats
        stats.retrieves += 1
        stats.retrieve_chunks += chunks
        stats.retrieve_bytes += nbytes

    # -- instances and maintenance ---------------------------------------------------------

    def drop_instance(
        self, instance_id: int, peer: bytes | None = None, *, copies_ended: bool = False
    ) -> tuple[int, int]:
        """Give back an instance's unfinished transfers: reservations aborted (never made
        visible half-written), read locks released.  Returns (locks, reservations).

        With ``peer`` (the client's own unregister), only that connection's: another
        process sending the same instance id may still be copying into its reserved slots
        or out of its read-locked ones, and freed, those extents could change hands under
        its copy.  Its transfers go at their deadlines, counted as expired.

        Without ``peer`` (the instance reaped for its silence) its reservations are left to
        their deadline too: a silent client may be one stalled before its copy.  They
        expire, and are fenced, as any reservation never committed.

        ``copies_ended`` (an unregister): the connection has stopped copying into the
        instance's reservations -- LMCache's client unregisters once it has drained its
        gathers and commits -- so their fenced extents go back too."""
        writes = self.writes.pop_instance(instance_id, peer) if peer is not None else []
        counts = self._give_back(writes, self.reads.pop_instance(instance_id, peer), "unregistered")
        if not (copies_ended and peer is not None):
            return counts
        # Those that expired, fenced here (some just now), and the live ones aborted: L1's
        # clock, not this front end's deadline, decides whether it reaped and fenced them.
        fenced = self.writes.take_fenced_of(instance_id, peer)
        ended = {id(obj): obj for t in (*fenced, *writes) for obj in t.reserved.values()}
        given_back = self.storage.l1.writers_done(list(ended.values())) if ended else 0
        if given_back:
            logger.info(
                "instance %d unregistered by its connection: %d fenced L1 extents of its expired "
                "reservations given back",
                instance_id,
                given_back,
            )
        return counts

    def _give_back(self, writes: list[Transfer], reads: list[Transfer], why: str) -> tuple[int, int]:
        """Abort ``writes`` and release ``reads``; the keys of the reservations aborted are
        counted as refused for ``why`` (they were never committed, so never stored)."""
        # Expired ones are L1's already (it reaped them), maybe someone else's by now;
        # they were never committed, so they count as the sweep would have counted them.
        now = time.monotonic()
        expired_writes = [t for t in writes if t.deadline <= now]
        expired_reads = [t for t in reads if t.deadline <= now]
        writes = [t for t in writes if t.deadline > now]
        reads = [t for t in reads if t.deadline > now]
        self.writes.fence(expired_writes)  # their clients may still be copying
        self._count_expired(expired_writes, len(expired_reads))
        for transfer in writes:
            self.storage.abort_reserved(transfer.reserved)
            self._refuse_keys(why, len(transfer.reserved))
        for transfer in reads:
            self.storage.release(transfer.keys, not_before=transfer.not_before)
        return sum(len(t.keys) for t in reads), sum(len(t.keys) for t in writes)

    def sweep(self, now: float) -> None:
        # The read locks of a retrieve whose client never commits are given back here,
        # just before the transfer's deadline (never later than L1's, which would reap
        # them at their own deadline anyway): after it, L1 may have reaped the lock and a
        # release by key could take another reader's.
        margin = min(READ_RELEASE_MARGIN_S, self.shared.lock_ttl_s / 2)
        due = self.reads.take_due(now, margin)
        for transfer in due:
            self.storage.release(transfer.keys, not_before=transfer.not_before)
        self._count_expired(self.writes.expire(now), len(self.reads.expire(now)) + len(due))
        self._release_fences_of_exited_writers()
        self._count_peer_scan_failures()

    def _arena(self) -> tuple[int, int] | None:
        """The (device, inode) of the shared-memory segment, which a store's writer maps
        (None: stores are pickled, nothing is mapped).  One that cannot be read names no
        file: then no process is taken for a writer, and fences wait for commits."""
        if self.shared.shm is None:
            return None
        path = f"/dev/shm/{self.shared.shm[0]}"  # what LMCache clients open (checked at start)
        try:
            info = os.stat(path)
        except OSError as exc:
            logger.error(
                "the shared-memory segment %s cannot be read (%s): no client process is "
                "taken for a store's writer, so fences are lifted only by commits and unregisters",
                path,
                exc,
            )
            return (0, 0)
        return info.st_dev, info.st_ino

    def _count_peer_scan_failures(self) -> None:
        """Count and log the connections whose process lookup failed or was given up
        (``peers.py``)."""
        self.peers.count_failures(self.shared.stats.failure, _scan_failure_meaning)

    def _release_fences_of_exited_writers(self) -> None:
        """Give back the fenced extents of stores whose client process has exited
        (``peers.py``): a process that exited copies nothing into them any more."""
        if not self.writes.fenced:
            return
        released = self.writes.take_fenced_of_exited_writers()
        if not released:
            return
        objs = [obj for transfer in released for obj in transfer.reserved.values()]
        given_back = self.storage.l1.writers_done(objs)
        self.shared.stats.failure("mp_fence_writer_exited", len(released))
        logger.warning(
            "%d expired reservations never committed were held by client processes that have "
            "exited (connections %s): their %d fenced L1 extents are given back [mp_fence_writer_exited]",
            len(released),
            ", ".join(sorted({transfer.peer.hex() for transfer in released})),
            given_back,
        )

    def _count_expired(self, reservations: list[Transfer], reads: int) -> None:
        """Transfers never committed within the L1 TTLs: each counted once, and the keys
        of the reservations among them as refused (never stored)."""
        self._refuse_keys("reservation_expired", sum(len(t.reserved) for t in reservations))
        expired = len(reservations) + reads
        if expired:
            self.shared.stats.failure("mp_transfer_expired", expired)
            self._expiries.event(
                expired,
                "prepared transfers were never committed within the L1 TTLs; their locks were given back",
            )

    def release_everything(self) -> tuple[int, int]:
        # Expired transfers a commit dropped since the last sweep are counted only by the
        # next sweep, which does not come after a stop: counted here.
        now = time.monotonic()
        self._count_expired(self.writes.expire(now), len(self.reads.expire(now)))
        self._give_up_pickled_stores()
        self._give_up_pickled_retrieves()
        self.peers.close()
        self._count_peer_scan_failures()
        return self._give_back(self.writes.pop_all(), self.reads.pop_all(), "shutting_down")

    def _give_up_pickled_stores(self) -> None:
        """At the stop: pickled stores still copying when the drain ended, or dropped from
        the pool's queue before they ran, are never answered nor committed; their keys are
        counted as refused here (and not again if a copy finishes later).  Those that ended
        but were not answered yet are counted as they ended."""
        stores, self._pickled_stores = self._pickled_stores, set()
        given_up = [store for store in stores if store.give_up()]
        if given_up:
            self.shared.stats.failure("mp_shutting_down", len(given_up))
            self._refuse_keys("shutting_down", sum(store.keys for store in given_up))
            self._abandoned_stores.event(
                len(given_up),
                "pickled commit_store calls given up at the stop (still copying at the drain "
                "deadline, or not started): not answered, nothing of them stored",
            )

    def _give_up_pickled_retrieves(self) -> None:
        """At the stop: pickled retrieves not answered yet are given up, counted once.  The
        read locks of those that never started (dropped from the pool's queue, or not
        reached by the drain) are given back here; one still copying gives back its own,
        and is answered a miss if it ends while the last replies go out."""
        retrieves, self._pickled_retrieves = self._pickled_retrieves, set()
        for retrieve in retrieves:
            if retrieve.give_up():
                self.storage.release(retrieve.keys, not_before=retrieve.not_before)
        if retrieves:
            self.shared.stats.failure("mp_shutting_down", len(retrieves))
            self._abandoned_retrieves.event(
                len(retrieves),
                "pickled prepare_retrieve calls given up at the stop (queued, or still copying at "
                "the drain deadline): not answered, or answered a miss; their read locks given back",
            )


def _scan_failure_meaning(reason: str) -> str:
    """What a lookup that failed, was given up or named no writer does to its connection's
    stores: the writer is not known, and only what the client itself says lifts their fences."""
    return "their stores' fences are lifted only by their commit or unregister"


def _objects_of(transfer: Transfer | None) -> list[Any]:
    """The L1 objects a store's transfer reserved (none for None)."""
    return [] if transfer is None else list(transfer.reserved.values())


def _copy_chunks(
    storage: Any, keys: list[ObjectKey], chunks: list[memoryview], fresh: Mapping[ObjectKey, Any]
) -> bool:
    """Copy each chunk into the object reserved for its key, if any; False when L1 no
    longer vouches for one (the object left L1, or is no longer being written: its
    reservation was reaped during the copy)."""
    try:
        for object_key, chunk in zip(keys, chunks, strict=True):
            obj = fresh.get(object_key)
            if obj is not None:
                loan = storage.lend(obj, fill=True)
                loan.buffer[:] = chunk
                loan.commit()
    except (KeyError, ValueError):
        return False
    return True


class _PickledRetrieve:
    """A pickled ``prepare_retrieve`` handed to the pool with its chunks read-locked: the
    pool thread copies them out and releases the locks, unless the stop gave up on it
    before it started -- then the stop releases them (exactly one of the two, under the
    lock both take)."""

    def __init__(self, keys: list[ObjectKey], not_before: float) -> None:
        self.keys = keys
        self.not_before = not_before
        self._lock = threading.Lock()
        self._started = False
        self.given_up = False

    def start(self) -> bool:
        """Pool thread: False if the stop gave up on it first (its locks are gone)."""
        with self._lock:
            if self.given_up:
                return False
            self._started = True
            return True

    def give_up(self) -> bool:
        """Loop thread, at the stop: True if it never started (its locks are the caller's
        to release); a started one releases its own."""
        with self._lock:
            self.given_up = True
            return not self._started


class _PickledStore:
    """A pickled ``commit_store`` handed to the pool, until its keys are counted -- exactly
    once: by its answer on the loop thread, or at the stop when that never comes (the
    drain gave up on it, or the pool's queue dropped it before it ran).

    The pool thread ends it (commits, or not, and records how it ended: its *ending*, which
    counts its keys and returns its reply) under the lock the stop takes to give up on it,
    so exactly one of the two happens: a store given up on is never committed, and one
    that ended is counted as it ended, by whichever of its answer and the stop comes
    first."""

    def __init__(self, keys: int) -> None:
        self.keys = keys
        self._lock = threading.Lock()
        self.given_up = False
        #: how it ended: counts its keys and returns its reply (run once, on the loop thread)
        self._ending: Callable[[], Any] | None = None
        self._counted = False
        self._reply: Any = False

    def commit_and_end(self, commit: Callable[[], Callable[[], Any]]) -> bool:
        """Pool thread: run ``commit`` (which makes the copied chunks visible, or gives their
        reservations back) and keep the ending it returns -- unless the stop gave up on the
        store first: then False, and ``commit`` is not run."""
        with self._lock:
            if self.given_up:
                return False
            self._ending = commit()
            return True

    def end_without_commit(self, ending: Callable[[], Any]) -> bool:
        """Pool thread: keep ``ending`` for a store that stored nothing (its chunks were
        rejected or refused, or its copy raised) -- unless the stop gave up on it first:
        then False."""
        with self._lock:
            if self.given_up:
                return False
            self._ending = ending
            return True

    def give_up(self) -> bool:
        """Loop thread, at the stop: True if the store had not ended (now it never does:
        its keys are the caller's to count); otherwise its ending is counted."""
        with self._lock:
            if self._ending is None:
                self.given_up = self._counted = True
                return True
        self.count()
        return False

    def count(self) -> Any:
        """Loop thread: count how the store ended, once; its reply (false if given up)."""
        if not self._counted:
            self._counted = True
            assert self._ending is not None, "answered before it ended"
            self._reply = self._ending()
        return self._reply
