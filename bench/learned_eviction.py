"""Eviction designs that learn from the past what Belady would have done: studied, not shipped.

``bench/eviction_experiments.py`` measures them against ``PREFIX_LFU`` (docs/replay.md,
"A second round").  Each is an ``EvictionPolicy`` the simulator drives like an installed
one.  None beat ``PREFIX_LFU`` on the shared trace, so none is a plugin; they are kept so
the figures can be checked and the ideas tried on other traces.

* ``KeepTimePolicy``: per class of chunk, how long to keep it after a use, solved over the
  recent past so the cache's room catches the most reuses; earliest expiry evicted first.
* ``OptGenPolicy``: Belady replayed on the recent past (OPTgen occupancy vector) labels
  each reuse interval kept or not; a per-class kept share decides extra life (Hawkeye
  style), optionally on top of ``PREFIX_LFU``'s rank.
* ``HitDensityPolicy``: hits a chunk's class can still expect at its age per unit of room
  (LHD), lowest of a random sample evicted first, leaves of the prefix tree first.

Time is counted in chunks touched.  A chunk's class is its use count (capped), the log2
bucket of its last reuse gap and, optionally, the log2 bucket of the length of the request
that first stored it.  All three share the server's conventions: batches in prefix order
handled back to front, a read repeating the previous read (RETRIEVE after LOOKUP) counted
once, a write right after a read taken as the same request.
"""

from __future__ import annotations

import bisect
import math
import random
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from lmcache_tiers.keys import ObjectKey

Class = tuple[int, int, int]
#: gap bins of half a power of two: bin b holds gaps g with 2**(b/2) <= g + 1 < 2**((b+1)/2)
BINS = 64
_BIN_FLOOR = [2 ** (index / 2) - 1 for index in range(BINS)]
_FAR = 1 << 62


def gap_bin(gap: int) -> int:
    return min(BINS - 1, int(2 * math.log2(gap + 1)))


def log2_bucket(value: int) -> int:
    return int(math.log2(value + 1))


def chunk_class(
    uses: int, gap: int | None, length: int, *, use_cap: int, use_gap: bool, use_length: bool
) -> Class:
    gap_class = 0 if gap is None or not use_gap else 1 + min(31, log2_bucket(gap))
    return (min(uses, use_cap), gap_class, log2_bucket(length) if use_length else 0)


class Buckets:
    """Keys by integer rank, equal ranks in insertion order; walked lowest rank first."""

    def __init__(self) -> None:
        self.buckets: dict[int, dict[ObjectKey, None]] = {}
        self.levels: list[int] = []

    def add(self, key: ObjectKey, rank: int) -> None:
        bucket = self.buckets.get(rank)
        if bucket is None:
            bucket = self.buckets[rank] = {}
            bisect.insort(self.levels, rank)
        bucket[key] = None

    def discard(self, key: ObjectKey, rank: int) -> None:
        bucket = self.buckets[rank]
        del bucket[key]
        if not bucket:
            del self.buckets[rank]
            del self.levels[bisect.bisect_left(self.levels, rank)]

    def __iter__(self) -> Iterator[ObjectKey]:
        for rank in self.levels:
            yield from self.buckets[rank]


class GapHistogram:
    """Decayed counts of the reuse intervals that began in one class."""

    def __init__(self) -> None:
        self.started = 0.0
        self.closed = [0.0] * BINS
        self.gap_sum = [0.0] * BINS

    def close(self, gap: int) -> None:
        index = gap_bin(gap)
        self.closed[index] += 1
        self.gap_sum[index] += gap

    def halve(self) -> None:
        self.started *= 0.5
        self.closed = [value * 0.5 for value in self.closed]
        self.gap_sum = [value * 0.5 for value in self.gap_sum]


class _RequestTracker:
    """The duplicate-read rule and the length of the request being stored."""

    def __init__(self) -> None:
        self.last_read: tuple[int, ObjectKey, ObjectKey] | None = None
        self.request_length = 0
        self.read_tail: ObjectKey | None = None

    def is_repeat(self, keys: Sequence[ObjectKey]) -> bool:
        signature = (len(keys), keys[0], keys[-1])
        if signature == self.last_read:
            return True
        self.last_read = signature
        return False

    def write(self, keys: Sequence[ObjectKey]) -> bool:
        """Note a write; True when it extends the prefix just read."""
        extends = self.last_read is not None
        self.request_length = len(keys) + (self.last_read[0] if self.last_read is not None else 0)
        self.read_tail = self.last_read[2] if self.last_read is not None else None
        self.last_read = None
        return extends


