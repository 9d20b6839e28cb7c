"""Every interface a plugin implements, in one module.

* :class:`L2Backend` / :class:`AsyncL2Backend` -- the plain batch I/O of an L2 backend;
  core wraps it into the adapter the controllers use (see :mod:`lmcache_tiers.l2`);
* :class:`StorePolicy`, :class:`PrefetchPolicy`, :class:`EvictionPolicy` -- small pure
  objects the controllers consult;
* :class:`Serde` -- one reversible byte transform of an adapter's serde chain.

The front-end contract (a wire protocol the server speaks) is in
:mod:`lmcache_tiers.frontend`, next to the code that checks and builds front ends.

Plugins reach these names through :mod:`lmcache_tiers.plugin`.  This module imports
nothing heavy: manifests that name a protocol stay cheap to import.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from lmcache_tiers.keys import ObjectKey

if TYPE_CHECKING:
    from lmcache_tiers.serde import SerdeContext

__all__ = [
    "AdapterInfo",
    "AsyncL2Backend",
    "Capacity",
    "EvictionPolicy",
    "ImmediateLookups",
    "L2Backend",
    "ObjectSize",
    "PrefetchPolicy",
    "Serde",
    "StorePolicy",
]


# -- L2 backends -------------------------------------------------------------------------------


class ObjectSize(NamedTuple):
    """Sizes of one stored object.

    ``stored`` is what the backend holds (the serde chain's output, what counts against
    capacity); ``l1`` is the decoded size a load needs in L1.  They differ only with a
    size-changing serde chain.
    """

    stored: int
    l1: int


class Capacity(NamedTuple):
    """What a backend can hold: bytes, objects, or both (None: no limit of that kind).

    Slot stores (a fixed number of files, blocks or regions) declare ``objects``: their
    usage is the fraction of slots in use, whatever the objects' sizes.
    """

    bytes: int | None = None
    objects: int | None = None


#: what ``contains_many`` reports per key: None (miss), the stored size or both sizes
Found = int | ObjectSize | None


@runtime_checkable
class L2Backend(Protocol):
    """Plain batch I/O of one L2 backend, written as ordinary (blocking) methods.

    Core wraps the backend in one adapter that owns everything else: worker threads,
    task ids, eventfds, pins between lookup and load, lock-aware delete, byte accounting
    (seeded at start from ``list_keys``), capacity refusals, the serde chain and listener
    notifications.  Each operation kind (store, lookup, load) runs on its own worker
    thread(s), and ``delete_many`` on the caller's thread, so the methods must be
    thread-safe.  Every method gets keys in prefix order and answers one result per key;
    an exception or a result of the wrong length fails the whole batch (counted as
    ``backend_errors``).

    Optional members, found by name when present:

    * ``preflight(config)`` -- a staticmethod or classmethod of the backend class (or an
      attribute of a factory function): cheap checks of what the config names (paths,
      devices), run for every configured adapter before the L1 arena exists; raises
      :class:`~lmcache_tiers.config.FieldError` naming the field, and builds nothing
      (``check_directory`` and ``check_file`` of the plugin API do the usual ones);
    * ``open()`` -- runs once before any other call;
    * ``close()`` -- runs once when the adapter closes, after the calls still running
      finished (or ``close_timeout_s`` passed); waited for at most
      ``close_backend_timeout_s``, then left running (``backend_close_timeouts``) and
      the adapter's close fails (``BackendCloseTimedOut``), as when it raises;
    * ``interrupt()`` -- called once when closing starts, to unblock calls in progress
      (a remote peer that stopped answering); sleeps through ``context.sleep`` end anyway;
    * ``stats() -> Mapping[str, int]`` -- gauges merged into the adapter's ``stats()``;
    * ``needs_l1_buffers: bool`` (class attribute, default False) -- True when the
      backend addresses the buffers it gets by their place in ``context.l1_buffer``
      (memory registered once); such a backend is refused with the NVMe L1;
    * ``concurrency: int`` -- worker threads per operation kind (default 1);
    * ``remote: bool`` (class attribute, default False) -- True for a store reached over
      the network: core then puts a circuit breaker in front of it unless the adapter's
      ``circuit.enabled`` says otherwise (see :mod:`lmcache_tiers.l2.circuit`);
    * ``ping()`` -- a cheap call that raises when the store does not answer; the
      breaker's probe (``contains_many`` of ``PROBE_KEY`` without it).  A coroutine for
      coroutine backends;
    * ``contains_many_now(keys)`` -- :class:`ImmediateLookups`: ``contains_many``
      answered from memory on the caller's thread, so that a lookup needs no hop to a
      worker thread (a plain method for coroutine backends too).
    """

    def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> Sequence[bool]:
        """Store each payload under its key, replacing an existing object; True where stored.

        Payloads are valid only during the call.  Capacity was checked by core: a
        backend refuses a key only when it really cannot store it.
        """
        ...

    def contains_many(self, keys: Sequence[ObjectKey]) -> Sequence[Found]:
        """The stored size of each present key (what ``put_many`` got), None for a miss.

        A persistent backend whose records carry the L1 size returns ``ObjectSize`` when
        ``context.l1_size_of(key)`` is None: that is how the L1 size of an object stored
        by an earlier process is recovered under a size-changing serde chain.
        """
        ...

    def get_many_into(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> Sequence[bool]:
        """Fill each buffer (exactly the stored size) with its object; False where not."""
        ...

    def delete_many(self, keys: Sequence[ObjectKey]) -> Sequence[bool]:
        """Remove each key; False where it was absent or could not be removed."""
        ...

    def list_keys(self) -> Iterable[tuple[ObjectKey, int | ObjectSize]]:
        """Every stored key with its size (as ``contains_many`` reports it).

        Core reads it once at start, in the background, to account what an earlier
        process stored; the L2 eviction controller reads it to seed its policy.
        """
        ...

    def capacity(self) -> int | Capacity | None:
        """Bytes (an int), a :class:`Capacity`, or None when there is no natural limit.

        Cheap and called from any thread; stores that do not fit are refused by core.
        """
        ...


@runtime_checkable
class AsyncL2Backend(Protocol):
    """The same batch I/O as :class:`L2Backend`, written as coroutines.

    Core runs them on an event loop of the adapter's own thread, at most ``concurrency``
    calls at once (default 64); ``open`` and ``close`` may be coroutines too (``open`` is
    where loop-bound clients are created).  ``list_keys`` may be an async generator.
    ``capacity``, ``interrupt`` and ``stats`` stay plain methods.  Whether a backend is
    asynchronous is read from its methods: the four batch methods are all coroutine
    functions or none is.
    """

    async def put_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> Sequence[bool]: ...

    async def contains_many(self, keys: Sequence[ObjectKey]) -> Sequence[Found]: ...

    async def get_many_into(
        self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]
    ) -> Sequence[bool]: ...

    async def delete_many(self, keys: Sequence[ObjectKey]) -> Sequence[bool]: ...

    def list_keys(
        self,
    ) -> AsyncIterable[tuple[ObjectKey, int | ObjectSize]] | Iterable[tuple[ObjectKey, int | ObjectSize]]: ...

    def capacity(self) -> int | Capacity | None: ...


@runtime_checkable
class ImmediateLookups(Protocol):
    """Optional backend capability: answer a lookup from memory, now, without blocking.

    Core calls ``contains_many_now`` on the thread serving the request (a front end's),
    with the keys already pinned as for ``contains_many``, and uses the answer exactly as
    that of ``contains_many`` (same per-key results, same checks; hits stay pinned).  A
    backend whose index lives in memory (a slot table, a dict) answers it in
    microseconds, and a lookup it answers needs no hand-off to the adapter's worker
    thread and back: a miss is known at once, and a hit goes straight to the load.

    The method must not do I/O, sleep, or wait for a lock another thread may hold for
    longer than a dict access (take it with ``acquire(blocking=False)``); it must be
    thread-safe against the backend's worker threads.  Returning None means "not now"
    (the index is not loaded yet, a lock is busy, a key needs its record read): core then
    asks ``contains_many`` on the worker thread as before.  An exception or a malformed
    answer is counted (``backend_errors``) and also falls back.  Backends without the
    method, and backends behind a wrapper (circuit breaker, fault injection), are always
    asked on their worker threads.
    """

    def contains_many_now(self, keys: Sequence[ObjectKey]) -> Sequence[Found] | None: ...


# -- policies ----------------------------------------------------------------------------------


class AdapterInfo(NamedTuple):
    """What a policy may know about one L2 adapter of the cascade."""

    # Shadows tuple.index on purpose: the field name is part of the policy contract.
    index: int  # type: ignore[assignment]  # position in the cascade (0 = first)
    type: str  # registered adapter type, e.g. "mock"
    name: str  # instance label, e.g. "0:mock"
    usage: float  # used/capacity, -1.0 when the adapter has no capacity


@runtime_checkable
class StorePolicy(Protocol):
    """Decides where freshly written L1 objects go, and whether L1 keeps them."""

    def select_store_targets(
        self, keys: Sequence[ObjectKey], adapters: Sequence[AdapterInfo]
    ) -> dict[int, list[ObjectKey]]:
        """Map adapter index -> the keys (a subset of ``keys``) to store there."""
        ...

    def select_l1_deletions(self, keys: Sequence[ObjectKey]) -> list[ObjectKey]:
        """Of ``keys`` just stored successfully in L2, those L1 should drop now."""
        ...


@runtime_checkable
class PrefetchPolicy(Protocol):
    """Decides which adapter each L2 hit is loaded from."""

    #: False: loaded objects are temporary in L1 (freed after their last read).
    retain_loaded: bool

    def select_load_plan(
        self,
        keys: Sequence[ObjectKey],
        found: Sequence[Sequence[bool]],
        adapters: Sequence[AdapterInfo],
    ) -> dict[int, list[bool]]:
        """Map adapter index -> bitmap over ``keys`` of what to load from it.

        ``found[i][k]`` tells whether adapter ``adapters[i]`` holds ``keys[k]``.  A key
        should be planned from at most one adapter that found it; the controller trims
        the plan to its contiguous prefix.  Each bitmap is ``len(keys)`` booleans (a list,
        a tuple or a numpy bool array); any other answer is the policy's failure, counted
        as ``prefetch_policy_error`` (the request is an L2 miss); keys planned from an
        adapter not among ``adapters`` end the prefix (``prefetch_policy_bad_adapter``), as
        do keys planned only from adapters that did not find them
        (``prefetch_policy_planned_miss``).
        """
        ...


@runtime_checkable
class EvictionPolicy(Protocol):
    """Orders keys for eviction; used for L1 and for each L2 adapter alike.

    Optional, both or neither: ``set_aside(keys)`` and ``put_back(keys)``.  L1 eviction
    calls ``set_aside`` once a walk is over with the keys it passed over because their
    objects were read-locked (in walk order), and ``put_back`` before a later walk with
    those of them whose locks ended or that left L1 (in any order).  Between the two the
    policy leaves them out of its walks; put back, it offers them where its order puts
    them.  Reads, writes and removals of keys set aside are reported as usual; ``put_back``
    ignores keys it does not hold aside (the keys of a ``put_back`` that raised are given
    again before every walk until one returns).  Without the pair, a policy that puts locked
    objects first is walked past every one of them on every write that evicts.
    """

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        """Keys became present; later keys of a batch must be evicted first."""
        ...

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        """Keys were read (same tail-first ordering as writes)."""
        ...

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        """Keys are gone (deleted, evicted or freed); forget them."""
        ...

    def victims(self) -> Iterator[ObjectKey]:
        """Keys in eviction order.

        The caller stops iterating once enough is freed.  It calls no other method of
        the policy while the iterator is in use, so a lazy generator over internal state
        is fine.  The removals a walk causes are reported afterwards, with an empty
        ``on_keys_removed([])`` when it removed nothing, so the first removal report
        after a walk always ends it.  Each key it holds at most once per walk: a walk
        offering a key twice, or more keys than it could hold (those stored, plus those
        whose removal report it failed on), is cut short, counted
        (``l1_eviction_policy_overrun``, ``l2_eviction_policy_overrun``) and logged.  An
        L1 policy's key that L1 holds no stored object of (never written, already removed,
        or a reservation still being written) is passed over, counted
        (``l1_eviction_policy_unknown_victim``) and logged.
        """
        ...


# -- serde and front ends ----------------------------------------------------------------------


@runtime_checkable
class Serde(Protocol):
    """One reversible byte transform.

    ``name`` identifies the transform in persisted record headers (so a record written
    with another chain is recognised and refused rather than decoded wrongly).

    ``decode(data, context)``: ``context.size`` is the size of the object in L1, i.e. the
    decoded size of the *whole* chain.  The first serde of a chain (the last to decode)
    must return exactly that many bytes; a serde further down the chain whose own output
    is not the L1 size must carry what it needs in its encoding.  Either method may raise
    (a tampered ciphertext, a truncated frame): the adapter turns that into a miss of that
    object only.  Both may be called from several threads at once.

    Optional: ``max_encoded_size(size: int) -> int``, an upper bound of what ``encode``
    returns for ``size`` input bytes.  When every serde of a chain declares one, the
    adapter sizes the buffer the encoded object is staged in from it; an output larger
    than its serde's bound fails that object (counted ``serde_bound_exceeded``).
    """

    name: str

    def encode(self, data: memoryview, context: SerdeContext) -> bytes | memoryview: ...

    def decode(self, data: memoryview, context: SerdeContext) -> bytes | memoryview: ...


#: what ``L2Backend.stats`` returns
BackendStats = Mapping[str, int]
