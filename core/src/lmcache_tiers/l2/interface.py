"""The non-blocking interface the controllers use to talk to an L2 adapter.

Every batch operation that may touch a slow device is *submitted*: the call returns a task
id at once, the adapter signals the operation's eventfd when results are ready, and the
caller pops them.  The store controller and the prefetch controller call one adapter from
two threads at the same time; each operation kind has a single consumer, which is what
makes "pop everything completed" safe.

Plugin authors do not implement this class: they write a backend (plain batch I/O, see
:mod:`lmcache_tiers.protocols`) and core wraps it in
:class:`~lmcache_tiers.l2.adapter.BackendAdapter`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Protocol

from lmcache_tiers.keys import ObjectKey


class L2Op(enum.IntEnum):
    """Operation kinds that complete asynchronously; each has its own eventfd."""

    STORE = 0
    LOOKUP = 1
    LOAD = 2


class LookupResult(NamedTuple):
    """Result of one ``submit_lookup_and_lock`` task, aligned with the submitted keys."""

    found: list[bool]
    #: bytes an L1 object needs to receive the key (its decoded size); 0 for misses
    sizes: list[int]

    @classmethod
    def misses(cls, count: int) -> LookupResult:
        """A miss of each of ``count`` keys (nothing pinned)."""
        return cls([False] * count, [0] * count)


class LoadResult(list[bool]):
    """Result of one ``submit_load`` task: success per key (a list of bools, as before),
    and ``layouts``: the tensor layout each loaded key's record stated (``""``: none, or
    the key not loaded).  Each load carries its own, so the L1 object it fills gets the
    layout of the bytes this load copied -- not another load's of the same key."""

    def __init__(self, ok: Sequence[bool], layouts: Sequence[str] | None = None) -> None:
        super().__init__(ok)
        self.layouts: list[str] = [""] * len(ok) if layouts is None else list(layouts)
        if len(self.layouts) != len(ok):
            raise ValueError(f"{len(ok)} results but {len(self.layouts)} layouts")


def layouts_of(result: Sequence[bool]) -> list[str]:
    """The layouts a load's result carries; all ``""`` for a plain list (a task failed
    as a whole, or an adapter that keeps no layouts)."""
    if isinstance(result, LoadResult):
        return result.layouts
    return [""] * len(result)


