"""The optimal offline hit rate (Belady) and the infinite-cache hit rate, under prefix
semantics: a block is a hit only if every earlier block of its request is a hit too.

Why classic Belady is the optimum here.  Flatten the trace into one sequence of block
references.  Any replay of it -- any policy, any eviction timing, stores refused or not --
is a schedule of a C-block cache over that sequence, and its prefix hits are at most the
blocks it holds when referenced.  Belady with bypass (on a miss, drop whichever of the
cached blocks and the new one is referenced furthest in the future) maximises exactly that
count over all schedules, so it bounds every policy.  It also achieves the bound under
prefix semantics: in a trace where each block id has one parent, a block is never
referenced later than its parent's next reference, so with ties (blocks never referenced
again) broken deepest first Belady never holds a block without its parent, and every block
it holds when referenced is part of a held prefix.  ``chain_conflicts`` finds traces where
that premise fails; Belady's figure is then still an upper bound.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from lmcache_tiers.replay.trace import Trace

_NEVER = 1 << 62


@dataclass(frozen=True)
class BoundResult:
    """Per-request prefix hits of an offline bound, plus totals."""

    hit_blocks: int
    hits_per_request: tuple[int, ...]
    #: blocks held when referenced (>= hit_blocks; equal when the trace is a prefix forest)
    held_blocks: int


def infinite(trace: Trace) -> BoundResult:
    """An unbounded cache: every block seen before is still there."""
    seen: set[int] = set()
    per_request: list[int] = []
    held = 0
    for request in trace.requests:
        hits = 0
        for block in request.hash_ids:
            if block not in seen:
                break
            hits += 1
        held += sum(1 for block in request.hash_ids if block in seen)
        seen.update(request.hash_ids)
        per_request.append(hits)
    return BoundResult(sum(per_request), tuple(per_request), held)


def _next_uses(requests: Sequence[tuple[int, ...]]) -> list[int]:
    """For each flattened reference, the position of the next reference to its block."""
    flat = [block for blocks in requests for block in blocks]
    following = [_NEVER] * len(flat)
    last: dict[int, int] = {}
    for position in range(len(flat) - 1, -1, -1):
        block = flat[position]
        following[position] = last.get(block, _NEVER)
        last[block] = position
    return following


def belady(trace: Trace, capacity: int) -> BoundResult:
    """Belady's MIN with bypass over the flattened trace, counted with prefix semantics."""
    if capacity < 1:
        raise ValueError("capacity must be at least one block")
    requests = [request.hash_ids for request in trace.requests]
    following = _next_uses(requests)
    # cached block -> its next use; the heap holds (-next use, -depth, block), stale
    # entries are skipped when they surface (their next use no longer matches).
    cached: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    push, pop = heapq.heappush, heapq.heappop
    position = 0
    per_request: list[int] = []
    held = 0
    for blocks in requests:
        prefix = 0
        in_prefix = True
        for depth, block in enumerate(blocks):
            upcoming = following[position]
            position += 1
            if block in cached:
                held += 1
                if in_prefix:
                    prefix += 1
                cached[block] = upcoming
                push(heap, (-upcoming, -depth, block))
                continue
            in_prefix = False
            if len(cached) < capacity:
                cached[block] = upcoming
                push(heap, (-upcoming, -depth, block))
                continue
            while True:
                negative_use, negative_depth, victim = heap[0]
                if cached.get(victim) == -negative_use:
                    break
                pop(heap)
            # Drop whichever is needed last; at equal next use (never again) the deeper.
            if (-negative_use, -negative_depth) >= (upcoming, depth):
                pop(heap)
                del cached[victim]
                cached[block] = upcoming
                push(heap, (-upcoming, -depth, block))
            # else: bypass, the new block is the one needed last
        per_request.append(prefix)
    return BoundResult(sum(per_request), tuple(per_request), held)