class _History:
    """What the policy knew of evicted chunks, by hash(key), the last evicted kept."""

    def __init__(self, factor: int = 16, minimum: int = 65536) -> None:
        self.entries: OrderedDict[int, tuple[Any, ...]] = OrderedDict()
        self.factor = factor
        self.minimum = minimum

    def pop(self, key: ObjectKey) -> tuple[Any, ...] | None:
        return self.entries.pop(hash(key), None) if self.entries else None

    def keep(self, key: ObjectKey, record: tuple[Any, ...], live: int) -> None:
        self.entries[hash(key)] = record
        limit = max(self.minimum, self.factor * live)
        while len(self.entries) > limit:
            self.entries.popitem(last=False)


class _Chunk:
    __slots__ = ("cls", "last", "length", "rank", "uses")

    def __init__(self, uses: int, last: int, cls: Class | None, length: int) -> None:
        self.uses, self.last, self.cls, self.length = uses, last, cls, length
        self.rank = 0


class KeepTimePolicy:
    """Each chunk kept ``t_c`` ticks after a use, ``t_c`` solved per class; earliest expiry first."""

    def __init__(
        self,
        *,
        use_cap: int = 8,
        tree_classes: bool = False,
        budget: float = 1.0,
        refresh_min: int = 1024,
        half_life_min: int = 65536,
        half_life_turnovers: float = 32.0,
    ) -> None:
        self.use_cap, self.tree_classes, self.budget = use_cap, tree_classes, budget
        self.refresh_min, self.half_life_min, self.half_life_turnovers = (
            refresh_min,
            half_life_min,
            half_life_turnovers,
        )
        self.tick = 0
        self.window = 0.0  # decayed ticks the histograms cover
        self.chunks: dict[ObjectKey, _Chunk] = {}
        self.stats: dict[Class, GapHistogram] = {}
        self.keep: dict[Class, int] = {}
        self.order = Buckets()
        self.history = _History()
        self.trees: OrderedDict[int, tuple[int, int]] = OrderedDict()  # hash(head) -> (visits, last)
        self.tree_class: Class = (1, 0, 0)
        self.request = _RequestTracker()
        self.next_solve = self.next_halving = 0

    def _visit_tree(self, head: ObjectKey) -> None:
        visits, last = self.trees.pop(hash(head), (0, -1))
        gap = None if last < 0 else self.tick - last
        self.tree_class = chunk_class(
            visits + 1, gap, 0, use_cap=self.use_cap, use_gap=True, use_length=False
        )
        self.trees[hash(head)] = (visits + 1, self.tick)
        while len(self.trees) > max(65536, 16 * len(self.chunks)):
            self.trees.popitem(last=False)

    def _curve(self, stats: GapHistogram) -> list[tuple[float, float, int]]:
        """(hits, room, keep time) per keep-time candidate: keeping 2**(k/2) - 1 catches bins < k."""
        points = []
        hits = room = 0.0
        for index in range(BINS + 1):
            keep = int(2 ** (index / 2)) - 1
            if index == 0 or stats.closed[index - 1] > 0:
                points.append((hits, room + keep * max(0.0, stats.started - hits), keep))
            if index < BINS:
                hits += stats.closed[index]
                room += stats.gap_sum[index]
        return points

    def _solve(self) -> None:
        curves = {cls: self._curve(stats) for cls, stats in self.stats.items()}
        budget = self.budget * len(self.chunks) * self.window
        low, high = 1e-12, 1.0
        best = {cls: point[2] for cls, point in self._choose(curves, high).items()}
        for _ in range(40):  # bisection on the price of a tick of room
            price = math.sqrt(low * high)
            chosen = self._choose(curves, price)
            if sum(point[1] for point in chosen.values()) <= budget:
                best, high = {cls: point[2] for cls, point in chosen.items()}, price
            else:
                low = price
        self.keep = best

    @staticmethod
    def _choose(
        curves: dict[Class, list[tuple[float, float, int]]], price: float
    ) -> dict[Class, tuple[float, float, int]]:
        return {cls: max(points, key=lambda p: p[0] - price * p[1]) for cls, points in curves.items()}

    def _touch(self, keys: Sequence[ObjectKey], known_only: bool) -> None:
        now, floor, touched = self.tick, -_FAR, 0
        for key in reversed(keys):
            chunk = self.chunks.get(key)
            if chunk is None:
                if known_only:
                    continue
                past = self.history.pop(key)
                chunk = _Chunk(0, -1, None, 0) if past is None else _Chunk(*past)
                self.chunks[key] = chunk
            else:
                self.order.discard(key, chunk.rank)
            touched += 1
            gap = None if chunk.last < 0 else now - chunk.last
            if gap is not None and chunk.cls in self.stats:
                self.stats[chunk.cls].close(gap)
            chunk.uses += 1
            chunk.last = now
            if self.tree_classes:
                chunk.cls = self.tree_class
            else:
                chunk.cls = chunk_class(
                    chunk.uses, gap, 0, use_cap=self.use_cap, use_gap=True, use_length=False
                )
            self.stats.setdefault(chunk.cls, GapHistogram()).started += 1
            # never earlier than before (its tails were ranked against it), nor than its tail
            rank = max(now + self.keep.get(chunk.cls, 0), chunk.rank, floor)
            chunk.rank = floor = rank
            self.order.add(key, rank)
        self.tick = now + touched
        self.window += touched
        if self.tick >= self.next_halving:
            if self.next_halving:
                for stats in self.stats.values():
                    stats.halve()
                self.window *= 0.5
            self.next_halving = self.tick + max(
                self.half_life_min, int(self.half_life_turnovers * len(self.chunks))
            )
        if self.tick >= self.next_solve:
            self.next_solve = self.tick + max(self.refresh_min, len(self.chunks))
            if self.window > 0:
                self._solve()

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        if keys:
            if self.request.last_read is None:
                self._visit_tree(keys[0])
            self.request.write(keys)
            self._touch(keys, False)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        if keys and not self.request.is_repeat(keys):
            self._visit_tree(keys[0])
            self._touch(keys, True)

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            chunk = self.chunks.pop(key, None)
            if chunk is not None:
                self.order.discard(key, chunk.rank)
                self.history.keep(key, (chunk.uses, chunk.last, chunk.cls, chunk.length), len(self.chunks))

    def victims(self) -> Iterator[ObjectKey]:
        return iter(self.order)


