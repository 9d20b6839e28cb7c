"""Value types of L1: object states, the per-object record, listener protocol, stats."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from lmcache_tiers.keys import ObjectKey


class ObjectState(enum.Enum):
    WRITING = "writing"  # reserved and write-locked: a writer is filling the extent
    READY = "ready"  # complete; readable, and read-lockable any number of times


@dataclass(slots=True, eq=False)
class L1Object:
    """One object in the arena. Owned by the L1Manager: callers read it, never modify it.

    ``lock_deadline`` is the monotonic time at which the write lock expires while WRITING;
    while READY and read-locked by readers, the latest of their locks' deadlines.  Each
    reader's lock keeps its own deadline: ``lock_groups`` is None while every reader lock
    expires at ``lock_deadline`` (one holder, or locks taken within one step of the lock
    grid: the usual case), else the locks per deadline as ``[deadline, count, deadline,
    count, ...]``, earliest first -- a few dozen live deadlines at most, however many locks
    (``l1/reads.py``).  An L2 store's locks (``storing``, also counted in ``read_locks``)
    have none: they are never reaped.
    """

    key: ObjectKey
    offset: int
    size: int
    temporary: bool = False
    state: ObjectState = ObjectState.WRITING
    read_locks: int = 0
    lock_deadline: float = field(default=0.0, repr=False)
    #: tensor layout of the bytes when the writer gave one ("" = unknown); see layout.py
    layout: str = ""
    #: aligned bytes of its extent (the allocator's length at ``offset``), kept here so that
    #: the running total of locked extents (``l1/table.py``) costs an add per lock change
    #: (right after ``layout``: a reservation passes every field up to it by position)
    extent_bytes: int = field(default=0, repr=False)
    #: committed but its L2 stores are not settled yet: eviction takes it last, and counts it
    unstored: bool = field(default=False, repr=False)
    #: reserved by a prefetch that fills it from L2: only that prefetch may finish or abort it
    loading: bool = field(default=False, repr=False)
    #: L2 store tasks reading its extent now: their locks are not reaped at the lock TTL, and
    #: if the object leaves L1 meanwhile its extent is kept until the last of them reports
    storing: int = field(default=0, repr=False)
    #: the readers' locks per deadline when they do not all share ``lock_deadline``
    lock_groups: list[float] | None = field(default=None, repr=False)
    #: writers' stores of its key skipped while it was being written (they were told the key
    #: is there): acknowledged writes lost if this reservation ends uncommitted (``l1/writes.py``)
    skipped_writes: int = field(default=0, repr=False)
    #: NVMe L1: write-back errors of the file counted when its bytes were written; an error
    #: counted since may have taken them (``l1/access.py``)
    written_in: int = field(default=0, repr=False)
    #: reserved by a writer that copies into the shared arena itself: if the reservation
    #: expires, its extent is fenced until that writer says it stopped (``l1/leases.py``)
    fenced: bool = field(default=False, repr=False)
    #: once it left L1 with its extent held for its expired locks' grace period alone, the
    #: end of that period (inf: fenced); kept here so that the hold allocates nothing
    #: (``l1/leases.py``)
    held_until: float = field(default=0.0, repr=False)

    @property
    def locked(self) -> bool:
        return self.state is ObjectState.WRITING or self.read_locks > 0


class L1Listener(Protocol):
    """Told about L1 changes. Called inside the L1 lock, in registration order: must not block.

    Every key passed to ``on_l1_keys_deleted`` is gone from L1 when it is called; every
    object that leaves L1 (deleted, evicted, aborted, expired, temporary freed) is reported
    exactly once, except at :meth:`L1Manager.close`.
    """

    def on_l1_keys_written(self, keys: Sequence[ObjectKey]) -> None: ...

    def on_l1_keys_read(self, keys: Sequence[ObjectKey]) -> None: ...

    def on_l1_keys_deleted(self, keys: Sequence[ObjectKey]) -> None: ...


class Eviction(NamedTuple):
    """What one eviction pass took out of L1."""

    keys: list[ObjectKey]  # evicted, in victim order
    unstored: list[ObjectKey]  # of those, objects whose L2 store had not happened yet


class L1Stats(NamedTuple):
    objects: int  # objects in any state
    used_bytes: int  # aligned bytes allocated
    write_locked: int  # objects being written
    read_locks: int  # read locks held, summed over objects
    temporary: int  # objects freed after their last read
