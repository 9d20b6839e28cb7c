"""What the LMCache front end remembers between requests.

* **Instances**: worker processes that registered their KV layout
  (``register_kv_cache_engine_driven_context``); a lookup needs one for its (model, world
  size), a transfer its own.  Silent instances are reaped as in LMCache.
* **Requests**: per ``request_id``, the chunk hashes computed so far and the latest
  lookup's job: its prefetch handle, then the hit count (delivered to the client once) and
  the read locks the prefetch took, which the request's retrieves consume one per key and
  ``free_lookup_locks`` / ``end_session`` give back.
* **Pending transfers**: SHM reservations between ``prepare_store`` and ``commit_store``,
  read locks between ``prepare_retrieve`` and ``commit_retrieve``, per (instance, client
  connection, request, keys): a commit finishes only what its own request prepared on its
  own connection.  A store's reservation that expired stays **fenced** until that commit
  comes (``PendingTransfers.fenced``; see ``transfers.py``).

Only the front end's loop thread touches these objects, except :class:`LookupJob`'s
``arrived`` event and ``arrived_hits``, which the one pool thread waiting for a prefetch
sets (hits first, then the event); the loop thread sets the event too when it settles a
job itself.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from lmcache_plugin_lmcache_mp.chunks import LOOKUP_KEY_BYTES, HashCache, request_id_bytes
from lmcache_plugin_lmcache_mp.peers import WriterWatch
from lmcache_tiers.plugin import ObjectKey, TensorLayout

__all__ = ["Instance", "LookupJob", "PendingTransfers", "RequestTable", "Transfer"]

#: connections remembered per instance as having registered it (see Instance.mapped_by):
#: client processes sharing an instance id at once; beyond it the least recently used one
#: is forgotten and must register again
MAX_MAPPING_CONNECTIONS = 64

#: a client connection: its ZeroMQ identity and its socket (``loop.connection``; named:
#: Transfer has a field called ``bytes``)
Peer = bytes

#: what a commit names: (instance id, connection, request id, keys of the range)
_Ident = tuple[int, Peer, str, tuple[ObjectKey, ...]]


@dataclass
class Instance:
    """A registered worker: its layout and when it was last heard of."""

    instance_id: int
    model_name: str
    world_size: int
    layout: TensorLayout
    registered: float
    last_seen: float
    #: the connection (``Peer``) whose registration is in force: only it may
    #: unregister the instance (an earlier process of a restarted client may not)
    peer: bytes = b""
    pinged: bool = False
    #: every connection that registered the instance with this server (least recently
    #: used first, bounded): only those mapped this server's segment.  A connection that
    #: did not -- a client of the previous server process that ZeroMQ reconnected here --
    #: still maps the old segment: offsets in this one would have it copy into or out of
    #: the wrong memory.  Used, not registered, order: ``lmcache bench server`` shares
    #: fixed ids, and runs killed before they unregister must not push out a live client.
    mapped_by: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    #: connections dropped from ``mapped_by`` to bound it (bounded too), so that the
    #: refusal of their transfers can tell that cause from a server restart
    forgotten: OrderedDict[bytes, None] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.note_mapped(self.peer)

    def note_mapped(self, peer: bytes) -> int:
        """Record that ``peer`` registered the instance (and maps this server's segment);
        returns how many other connections were forgotten to make room."""
        self.mapped_by[peer] = None
        self.mapped_by.move_to_end(peer)
        self.forgotten.pop(peer, None)
        dropped = 0
        while len(self.mapped_by) > MAX_MAPPING_CONNECTIONS:
            oldest, _ = self.mapped_by.popitem(last=False)
            self.forgotten[oldest] = None
            dropped += 1
        while len(self.forgotten) > MAX_MAPPING_CONNECTIONS:
            self.forgotten.popitem(last=False)
        return dropped

    def maps_segment(self, peer: bytes) -> bool:
        """Whether ``peer`` registered the instance with this server; if so it is marked
        the most recently used (a transfer or ping of it), the last to be forgotten."""
        if peer not in self.mapped_by:
            return False
        self.mapped_by.move_to_end(peer)
        return True

    @property
    def object_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def layout_text(self) -> str:
        return self.layout.format()


@dataclass
class LookupJob:
    """One lookup of a request.

    ``hits`` (chunks) is None while the prefetch runs.  Once known, ``held`` counts the
    lookup's read locks still held per key: ``readers`` per key of the hit prefix, less one
    for each retrieve that consumed it.  ``keys`` only name those locks: once none is held
    they are emptied (``Lookups.forget_keys_if_unlocked``).
    """

    handle: int
    keys: list[ObjectKey]  # chunk-major, every rank of every chunk
    world_size: int
    readers: int
    started: float
    hits: int | None = None
    held: dict[ObjectKey, int] = field(default_factory=dict)
    delivered: bool = False  # the hit count went to a query or wait (exactly once)
    waited: bool = False  # a pool thread is waiting for the prefetch: only it asks the storage
    retired: bool = False  # replaced or ended while a pool thread waited: give back on arrival
    arrived: threading.Event = field(default_factory=threading.Event)
    arrived_hits: int | None = None
    #: chunks freed (free_lookup_locks) before the hit count was known, a flag each (empty:
    #: none): a chunk freed again takes no more room, however often a client repeats it
    early_frees: bytearray = field(default_factory=bytearray)
    #: the request it is the lookup of (whose remembered size counts its keys)
    request_id: str = ""

    def settle(self, locked_keys: int) -> list[ObjectKey]:
        """Record the prefetch's result (the count of leading keys it read-locked); returns
        the keys whose locks cover no whole chunk, to be released now."""
        locked_keys = max(0, min(locked_keys, len(self.keys)))
        self.hits = locked_keys // self.world_size
        whole = self.hits * self.world_size
        self.held = dict.fromkeys(self.keys[:whole], self.readers)
        return self.keys[whole:locked_keys]

    def take(self, keys: list[ObjectKey], count: int | None = None) -> dict[int, list[ObjectKey]]:
        """Forget ``count`` (all when None) of the locks held on each of ``keys``; the
        forgotten ones grouped by how many, for ``StorageManager.release(keys, n)``."""
        groups: dict[int, list[ObjectKey]] = {}
        held = self.held
        for key in keys:
            have = held.get(key, 0)
            if not have:
                continue
            taken = have if count is None else min(count, have)
            if taken == have:
                del held[key]
            else:
                held[key] = have - taken
            groups.setdefault(taken, []).append(key)
        return groups

    def keys_of_chunks(self, first: int, last: int) -> list[ObjectKey]:
        return self.keys[first * self.world_size : last * self.world_size]

    def free_early(self, first: int, last: int) -> None:
        """Chunks ``first..last-1`` were freed before the hit count was known."""
        chunks = len(self.keys) // self.world_size
        last = min(last, chunks)
        if first < last:
            if not self.early_frees:
                self.early_frees = bytearray(chunks)
            self.early_frees[first:last] = b"\x01" * (last - first)

    def keys_freed_early(self) -> list[ObjectKey]:
        """The keys of the chunks freed before the hit count was known, within the hits."""
        freed = self.early_frees[: self.hits or 0]
        return [
            key for chunk, flag in enumerate(freed) if flag for key in self.keys_of_chunks(chunk, chunk + 1)
        ]


@dataclass
class RequestState:
    request_id: str
    last_seen: float
    hashes: HashCache = field(default_factory=HashCache)
    job: LookupJob | None = None
    #: its size in the table's total (``RequestTable.remembered_bytes``)
    counted_bytes: int = 0

    def nbytes(self) -> int:
        """The memory its tokens, hashes and lookup keys take (estimated), and its id
        beyond what an id usually takes."""
        keys = 0 if self.job is None else len(self.job.keys)
        return self.hashes.nbytes() + keys * LOOKUP_KEY_BYTES + request_id_bytes(self.request_id)


class RequestTable:
    """Requests by id, least recently seen first; bounded in number, and in the memory
    their ids, tokens, hashes and lookup keys take (``max_bytes``)."""

    def __init__(self, max_requests: int, max_bytes: int = 1 << 30) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        #: what the requests' tokens and hashes take, as of their last :meth:`account`
        self.remembered_bytes = 0
        self._requests: OrderedDict[str, RequestState] = OrderedDict()

    def get(self, request_id: str, now: float) -> RequestState:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = RequestState(request_id, now)
            self.account(state)  # a long id takes memory from the start
        else:
            state.last_seen = now
            self._requests.move_to_end(request_id)
        return state

    def peek(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def pop(self, request_id: str) -> RequestState | None:
        return self._forget(self._requests.pop(request_id, None))

    def account(self, state: RequestState) -> None:
        """Take the current size of ``state`` into the total (after hashing, and after
        its lookup changed)."""
        size = state.nbytes()
        self.remembered_bytes += size - state.counted_bytes
        state.counted_bytes = size

    def _forget(self, state: RequestState | None) -> RequestState | None:
        if state is not None:
            self.remembered_bytes -= state.counted_bytes
            state.counted_bytes = 0
        return state

    def _pop_oldest(self) -> RequestState:
        state = self._requests.popitem(last=False)[1]
        self._forget(state)
        return state

    def overflow(self) -> list[RequestState]:
        """The least recently seen requests beyond the bound, removed."""
        dropped = []
        while len(self._requests) > self.max_requests:
            dropped.append(self._pop_oldest())
        return dropped

    def over_memory(self, keep: RequestState) -> list[RequestState]:
        """The least recently seen requests whose tokens, hashes and lookup keys take the
        total past ``max_bytes``, removed; never ``keep``, the request being served (the
        most recently seen), whose own size its caller checked."""
        dropped = []
        while self.remembered_bytes > self.max_bytes and self._requests:
            if next(iter(self._requests.values())) is keep:
                break
            dropped.append(self._pop_oldest())
        return dropped

    def idle(self, since: float) -> list[RequestState]:
        """Requests not seen since ``since``, removed."""
        dropped = []
        for request_id, state in list(self._requests.items()):
            if state.last_seen >= since:
                break  # ordered by last_seen
            dropped.append(self._requests.pop(request_id))
            self._forget(dropped[-1])
        return dropped

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._requests.values()))

    def __len__(self) -> int:
        return len(self._requests)


@dataclass
class Transfer:
    """Reserved or read-locked objects of one prepare, until its commit."""

    keys: list[ObjectKey]
    deadline: float  # no later than L1's own (write or lock TTL): after it, never act on the keys
    request_id: str
    bytes: int = 0
    #: a retrieve's: no later than its read locks' deadlines (``L1Manager.lock_deadline`` of a
    #: time read before they were taken), for ``StorageManager.release``'s ``not_before``
    not_before: float | None = None
    #: a store's: the L1 objects its prepare reserved, by key.  Its commit or abort acts on
    #: these objects only (``commit_reserved``, ``abort_reserved``): a key whose reservation
    #: L1 reaped may be another writer's by then.
    reserved: Mapping[ObjectKey, Any] = field(default_factory=dict)
    #: the connection (``Peer``) that prepared it: two client processes may
    #: send the same instance and request ids (``lmcache bench server`` uses fixed ones),
    #: and one must never commit, abort or replace the other's transfer
    peer: Peer = b""
    #: a retrieve's: its request's lookup when it was prepared, whose locks its commit
    #: consumes -- not those of a newer lookup of the request made meanwhile
    lookup: LookupJob | None = None
    #: what its commit names (instance, connection, request, keys), set by ``add``
    ident: _Ident | None = None
    #: a store's: the process of the connection that prepared it, when the kernel named
    #: it (``peers.py``); once that process has exited, nothing copies into its slots
    writer: WriterWatch | None = None


def held_bytes(transfer: Transfer) -> int:
    """The L1 bytes a store's reservation holds: its objects' extents, aligned, which for
    small objects are several times their size (never counted as less than that size)."""
    extents = sum(getattr(obj, "extent_bytes", 0) for obj in transfer.reserved.values())
    return max(transfer.bytes, extents)


class PendingTransfers:
    """Prepared transfers by (instance id, connection, request id, keys); a repeat of the
    same prepare queues.

    With ``fence`` (shared-memory stores), a transfer found expired is also kept as
    **fenced** until a commit names it (:meth:`take_fenced`): its client may still be
    copying into the extents L1 reaped, which L1 holds until told it stopped
    (``L1Manager.writers_done``)."""

    def __init__(self, *, fence: bool = False) -> None:
        self._pending: dict[_Ident, deque[Transfer]] = {}
        #: expired transfers a pop found (and dropped) before a sweep did: the sweep counts them
        self._expired_since_sweep: list[Transfer] = []
        self._fence = fence
        #: expired transfers whose commit has not come, by what that commit names
        self.fenced: dict[_Ident, list[Transfer]] = {}
        #: the L1 bytes the fenced transfers hold (their objects' extents)
        self.fenced_bytes = 0
        #: the keys of each connection's pending transfers (``keys_of``)
        self._keys_by_peer: dict[Peer, int] = {}

    @staticmethod
    def ident(instance_id: int, peer: Peer, request_id: str, keys: list[ObjectKey]) -> _Ident:
        return (instance_id, peer, request_id, tuple(keys))

    def add(self, instance_id: int, keys: list[ObjectKey], transfer: Transfer) -> None:
        ident = transfer.ident = self.ident(instance_id, transfer.peer, transfer.request_id, keys)
        self._pending.setdefault(ident, deque()).append(transfer)
        by_peer = self._keys_by_peer
        by_peer[transfer.peer] = by_peer.get(transfer.peer, 0) + len(transfer.keys)

    def keys_of(self, peer: Peer) -> int:
        """How many keys the pending transfers prepared on connection ``peer`` name."""
        return self._keys_by_peer.get(peer, 0)

    def _removed(self, transfers: Iterable[Transfer]) -> None:
        """Take ``transfers``, no longer pending, out of their connections' key counts."""
        by_peer = self._keys_by_peer
        for transfer in transfers:
            left = by_peer.get(transfer.peer, 0) - len(transfer.keys)
            if left > 0:
                by_peer[transfer.peer] = left
            else:
                by_peer.pop(transfer.peer, None)

    def fence(self, transfers: list[Transfer]) -> None:
        """Keep expired ``transfers`` fenced until their commit (see the class)."""
        if not self._fence:
            return
        for transfer in transfers:
            assert transfer.ident is not None, "fenced before it was added"
            self.fenced.setdefault(transfer.ident, []).append(transfer)
            self.fenced_bytes += held_bytes(transfer)

    def is_fenced(self, ident: _Ident) -> bool:
        return ident in self.fenced

    def take_fenced_of(self, instance_id: int, peer: Peer) -> list[Transfer]:
        """The fenced transfers of an instance prepared on connection ``peer``, forgotten
        here (its unregister: the client has stopped copying)."""
        idents = [ident for ident in self.fenced if ident[0] == instance_id and ident[1] == peer]
        return [transfer for ident in idents for transfer in self.take_fenced(ident)]

    def take_fenced_of_exited_writers(self) -> list[Transfer]:
        """The fenced transfers whose writer's process has exited, forgotten here: a
        process that exited copies nothing any more."""
        taken: list[Transfer] = []
        exited: dict[WriterWatch, bool] = {}  # one look per connection
        for ident, transfers in list(self.fenced.items()):
            kept = []
            for transfer in transfers:
                writer = transfer.writer
                if writer is not None and writer not in exited:
                    exited[writer] = writer.exited()
                if writer is not None and exited[writer]:
                    taken.append(transfer)
                else:
                    kept.append(transfer)
            if len(kept) == len(transfers):
                continue
            if kept:
                self.fenced[ident] = kept
            else:
                del self.fenced[ident]
        self.fenced_bytes -= sum(held_bytes(transfer) for transfer in taken)
        return taken

    def take_fenced(self, ident: _Ident) -> list[Transfer]:
        """The fenced transfers a commit of ``ident`` names, forgotten here: the client
        sends its commit once its copy ended."""
        taken = self.fenced.pop(ident, [])
        self.fenced_bytes -= sum(held_bytes(transfer) for transfer in taken)
        return taken

    def pop(
        self, instance_id: int, request_id: str, keys: list[ObjectKey], now: float, peer: bytes = b""
    ) -> Transfer | None:
        """The oldest live transfer of these keys by this instance for this request, prepared
        on connection ``peer`` (expired ones are dropped: L1 has reaped their locks, which
        may belong to someone else by now)."""
        ident = (instance_id, peer, request_id, tuple(keys))
        queue = self._pending.get(ident)
        found = None
        while queue and found is None:
            transfer = queue.popleft()
            self._removed((transfer,))
            if transfer.deadline > now:
                found = transfer
            else:
                self._expired_since_sweep.append(transfer)
                self.fence([transfer])
        if queue is not None and not queue:
            del self._pending[ident]
        return found

    def discard(self, transfer: Transfer) -> bool:
        """Forget ``transfer`` itself (not another prepare of its range); False when it is
        not pending any more."""
        ident = transfer.ident
        queue = None if ident is None else self._pending.get(ident)
        if ident is None or not queue:
            return False
        for index, queued in enumerate(queue):
            if queued is transfer:  # by identity: two prepares of one range compare equal
                del queue[index]
                self._removed((transfer,))
                if not queue:
                    del self._pending[ident]
                return True
        return False

    def pop_instance(self, instance_id: int, peer: Peer | None = None) -> list[Transfer]:
        """The instance's transfers (only those prepared on connection ``peer``, if given)."""
        mine = [
            ident for ident in self._pending if ident[0] == instance_id and (peer is None or ident[1] == peer)
        ]
        taken = [transfer for ident in mine for transfer in self._pending.pop(ident)]
        self._removed(taken)
        return taken

    def pop_all(self) -> list[Transfer]:
        everything = [transfer for queue in self._pending.values() for transfer in queue]
        self._pending.clear()
        self._keys_by_peer.clear()
        return everything

    def take_due(self, now: float, margin: float) -> list[Transfer]:
        """Remove and return the transfers whose deadline comes within ``margin`` but has
        not passed (those past it are left to :meth:`expire`)."""
        due: list[Transfer] = []
        for ident, queue in list(self._pending.items()):
            keep = deque(t for t in queue if not now < t.deadline <= now + margin)
            if len(keep) == len(queue):
                continue
            due.extend(t for t in queue if now < t.deadline <= now + margin)
            if keep:
                self._pending[ident] = keep
            else:
                del self._pending[ident]
        self._removed(due)
        return due

    def expire(self, now: float) -> list[Transfer]:
        """Forget transfers past their deadline (L1 reaped them); returns them, with those
        a pop dropped since the last call (else a commit that came just after the deadline,
        before the sweep, would hide its transfer's expiry from the counters)."""
        expired, self._expired_since_sweep = self._expired_since_sweep, []
        for ident, queue in list(self._pending.items()):
            live = deque(t for t in queue if t.deadline > now)
            newly = [t for t in queue if t.deadline <= now]
            self._removed(newly)
            self.fence(newly)
            expired.extend(newly)
            if live:
                self._pending[ident] = live
            else:
                del self._pending[ident]
        return expired

    def count(self) -> int:
        return sum(len(queue) for queue in self._pending.values())

    def keys_count(self) -> int:
        return sum(len(t.keys) for queue in self._pending.values() for t in queue)