class OptGenPolicy:
    """Chunks of classes OPT mostly kept live ``horizon`` turnovers longer.

    OPTgen: time advances one step per batch; ``occupancy[step]`` counts the chunks OPT
    with the cache's capacity holds during it.  When a chunk is used again, the interval
    since its last use is one OPT keeps if the occupancy stays below capacity over it (the
    interval is then added to the occupancy); intervals of chunks not used again within
    ``window`` turnovers count as not kept.  Per class the decayed kept share is learned;
    ``threshold`` and above is "friendly".  With ``credit`` / ``penalty`` the rank also
    carries ``PREFIX_LFU``'s frequency credit and tail penalty (0 / 0: plain recency).
    """

    RING = 1 << 14

    def __init__(
        self,
        *,
        horizon: float = 8.0,
        threshold: float = 0.5,
        window: float = 8.0,
        credit: float = 0.0,
        penalty: float = 0.0,
        use_cap: int = 8,
        use_length: bool = False,
        decay_every: int = 4096,
    ) -> None:
        self.horizon, self.threshold, self.window = horizon, threshold, window
        self.credit, self.penalty, self.use_cap, self.use_length = credit, penalty, use_cap, use_length
        self.decay_every = decay_every
        self.tick = self.step = 0
        self.capacity = 1
        self.occupancy = np.zeros(self.RING, dtype=np.int32)
        # key -> [rank, uses, last tick, last step, class, request length]
        self.chunks: dict[ObjectKey, list[Any]] = {}
        self.order = Buckets()
        self.history = _History()
        self.kept: dict[Class, float] = {}
        self.seen: dict[Class, float] = {}
        self.trained = 0
        self.open: deque[tuple[int, int, dict[Class, int]]] = deque()  # (tick, step, uses not yet closed)
        self.open_by_step: dict[int, dict[Class, int]] = {}
        self.request = _RequestTracker()

    def friendly(self, cls: Class) -> bool:
        seen = self.seen.get(cls, 0.0)
        return seen <= 0 or self.kept[cls] / seen >= self.threshold

    def _count(self, cls: Class, kept: float, seen: float) -> None:
        self.kept[cls] = self.kept.get(cls, 0.0) + kept
        self.seen[cls] = self.seen.get(cls, 0.0) + seen
        self.trained += int(seen)

    def _train(self, cls: Class, count: int, start: int) -> None:
        still_open = self.open_by_step.get(start)
        if still_open is None:
            return  # aged out of the window: already counted as not kept
        still_open[cls] -= count
        now, kept = self.step, 0
        if start < now < start + self.RING - 1:
            first, end = start % self.RING, now % self.RING
            spans = [(first, end)] if first < end else [(first, self.RING), (0, end)]
            peak = max(int(self.occupancy[a:b].max()) for a, b in spans if b > a)
            kept = min(count, max(0, self.capacity - peak))
            if kept:
                for a, b in spans:
                    self.occupancy[a:b] += kept
        self._count(cls, kept, count)
        if self.trained >= self.decay_every:
            self.trained = 0
            for each in self.seen:
                self.seen[each] *= 0.5
                self.kept[each] *= 0.5

    def _touch(self, keys: Sequence[ObjectKey], known_only: bool, tail_from: int) -> None:
        chunks, now = self.chunks, self.tick
        live = max(1, len(chunks))
        self.capacity = max(self.capacity, live)
        bonus = int(self.horizon * live)
        closing: dict[tuple[int, Class], int] = {}
        floor, touched = -_FAR, 0
        for position in range(len(keys) - 1, -1, -1):
            key = keys[position]
            chunk = chunks.get(key)
            if chunk is None:
                if known_only:
                    continue
                past = self.history.pop(key)
                chunk = [0, 0, -1, -1, None, self.request.request_length] if past is None else [0, *past]
                chunks[key] = chunk
            else:
                self.order.discard(key, chunk[0])
            touched += 1
            gap = None
            if chunk[2] >= 0:
                gap = now - chunk[2]
                closing[(chunk[3], chunk[4])] = closing.get((chunk[3], chunk[4]), 0) + 1
            chunk[1] += 1
            chunk[2], chunk[3] = now, self.step
            cls = chunk[4] = chunk_class(
                chunk[1], gap, chunk[5], use_cap=self.use_cap, use_gap=True, use_length=self.use_length
            )
            rank = now + (bonus if self.friendly(cls) else 0) + int(self.credit * live * math.log2(chunk[1]))
            if position >= tail_from:
                rank -= int(self.penalty * live)
            rank = max(rank, floor)
            chunk[0] = floor = rank
            self.order.add(key, rank)
        for (start, cls), count in closing.items():
            self._train(cls, count, start)
        self.tick = now + touched
        if touched:
            opened: dict[Class, int] = {}
            for key in keys:
                chunk = chunks.get(key)
                if chunk is not None and chunk[3] == self.step:
                    opened[chunk[4]] = opened.get(chunk[4], 0) + 1
            self.open.append((now, self.step, opened))
            self.open_by_step[self.step] = opened
            while self.open and self.tick - self.open[0][0] > self.window * self.capacity:
                _, step, expired = self.open.popleft()
                del self.open_by_step[step]
                for cls, count in expired.items():
                    if count > 0:
                        self._count(cls, 0.0, count)
            self.step += 1
            self.occupancy[self.step % self.RING] = 0

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        if keys:
            extends = self.request.write(keys)
            self._touch(keys, False, 0 if extends else len(keys) - 1)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        if keys and not self.request.is_repeat(keys):
            self._touch(keys, True, len(keys))

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        for key in keys:
            chunk = self.chunks.pop(key, None)
            if chunk is not None:
                self.order.discard(key, chunk[0])
                self.history.keep(key, tuple(chunk[1:]), len(self.chunks))

    def victims(self) -> Iterator[ObjectKey]:
        return iter(self.order)