class L2Listener(Protocol):
    """Observer of an adapter (e.g. the per-adapter L2 eviction policy).

    Called from the adapter's own threads (or the thread calling ``delete`` or
    ``lookup_and_lock_now``) after the operation took effect and before its result is
    published; must not block.  ``on_l2_keys_deleted`` also reports accounted keys the
    backend answered absent (removed behind the adapter's back, e.g. by another server
    sharing the store), found by a lookup or by the check after a delete that did not
    remove them, and damaged records the backend removed itself (a load that did not
    verify): a listener may be told of keys it never saw stored, or saw deleted.
    ``on_l2_keys_stored`` likewise also reports keys a lookup found that the adapter did
    not account (stored by another server sharing the store): accounted from then on.

    Optional: ``on_l2_keys_absent(adapter, keys)``, found by name (listeners without it
    are not told).  Keys a ``delete`` did not remove that the adapter never accounted
    and that the check after it found absent from the store: never stored through this
    adapter, so not reported deleted, yet possibly known to the listener from the
    listing (``iter_keys``) -- e.g. stored by another server after the start-up scan,
    then removed.  A listener that seeded itself from the listing forgets them here.

    Optional: ``on_l2_keys_scanned(adapter, keys)``, found by name.  Keys the start-up
    scan accounted from the backend's listing (stored before this process started, or by
    another server), batch by batch: every key counted in ``used_bytes`` is announced
    once, by a store, a lookup's adoption or the scan.  The batches accounted while the
    adapter is built come before any listener is added; a listener that seeds itself from
    ``iter_keys`` reads those, and may read a key the scan announces as well.
    """

    def on_l2_keys_stored(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None: ...

    def on_l2_keys_loaded(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None: ...

    def on_l2_keys_deleted(self, adapter: L2Adapter, keys: Sequence[ObjectKey]) -> None: ...


class L2Adapter(ABC):
    """One configured L2 backend, as the controllers see it.

    Event fds: ``event_fd(op)`` becomes readable when at least one task of ``op`` may have
    completed.  ``pop_completed_*`` drains the fd before collecting results, so a wake-up
    can find nothing (an empty dict) but a completed result is never left behind without
    the fd being readable.  The fds stay valid after ``close()`` until the adapter is
    garbage collected, so a thread still polling never sees a recycled descriptor.
    """

    #: instance label, e.g. ``"0:mock"``
    name: str
    #: True: the buffers handed to ``submit_store``/``submit_load`` must be views into the
    #: L1 arena (``AdapterContext.l1_buffer``), because the backend addresses them by
    #: offset in memory it registered once (NIXL, GDS).  False: any buffer works.
    needs_l1_buffers: bool = True

    @property
    def answers_lookups_now(self) -> bool:
        """Whether ``lookup_and_lock_now`` can answer (from memory) rather than always
        saying None.  A front end decodes a lookup's keys lazily only when every adapter
        can: then a new prompt's lookup asks them about its first key alone.  False by
        default."""
        return False

    @property
    def circuit_open(self) -> bool:
        """Whether every call is refused now without reaching the backend (its circuit
        breaker open).  Read-only and cheap: L2 eviction asks before each cycle and before
        seeding its policy.  False by default (an adapter without a breaker)."""
        return False

    @abstractmethod
    def event_fd(self, op: L2Op) -> int:
        """File descriptor that is readable when results of ``op`` are ready."""

    @abstractmethod
    def submit_store(
        self,
        keys: Sequence[ObjectKey],
        buffers: Sequence[memoryview],
        layouts: Sequence[str] | None = None,
    ) -> int:
        """Start storing ``buffers[i]`` under ``keys[i]``; returns the task id.

        The buffers must stay valid and unchanged until the task's result is popped.
        ``layouts[i]`` is the object's tensor layout string ("" or None: unknown), handed
        to the serde chain (see :class:`~lmcache_tiers.serde.SerdeContext`).
        """

    @abstractmethod
    def pop_completed_stores(self) -> dict[int, list[bool]]:
        """Results of finished store tasks: task id -> success per key."""

    @abstractmethod
    def submit_lookup_and_lock(self, keys: Sequence[ObjectKey]) -> int:
        """Start checking which keys are present; every hit is pinned once.

        A pinned key cannot be deleted or evicted until ``unlock`` drops the pin.  The
        caller must unlock every key reported found, whether it loads it or not.
        """

    def lookup_and_lock_now(self, keys: Sequence[ObjectKey]) -> LookupResult | None:
        """``submit_lookup_and_lock`` answered on the calling thread, or None.

        For an adapter that can tell from memory, without blocking, which keys it holds:
        the result is what the submitted lookup would report, its hits pinned once each
        the same way (unlock them as usual), and no task, eventfd signal or result to
        pop.  None means it cannot answer now (the default, and whatever needs I/O): the
        caller submits the lookup instead.  Safe to call from any thread.
        """
        return None

    @abstractmethod
    def pop_completed_lookups(self) -> dict[int, LookupResult]:
        """Results of finished lookup tasks: task id -> found and sizes per key."""

    @abstractmethod
    def submit_load(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> int:
        """Start copying each key's object into ``buffers[i]`` (its exact L1 size).

        Keys are expected to be pinned by a lookup; a buffer whose size differs from the
        object's, or a key no longer present, fails for that key only.
        """

    @abstractmethod
    def pop_completed_loads(self) -> dict[int, list[bool]]:
        """Results of finished load tasks: task id -> success per key, a
        :class:`LoadResult` when it carries the layouts its records stated
        (:func:`layouts_of` reads them from either)."""

    @abstractmethod
    def unlock(self, keys: Sequence[ObjectKey]) -> None:
        """Drop one pin per occurrence of each key; unpinned keys are ignored."""

    @abstractmethod
    def delete(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Delete now (synchronously); pinned keys, keys a store is writing and absent
        keys are not deleted (False)."""

    def pinned(self, keys: Sequence[ObjectKey]) -> list[bool]:
        """Whether ``delete`` would refuse each key now, or refused it at its last call,
        for the adapter's own reasons (pinned by a lookup or load, or a store of it in
        flight) rather than because the backend failed to remove it (all False: cannot
        tell)."""
        return [False] * len(keys)

    @abstractmethod
    def usage(self) -> float:
        """Used bytes / capacity, or -1.0 when the backend has no capacity."""

    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of stored objects this adapter knows of."""

    @abstractmethod
    def used_bytes_by_salt(self) -> dict[str, int]:
        """``used_bytes`` split by ``cache_salt`` (the empty salt is ``""``)."""

    @abstractmethod
    def iter_keys(self) -> Iterator[ObjectKey]:
        """Every stored key (order unspecified; may be slow on large backends)."""

    @abstractmethod
    def add_listener(self, listener: L2Listener) -> None:
        """Register an observer of stores, loads and deletes."""

    @abstractmethod
    def close(self) -> None:
        """Finish or fail every pending task, stop threads, release the backend.

        Idempotent.  Results of failed tasks can still be popped afterwards; tasks
        submitted after close complete at once as failures.
        """

    def stats(self) -> dict[str, int]:
        """Counters (monotonic) and gauges for metrics; names are adapter-defined."""
        return {}
