"""Access to object bytes: views into the arena, copies in and out of either backing, and
loans (``l1/loan.py``).

The checks run under the L1 lock; the copies do not.  The caller holds a lock on the
object (a read lock, or the write lock it is filling under), so its extent cannot change
hands during the copy -- a forced delete meanwhile quarantines the extent -- and a slow
NVMe transfer never stalls other callers.
"""

from __future__ import annotations

import threading

from lmcache_tiers.errors import TiersError
from lmcache_tiers.l1.arena import L1Arena
from lmcache_tiers.l1.backing import L1Backing
from lmcache_tiers.l1.leases import ExtentLeases
from lmcache_tiers.l1.loan import L1Loan
from lmcache_tiers.l1.nvme import aligned_buffer
from lmcache_tiers.l1.objects import L1Object, ObjectState
from lmcache_tiers.l1.table import ObjectTable

_WRITING = ObjectState.WRITING


class ObjectBytes:
    """Views, copies and loans of object bytes; ``arena`` is None for an NVMe backing."""

    def __init__(
        self,
        lock: threading.RLock,
        table: ObjectTable,
        leases: ExtentLeases,
        backing: L1Backing,
        arena: L1Arena | None,
        backing_path: str | None,
    ) -> None:
        self._lock = lock
        self._table = table
        self._leases = leases
        self._backing = backing
        self._arena = arena
        self._backing_path = backing_path

    def view(self, obj: L1Object) -> memoryview:
        with self._lock:
            self._table.check_present(obj)
            if self._arena is None:
                raise TiersError(
                    f"L1 objects in the NVMe file {self._backing_path} have no memory view: "
                    "copy them with read_object/write_object"
                )
            return self._arena.buffer[obj.offset : obj.offset + obj.size]

    def read_object(self, obj: L1Object, out: memoryview) -> None:
        out = byte_view(out)
        if out.nbytes < obj.size:
            raise ValueError(f"a {out.nbytes}-byte buffer cannot hold {obj.key} ({obj.size} bytes)")
        with self._lock:
            if not self._leases.holds(obj):
                self._table.check_present(obj)
        self._backing.read_into(obj.offset, obj.size, out)
        self._check_kept(obj)

    def write_object(self, obj: L1Object, data: memoryview) -> None:
        data = byte_view(data)
        if data.nbytes != obj.size:
            raise ValueError(f"{obj.key} holds {obj.size} bytes, got {data.nbytes}")
        with self._lock:
            self._check_writing(obj)
        self._backing.write_from(obj.offset, data)

    def lend(self, obj: L1Object, *, fill: bool) -> L1Loan:
        with self._lock:
            if fill:
                self._check_writing(obj)
            elif not self._leases.holds(obj):
                # Deleted by force under its lock holder (an L2 store about to copy it out):
                # its extent is held for the holder, its bytes are still the object's.
                self._table.check_present(obj)
        if self._arena is not None:
            extent = self._arena.buffer[obj.offset : obj.offset + obj.size]
            if fill:
                return L1Loan(extent, staged=False)
            return L1Loan(extent.toreadonly(), staged=False, verify=lambda: self._check_kept(obj))
        staged = aligned_buffer(obj.size)  # page-aligned: O_DIRECT moves it without a bounce
        if fill:
            return L1Loan(staged, staged=True, commit=lambda: self.write_object(obj, staged))
        self._backing.read_into(obj.offset, obj.size, staged)
        self._check_kept(obj)
        return L1Loan(staged, staged=True)

    def _check_kept(self, obj: L1Object) -> None:
        """Raise KeyError unless ``obj``'s extent is still its own after a copy out of it.

        A reader's lock does not always outlast its copy: its lease can end, and after a
        forced delete a release of the key by another reader is credited to the held
        extent (``l1/leases.py``).  An extent goes back to the allocator before anyone
        else can write it, and never comes back to the same object, so an object still
        in L1, or still held for its readers, had its bytes in place during the copy.
        """
        with self._lock:
            if self._leases.holds(obj) or self._table.objects.get(obj.key) is obj:
                return
        raise KeyError(f"{obj.key} left L1 while it was being copied out: its extent may hold other bytes")

    def _check_writing(self, obj: L1Object) -> None:
        self._table.check_present(obj)
        if obj.state is not _WRITING:
            raise ValueError(f"{obj.key} is {obj.state.value}, not being written")


def byte_view(buffer: memoryview) -> memoryview:
    """``buffer`` as a flat view of unsigned bytes, the only shape slice assignment mixes."""
    view = memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")