class HitDensityPolicy:
    """Lowest expected hits per unit of room at the chunk's age first (LHD), leaves first.

    Per class, decayed histograms of reuse gaps (intervals not closed counting as never
    reused, held up to ``tmax``) give ``density(age) = hits still to come / room still to
    spend``; victims are the lowest of ``sample`` random live chunks, chunks with a live
    child in the prefix tree only after every leaf of the sample.
    """

    def __init__(
        self,
        *,
        use_cap: int = 8,
        use_gap: bool = False,
        use_length: bool = False,
        sample: int = 32,
        refresh_min: int = 4096,
        half_life: int = 65536,
        tmax_turnovers: float = 16.0,
        seed: int = 1,
    ) -> None:
        self.use_cap, self.use_gap, self.use_length = use_cap, use_gap, use_length
        self.sample, self.refresh_min, self.half_life, self.tmax_turnovers = (
            sample,
            refresh_min,
            half_life,
            tmax_turnovers,
        )
        self.rng = random.Random(seed)
        self.tick = 0
        # key -> [uses, last, class, request length, parent, live children, index in self.keys]
        self.chunks: dict[ObjectKey, list[Any]] = {}
        self.keys: list[ObjectKey] = []
        self.history = _History()
        self.stats: dict[Class, GapHistogram] = {}
        self.density: dict[Class, list[float]] = {}
        self.next_refresh, self.next_halving = 0, half_life
        self.request = _RequestTracker()

    def _refresh(self) -> None:
        tmax = max(65536.0, self.tmax_turnovers * max(1, len(self.chunks)))
        for cls, stats in self.stats.items():
            never = max(0.0, stats.started - sum(stats.closed))
            table = [0.0] * BINS
            hits = room = 0.0
            for index in range(BINS - 1, -1, -1):
                hits += stats.closed[index]
                room += stats.gap_sum[index]
                age = _BIN_FLOOR[index]
                cost = (room - hits * age) + never * max(1.0, tmax - age)
                table[index] = hits / cost if cost > 0 else 0.0
            self.density[cls] = table

    def _touch(self, keys: Sequence[ObjectKey], known_only: bool) -> None:
        chunks, now, touched = self.chunks, self.tick, 0
        parent: ObjectKey | None = None
        for position, key in enumerate(keys):
            chunk = chunks.get(key)
            if chunk is None:
                if known_only:
                    parent = key
                    continue
                past = self.history.pop(key)
                uses, last, cls, length = (0, -1, None, self.request.request_length) if past is None else past
                chunk = [uses, last, cls, length, None, 0, len(self.keys)]
                chunks[key] = chunk
                self.keys.append(key)
                above = parent if parent is not None else (self.request.read_tail if position == 0 else None)
                if above is not None and above in chunks:
                    chunk[4] = above
                    chunks[above][5] += 1
            touched += 1
            gap = None
            if chunk[1] >= 0:
                gap = now - chunk[1]
                if chunk[2] in self.stats:
                    self.stats[chunk[2]].close(gap)
            chunk[0] += 1
            chunk[1] = now
            chunk[2] = chunk_class(
                chunk[0],
                gap,
                chunk[3],
                use_cap=self.use_cap,
                use_gap=self.use_gap,
                use_length=self.use_length,
            )
            self.stats.setdefault(chunk[2], GapHistogram()).started += 1
            parent = key
        self.tick = now + touched
        if self.tick >= self.next_halving:
            for stats in self.stats.values():
                stats.halve()
            self.next_halving = self.tick + self.half_life
        if self.tick >= self.next_refresh:
            self._refresh()
            self.next_refresh = self.tick + max(self.refresh_min, len(chunks))

    def on_keys_written(self, keys: Sequence[ObjectKey]) -> None:
        if keys:
            self.request.write(keys)
            self._touch(keys, False)

    def on_keys_read(self, keys: Sequence[ObjectKey]) -> None:
        if keys and not self.request.is_repeat(keys):
            self._touch(keys, True)

    def on_keys_removed(self, keys: Sequence[ObjectKey]) -> None:
        chunks = self.chunks
        for key in keys:
            chunk = chunks.pop(key, None)
            if chunk is None:
                continue
            moved = self.keys.pop()
            if moved != key:
                self.keys[chunk[6]] = moved
                chunks[moved][6] = chunk[6]
            if chunk[4] is not None and chunk[4] in chunks:
                chunks[chunk[4]][5] -= 1
            self.history.keep(key, tuple(chunk[:4]), len(chunks))

    def victims(self) -> Iterator[ObjectKey]:
        now, chunks, keys = self.tick, self.chunks, self.keys
        offered: set[ObjectKey] = set()
        gone_children: dict[ObjectKey, int] = {}  # children offered, not yet reported removed
        while len(offered) < len(keys):
            if len(keys) - len(offered) <= self.sample:
                candidates = [key for key in keys if key not in offered]
            else:
                candidates = [keys[self.rng.randrange(len(keys))] for _ in range(self.sample)]
            best, best_score = None, None
            for key in candidates:
                if key in offered:
                    continue
                chunk = chunks[key]
                table = self.density.get(chunk[2])
                density = 0.0 if table is None else table[gap_bin(now - chunk[1])]
                score = (0 if chunk[5] - gone_children.get(key, 0) <= 0 else 1, density)
                if best_score is None or score < best_score:
                    best, best_score = key, score
            if best is None:
                continue
            offered.add(best)
            yield best
            above = chunks[best][4]
            if above is not None:
                gone_children[above] = gone_children.get(above, 0) + 1
