"""ExtentAllocator: alignment, all-or-nothing batches, best fit, coalescing, churn invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmcache_tiers.l1 import ExtentAllocator

A = 4096


def test_offsets_and_extents_are_aligned() -> None:
    allocator = ExtentAllocator(100 * A, A)
    offsets = allocator.allocate_many([1, A, A + 1, 3 * A - 1, 0])
    assert offsets is not None
    assert all(offset % A == 0 for offset in offsets)
    assert [allocator.size_at(offset) for offset in offsets] == [A, A, 2 * A, 3 * A, A]
    assert allocator.allocated_bytes == 8 * A
    assert len(set(offsets)) == 5  # a 0-byte object still gets its own offset


def test_alignment_need_not_be_a_power_of_two() -> None:
    allocator = ExtentAllocator(1000, 96)
    assert allocator.capacity == 960  # the ragged 40-byte tail is never handed out
    offsets = allocator.allocate_many([1, 100, 96])
    assert offsets == [0, 96, 288]
    assert allocator.allocated_bytes == 96 + 192 + 96


@pytest.mark.parametrize(("capacity", "align"), [(A - 1, A), (0, A), (10 * A, 0), (10 * A, -A)])
def test_rejects_unusable_geometry(capacity: int, align: int) -> None:
    with pytest.raises(ValueError):
        ExtentAllocator(capacity, align)


def test_negative_size_is_rejected_before_anything_is_allocated() -> None:
    allocator = ExtentAllocator(10 * A, A)
    with pytest.raises(ValueError, match="negative"):
        allocator.allocate_many([A, -1])
    assert allocator.allocated_bytes == 0


def test_batch_larger_than_free_memory_allocates_nothing() -> None:
    allocator = ExtentAllocator(10 * A, A)
    assert allocator.allocate_many([4 * A, 4 * A, 4 * A]) is None
    assert allocator.allocated_bytes == 0
    assert allocator.free_extents() == [(0, 10 * A)]


def test_batch_that_fails_on_fragmentation_is_rolled_back_exactly() -> None:
    allocator = ExtentAllocator(10 * A, A)
    offsets = allocator.allocate_many([A] * 10)
    assert offsets is not None
    allocator.free_many(offsets[0:2] + offsets[3:5] + offsets[6:9])  # holes of 2, 2 and 3 units
    before = allocator.free_extents()
    assert sum(length for _, length in before) == 7 * A
    # 7 units are free, but no hole takes 4: the 1- and 2-unit parts that did fit are undone.
    assert allocator.allocate_many([A, 2 * A, 4 * A]) is None
    assert allocator.free_extents() == before
    assert allocator.allocated_bytes == 3 * A


def test_best_fit_prefers_the_smallest_hole_then_the_lowest_address() -> None:
    allocator = ExtentAllocator(20 * A, A)
    offsets = allocator.allocate_many([5 * A, A, 2 * A, A, 2 * A, A])
    assert offsets is not None
    allocator.free_many([offsets[0], offsets[2], offsets[4]])  # holes: 5 units, 2, 2; tail 9
    assert allocator.allocate_many([2 * A]) == [offsets[2]]
    assert allocator.allocate_many([2 * A]) == [offsets[4]]
    assert allocator.allocate_many([3 * A]) == [offsets[0]]


def test_freed_neighbours_coalesce_into_one_extent() -> None:
    allocator = ExtentAllocator(6 * A, A)
    first, middle, last = allocator.allocate_many([A, 2 * A, A]) or []
    allocator.free_many([middle])
    assert allocator.free_extents() == [(A, 2 * A), (4 * A, 2 * A)]
    allocator.free_many([first])  # coalesces with the hole after it
    assert allocator.free_extents() == [(0, 3 * A), (4 * A, 2 * A)]
    allocator.free_many([last])  # bridges both holes
    assert allocator.free_extents() == [(0, 6 * A)]
    assert allocator.fragmentation() == 0.0
    assert allocator.allocate_many([6 * A]) == [0]


def test_fragmentation_is_one_minus_largest_over_free() -> None:
    allocator = ExtentAllocator(8 * A, A)
    assert allocator.fragmentation() == 0.0
    offsets = allocator.allocate_many([A] * 8)
    assert offsets is not None
    assert allocator.fragmentation() == 0.0  # nothing free
    allocator.free_many([offsets[0], offsets[2], offsets[3]])
    assert allocator.largest_free_extent() == 2 * A
    assert allocator.free_bytes == 3 * A
    assert allocator.fragmentation() == pytest.approx(1 - 2 / 3)


def test_free_of_unknown_or_repeated_offset_frees_nothing() -> None:
    allocator = ExtentAllocator(8 * A, A)
    offsets = allocator.allocate_many([A, A]) or []
    with pytest.raises(ValueError, match="double free"):
        allocator.free_many([offsets[0], 12345])
    with pytest.raises(ValueError, match="double free"):
        allocator.free_many([offsets[1], offsets[1]])
    assert allocator.allocated_bytes == 2 * A
    allocator.free_many(offsets)
    with pytest.raises(ValueError):
        allocator.free_many([offsets[0]])
    assert allocator.free_extents() == [(0, 8 * A)]


def test_empty_batches_are_no_ops() -> None:
    allocator = ExtentAllocator(8 * A, A)
    assert allocator.allocate_many([]) == []
    allocator.free_many([])
    assert allocator.allocated_bytes == 0


class AllocatorChurn(RuleBasedStateMachine):
    """Random batches of allocations and frees, checked against a model of live extents.

    The invariant: live extents plus free extents tile the capacity exactly, free extents
    are maximal (never adjacent), and the counters agree with both.
    """

    @initialize(units=st.integers(1, 64), align=st.sampled_from([1, 64, 100, 4096]))
    def setup(self, units: int, align: int) -> None:
        self.align = align
        self.allocator = ExtentAllocator(units * align + align // 2, align)
        self.live: dict[int, int] = {}  # offset -> aligned length

    @rule(sizes=st.lists(st.integers(0, 9000), max_size=6))
    def allocate(self, sizes: list[int]) -> None:
        free_before = self.allocator.free_extents()
        largest_before = self.allocator.largest_free_extent()
        offsets = self.allocator.allocate_many(sizes)
        needs = [max(1, -(-size // self.align)) * self.align for size in sizes]
        if offsets is None:
            assert self.allocator.free_extents() == free_before
            # Best fit never refuses a batch that the largest hole alone could hold.
            assert sum(needs) > largest_before
            return
        for offset, need in zip(offsets, needs, strict=True):
            assert offset % self.align == 0
            assert offset not in self.live
            self.live[offset] = need

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.live)), unique=True, min_size=1))
        self.allocator.free_many(chosen)
        for offset in chosen:
            del self.live[offset]

    @invariant()
    def extents_tile_the_capacity(self) -> None:
        free = self.allocator.free_extents()
        extents = sorted(
            [(offset, length, "used") for offset, length in self.live.items()]
            + [(offset, length, "free") for offset, length in free]
        )
        position = 0
        previous_kind = ""
        for offset, length, kind in extents:
            assert offset == position, "gap or overlap"
            assert length > 0 and length % self.align == 0
            assert not (kind == previous_kind == "free"), "adjacent free extents were not coalesced"
            position, previous_kind = offset + length, kind
        assert position == self.allocator.capacity
        assert self.allocator.allocated_bytes == sum(self.live.values())
        assert self.allocator.free_bytes == sum(length for _, length in free)
        assert self.allocator.largest_free_extent() == max((length for _, length in free), default=0)
        assert 0.0 <= self.allocator.fragmentation() < 1.0


TestAllocatorChurn = AllocatorChurn.TestCase
TestAllocatorChurn.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_single_fit_is_never_refused_when_a_hole_is_big_enough() -> None:
    allocator = ExtentAllocator(16 * A, A)
    offsets = allocator.allocate_many([A] * 16) or []
    allocator.free_many(offsets[3:7])
    assert allocator.allocate_many([4 * A]) == [offsets[3]]


class BatchesMatchSingles(RuleBasedStateMachine):
    """A batch is placed and freed exactly as its extents one by one would be: the same
    offsets and the same free list (runs of equal sizes are carved in one step, and
    extents freed side by side coalesce in one step)."""

    @initialize(units=st.integers(1, 96), align=st.sampled_from([1, 64, 4096]))
    def setup(self, units: int, align: int) -> None:
        self.batched = ExtentAllocator(units * align, align)
        self.single = ExtentAllocator(units * align, align)
        self.live: list[int] = []

    @rule(
        sizes=st.lists(
            st.one_of(st.sampled_from([1, 2, 3]).map(lambda units: units * 4096), st.integers(0, 9000)),
            max_size=12,
        ),
        repeat=st.integers(1, 8),
    )
    def allocate(self, sizes: list[int], repeat: int) -> None:
        sizes = [size for size in sizes for _ in range(repeat)]  # runs of equal sizes
        got = self.batched.allocate_many(sizes)
        expected: list[int] | None = []
        for size in sizes:
            one = self.single.allocate_many([size])
            if one is None:
                for done in reversed(expected or []):
                    self.single.free_many([done])
                expected = None
                break
            assert expected is not None
            expected.extend(one)
        assert got == expected
        self.live.extend(got or [])

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.live), unique=True, min_size=1))
        self.batched.free_many(chosen)
        for offset in chosen:
            self.single.free_many([offset])
            self.live.remove(offset)

    @invariant()
    def same_state(self) -> None:
        assert self.batched.free_extents() == self.single.free_extents()
        assert self.batched._lengths == self.single._lengths
        assert self.batched._used == self.single._used
        assert self.batched.allocated_bytes == self.single.allocated_bytes


TestBatchesMatchSingles = BatchesMatchSingles.TestCase
TestBatchesMatchSingles.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_run_of_equal_sizes_is_carved_from_the_best_fit_then_the_next() -> None:
    allocator = ExtentAllocator(32 * A, A)
    offsets = allocator.allocate_many([A] * 32) or []
    # holes of 3, 5 and 2 units
    allocator.free_many(offsets[1:4] + offsets[10:15] + offsets[20:22])
    # best fit for 1 unit: the 2-unit hole, then the 3-unit one, then the 5-unit one
    assert allocator.allocate_many([A] * 6) == [
        offsets[20],
        offsets[21],
        offsets[1],
        offsets[2],
        offsets[3],
        offsets[10],
    ]
    assert allocator.free_extents() == [(offsets[11], 4 * A)]


def test_freeing_side_by_side_extents_with_one_unknown_frees_nothing() -> None:
    allocator = ExtentAllocator(8 * A, A)
    offsets = allocator.allocate_many([A] * 4) or []
    with pytest.raises(ValueError):
        allocator.free_many([*offsets[:3], 5 * A])
    assert allocator.allocated_bytes == 4 * A
    allocator.free_many(offsets[:3])
    assert allocator.free_extents() == [(0, 3 * A), (4 * A, 4 * A)]


def test_no_list_the_allocator_keeps_grows_with_the_number_of_free_extents() -> None:
    # A million tiny objects freed in random order leave a few hundred thousand free
    # extents of one length.  An index kept as one sorted list of extents is shifted on
    # every free and every allocation (~0.1-0.2 ms each at that size, under the L1 lock);
    # what the allocator keeps in lists must grow with the distinct free lengths only.
    count = 20_000
    allocator = ExtentAllocator(count * A, A)
    offsets = allocator.allocate_many([A] * count)
    assert offsets is not None
    allocator.free_many(offsets[::2])  # every other extent: 10k free extents of one unit
    assert allocator.free_extent_count == count // 2
    longest = max(len(value) for value in vars(allocator).values() if isinstance(value, list))
    assert longest <= 64, f"a list of {longest} entries for {allocator.free_extent_count} free extents"
    # The best fit is still the lowest address among the equal holes, and coalescing works.
    taken = allocator.allocate_many([A])
    assert taken == [0]
    allocator.free_many([offsets[1]])
    assert allocator.free_extents()[0] == (A * 1, 2 * A)


def test_index_entries_left_stale_by_coalescing_are_dropped_as_they_outnumber_the_live() -> None:
    # Every other unit free: 1,000 one-unit holes.  Freeing the objects between them
    # merges the holes away, leaving each one's index entry stale.  If the stale entries
    # were dropped only when another one-unit hole is freed, the one hole left would sit
    # behind ~1,000 dead entries, and the next allocation of that length would wade
    # through all of them under the L1 lock (0.1 s at a few hundred thousand).
    count = 2_000
    allocator = ExtentAllocator(count * A, A)
    offsets = allocator.allocate_many([A] * count)
    assert offsets is not None
    allocator.free_many(offsets[::2])
    between = offsets[1::2][:-2]  # the last two objects stay, and the one-unit hole between them
    random.Random(7).shuffle(between)
    for offset in between:
        allocator.free_many([offset])
    holes = [extent for extent in allocator.free_extents() if extent[1] == A]
    assert holes == [(offsets[-2], A)]
    assert len(allocator._offsets_of[1]) <= 2 * len(holes) + 16
    assert allocator.allocate_many([A]) == [offsets[-2]]


class BestFitModel:
    """Reference placement: free extents in a dict, best fit by a scan over all of them."""

    def __init__(self, units: int) -> None:
        self.free = {0: units}
        self.used: dict[int, int] = {}

    def allocate_many(self, needs: list[int]) -> list[int] | None:
        free_before, used_before, offsets = dict(self.free), dict(self.used), []
        for need in needs:
            fits = [(length, offset) for offset, length in self.free.items() if length >= need]
            if not fits:
                self.free, self.used = free_before, used_before
                return None
            length, offset = min(fits)
            del self.free[offset]
            if length > need:
                self.free[offset + need] = length - need
            self.used[offset] = need
            offsets.append(offset)
        return offsets

    def free_one(self, offset: int) -> None:
        length = self.used.pop(offset)
        before = next((start for start, size in self.free.items() if start + size == offset), None)
        if before is not None:
            length += self.free.pop(before)
            offset = before
        length += self.free.pop(offset + length, 0)
        self.free[offset] = length


@pytest.mark.parametrize("sizes", [(1,), (1, 2, 3), (1, 2, 5, 8, 13)])
def test_placement_matches_a_scan_for_the_best_fit_through_long_churn(sizes: tuple[int, ...]) -> None:
    # Many equal lengths, holes merged away and freed again at the same offset and
    # length (stale index entries that look live again), a full arena: every placement
    # must be the smallest fitting extent at the lowest address, as a plain scan finds.
    rng = random.Random(len(sizes))
    allocator, model, live = ExtentAllocator(300, 1), BestFitModel(300), []
    for _ in range(1_500):
        if live and rng.random() < 0.5:
            start = rng.randrange(len(live))
            chosen = live[start : start + rng.randint(1, 4)] if rng.random() < 0.3 else rng.sample(live, 1)
            live = [offset for offset in live if offset not in chosen]
            allocator.free_many(chosen)
            for offset in chosen:
                model.free_one(offset)
        else:
            needs = [rng.choice(sizes) for _ in range(rng.randint(1, 8))]
            offsets = allocator.allocate_many(needs)
            assert offsets == model.allocate_many(needs)
            live += offsets or []
        assert allocator.free_extents() == sorted(model.free.items())
        assert allocator._used == model.used
