"""Aligned-extent allocator for the L1 arena.

Strategy: address-ordered best fit over a coalescing free list. Best fit (smallest free
extent that is large enough, lowest address among equals) leaves big extents intact for
multi-MiB objects while small objects fill holes. Studies of allocation traces (Johnstone
and Wilson, "The memory fragmentation problem: solved?") found best fit and address-ordered
first fit to fragment least; between the two, best fit is found with one bisect instead of
a scan, and on KV-like size mixes (a few distinct chunk sizes) it keeps the arena fuller
before the first failure than first fit does (``bench/bench_allocator.py --dist models``).

Bookkeeping, all O(1) or O(log n) per operation:

* ``_free_at[offset] = length`` and ``_free_ending[end] = offset``: a freed extent finds
  its neighbours with two dict look-ups, so coalescing is O(1) and the free list always
  holds maximal extents.
* ``_lengths``: the sorted distinct lengths (in units) of the free extents, and per length
  a heap of their offsets (``_offsets_of``); best fit is one ``bisect`` on the lengths and
  the heap's smallest offset.  A list ordered by extent would be shifted (a memmove) on
  every free and allocation: with a million tiny objects freed in random order it holds a
  few hundred thousand free extents, ~0.1-0.2 ms a shift.  Distinct lengths are few (L of
  them need at least L(L+1)/2 free units, so at most ~1,400 in a million-unit arena).  An
  extent leaving its heap by coalescing stays there as a stale entry, told apart by
  ``_free_at`` and dropped when met or when a length's stale entries outnumber its live
  ones (checked as extents of that length come and go).

Not thread-safe: :class:`~lmcache_tiers.l1.manager.L1Manager` serialises every call.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Sequence


class ExtentAllocator:
    """Hands out extents of ``[0, capacity)`` whose offsets and lengths are multiples of ``align``."""

    def __init__(self, capacity: int, align: int = 4096) -> None:
        if align <= 0:
            raise ValueError(f"align must be positive, got {align}")
        units = capacity // align
        if units <= 0:
            raise ValueError(f"capacity {capacity} is smaller than one aligned extent of {align} bytes")
        self.align = align
        self.capacity = units * align  # a ragged tail shorter than `align` is never handed out
        self.allocated_bytes = 0
        self._used: dict[int, int] = {}  # offset -> extent length, for every live extent
        self._free_at: dict[int, int] = {}
        self._free_ending: dict[int, int] = {}
        self._lengths: list[int] = []  # distinct free extent lengths in units, sorted
        self._offsets_of: dict[int, list[int]] = {}  # length units -> heap of offset units
        self._free_of_length: dict[int, int] = {}  # length units -> free extents of it
        self._add_free(0, self.capacity)

    # -- sizes -------------------------------------------------------------------------

    def extent_size(self, size: int) -> int:
        """Bytes an object of ``size`` bytes occupies; a 0-byte object still takes one unit
        so that every live extent has a distinct offset."""
        if size < 0:
            raise ValueError(f"object size must not be negative, got {size}")
        return max(1, -(-size // self.align)) * self.align

    def size_at(self, offset: int) -> int:
        """Length of the live extent starting at ``offset``."""
        try:
            return self._used[offset]
        except KeyError:
            raise ValueError(f"no allocated extent at offset {offset}") from None

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.allocated_bytes

    @property
    def extent_count(self) -> int:
        return len(self._used)

    @property
    def free_extent_count(self) -> int:
        return len(self._free_at)

    def largest_free_extent(self) -> int:
        return self._lengths[-1] * self.align if self._lengths else 0

    def fragmentation(self) -> float:
        """``1 - largest_free_extent / free_bytes``: 0 when free memory is one extent (or none)."""
        free = self.free_bytes
        return 0.0 if free == 0 else 1.0 - self.largest_free_extent() / free

    def free_extents(self) -> list[tuple[int, int]]:
        """``(offset, length)`` of every free extent, by address (diagnostics and tests)."""
        return sorted(self._free_at.items())

    # -- allocation --------------------------------------------------------------------

    def allocate_many(self, sizes: Sequence[int]) -> list[int] | None:
        """Offsets for every size, or None with nothing allocated if the batch does not fit."""
        # Validates before any change.  A batch holds a few distinct sizes (the chunks of a
        # request share one): each is rounded once, not once per object.
        extents = {size: self.extent_size(size) for size in dict.fromkeys(sizes)}
        needs = [extents[size] for size in sizes]
        if sum(needs) > self.free_bytes:
            return None
        offsets: list[int] = []
        position, count = 0, len(needs)
        while position < count:
            # A run of equal sizes (the chunks of one request) is placed run by run.
            need, end = needs[position], position + 1
            while end < count and needs[end] == need:
                end += 1
            if not self._take_run(need, end - position, offsets):
                # Freeing in reverse undoes each split exactly: coalescing restores the
                # same maximal free extents, so a failed batch leaves no trace.
                for done in reversed(offsets):
                    self._release(done)
                return None
            position = end
        return offsets

    def free_many(self, offsets: Sequence[int]) -> None:
        """Free extents; raises ValueError (freeing nothing) on an unknown or repeated offset."""
        used = self._used
        if len(set(offsets)) != len(offsets) or not all(offset in used for offset in offsets):
            seen: set[int] = set()
            for offset in offsets:
                if offset not in used or offset in seen:
                    raise ValueError(f"offset {offset} is not an allocated extent (double free?)")
                seen.add(offset)
        # Extents freed side by side (the chunks of one request, allocated as a run) go back
        # as one extent: one coalescing step per run instead of one per extent.  The free
        # list comes out the same either way: the maximal extents around the live ones.
        ordered = sorted(offsets)
        index, count = 0, len(ordered)
        while index < count:
            start = ordered[index]
            end = start + used.pop(start)
            index += 1
            while index < count and ordered[index] == end:
                end += used.pop(end)
                index += 1
            self.allocated_bytes -= end - start
            self._add_free(start, end - start)

    # -- internals ---------------------------------------------------------------------

    def _take_run(self, need: int, wanted: int, offsets: list[int]) -> bool:
        """Place ``wanted`` extents of ``need`` bytes each, appending their offsets; False
        when one does not fit (those placed stay placed: the caller rolls back).

        Exactly what ``wanted`` best-fit placements one after the other give, without
        their bookkeeping: the best fit E (the smallest free extent that fits) gives its
        head, and its tail is then smaller than every other extent that fits (they are no
        smaller than E), so it is the next best fit while it still fits -- the extents
        of a run are consecutive pieces of E, then of the next best fit.  (First fit, the
        baseline of ``bench/bench_allocator.py``, has the same property: no extent below
        E fits.)"""
        used = self._used
        while wanted:
            fit = self._fit(need)
            if fit is None:
                return False
            offset, length = fit
            del self._free_at[offset]
            del self._free_ending[offset + length]
            pieces = min(wanted, length // need)
            taken = pieces * need
            placed = range(offset, offset + taken, need)
            offsets.extend(placed)
            used.update(dict.fromkeys(placed, need))
            self.allocated_bytes += taken
            if length > taken:
                # Only the tail goes back; it cannot touch another free extent (free
                # extents are maximal), so no coalescing is needed.
                self._insert_free(offset + taken, length - taken)
            wanted -= pieces
        return True

    def _fit(self, need: int) -> tuple[int, int] | None:
        """(offset, length) of the best fit for ``need`` bytes, taken out of the index."""
        align, lengths = self.align, self._lengths
        index = bisect_left(lengths, need // align)
        if index == len(lengths):
            return None
        units = lengths[index]
        offsets, length = self._offsets_of[units], units * align
        while True:
            offset = heapq.heappop(offsets) * align
            if self._free_at.get(offset) == length:
                break  # else a stale entry: the extent coalesced away (or was taken)
        self._remove_sized(offset, length)
        return offset, length

    def _release(self, offset: int) -> None:
        length = self._used.pop(offset)
        self.allocated_bytes -= length
        self._add_free(offset, length)

    def _add_free(self, offset: int, length: int) -> None:
        before = self._free_ending.pop(offset, None)
        if before is not None:
            before_length = self._free_at.pop(before)
            self._remove_sized(before, before_length)
            offset, length = before, length + before_length
        end = offset + length
        after_length = self._free_at.pop(end, None)
        if after_length is not None:
            del self._free_ending[end + after_length]
            self._remove_sized(end, after_length)
            length += after_length
        self._insert_free(offset, length)

    def _insert_free(self, offset: int, length: int) -> None:
        self._free_at[offset] = length
        self._free_ending[offset + length] = offset
        units = length // self.align
        count = self._free_of_length.get(units, 0)
        if count == 0:
            insort(self._lengths, units)
            self._offsets_of[units] = []
        self._free_of_length[units] = count + 1
        offsets = self._offsets_of[units]
        heapq.heappush(offsets, offset // self.align)
        if len(offsets) > 2 * (count + 1) + 16:
            self._drop_stale(units)

    def _remove_sized(self, offset: int, length: int) -> None:
        """The extent leaves the index: its heap entry is left stale (the caller takes it
        out of ``_free_at``, or did already)."""
        units = length // self.align
        count = self._free_of_length[units] - 1
        if count:
            self._free_of_length[units] = count
            # Checked here too, not only when an extent of this length is freed: holes
            # merging away leave stale entries with no free of their length to follow,
            # and the next best fit of that length would pop through all of them.
            if len(self._offsets_of[units]) > 2 * count + 16:
                self._drop_stale(units)
            return
        del self._free_of_length[units], self._offsets_of[units]
        del self._lengths[bisect_left(self._lengths, units)]

    def _drop_stale(self, units: int) -> None:
        """Rebuild the heap of one length from its live extents.  Its callers (inline: the
        hot path) call it once the heap holds more than twice its live extents plus a little slack: a
        rebuild of n entries then drops at least n/2, so it costs O(1) per stale entry, and
        a heap never holds much more than twice its extents."""
        align, length, free_at = self.align, units * self.align, self._free_at
        # A set: an extent merged away and freed again at the same offset and length has
        # two entries, both matching ``_free_at``.
        live = {entry for entry in self._offsets_of[units] if free_at.get(entry * align) == length}
        offsets = list(live)
        heapq.heapify(offsets)
        self._offsets_of[units] = offsets

    def __repr__(self) -> str:
        return (
            f"ExtentAllocator(capacity={self.capacity}, align={self.align}, "
            f"allocated={self.allocated_bytes}, free_extents={len(self._free_at)})"
        )
