"""``reclaimable_spans``: the stretches of L1 that no locked object, extent held for a load
or quarantined extent covers, by address -- checked against a block-by-block map of L1
after random writes, locks, releases and forced deletes of mixed-size objects."""

from __future__ import annotations

import random

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

ALIGN = 4096
BLOCKS = 256


def reference_spans(l1: L1Manager) -> list[int]:
    """Runs of blocks no unevictable extent covers, from a map of every block."""
    covered = [False] * BLOCKS
    pinned = [(obj.offset, obj.extent_bytes) for obj in l1._table.objects.values() if obj.locked]
    pinned += l1._leases.held_extents()
    for offset, length in pinned:
        for block in range(offset // ALIGN, (offset + length) // ALIGN):
            covered[block] = True
    spans, run = [], 0
    for block in covered:
        if block:
            if run:
                spans.append(run * ALIGN)
            run = 0
        else:
            run += 1
    return [*spans, run * ALIGN] if run else spans


def test_spans_match_a_map_of_every_block() -> None:
    rng = random.Random(45)
    l1 = L1Manager(BLOCKS * ALIGN, align=ALIGN, prefault=False)
    try:
        assert l1.reclaimable_spans() == [BLOCKS * ALIGN]
        present: list[ObjectKey] = []
        for step in range(400):
            action = rng.random()
            if action < 0.4:
                key = ObjectKey("spans", 0, step.to_bytes(8, "big"))
                try:
                    l1.reserve_write([key], [rng.randint(1, 6) * ALIGN - rng.randint(0, 100)])
                except Exception:
                    l1.evict(8 * ALIGN, list(present))
                    continue
                if rng.random() < 0.2:
                    continue  # left WRITING: write-locked
                l1.finish_write([key])
                present.append(key)
            elif action < 0.6 and present:
                l1.reserve_read(rng.sample(present, min(len(present), 3)))
            elif action < 0.8 and present:
                l1.finish_read(rng.sample(present, min(len(present), 3)))
            elif present:
                doomed = rng.choice(present)
                l1.delete([doomed], force=True)  # a locked one's extent is quarantined
            present = [key for key in present if l1.contains(key)]
            assert l1.reclaimable_spans() == reference_spans(l1)
    finally:
        l1.close()
