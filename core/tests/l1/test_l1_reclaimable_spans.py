"""``reclaimable_spans``: the stretches of L1 that no locked object, extent held for a load
or quarantined extent covers, by address -- checked against a block-by-block map of L1
after random writes, locks, releases and forced deletes of mixed-size objects."""

from __future__ import annotations

import random
from operator import attrgetter

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.l1 import manager as manager_module

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


def test_the_extents_are_read_after_the_l1_lock_is_let_go(monkeypatch: pytest.MonkeyPatch) -> None:
    # On a full L1 much of which is locked every write that finds no room asks for the
    # spans: reading each locked extent under the L1 lock held every store and lookup up
    # for ~15 ms per such write with 100k locked objects.  Only the lists are copied
    # under it; every offset and length is read after it.
    l1 = L1Manager(BLOCKS * ALIGN, align=ALIGN, prefault=False)
    try:
        locked = [ObjectKey("spans", 0, index.to_bytes(8, "big")) for index in range(4)]
        l1.reserve_write(locked, [ALIGN] * 4)
        l1.finish_write_and_reserve_read(locked)
        l1.delete(locked[:1], force=True)  # a quarantined extent
        read_under_lock: list[str] = []

        def probe(name: str) -> attrgetter[int]:
            get = attrgetter(name)

            def read(record: object) -> int:
                if l1.lock._is_owned():  # type: ignore[attr-defined]
                    read_under_lock.append(name)
                return int(get(record))

            return read  # type: ignore[return-value]

        for getter, name in (("_OFFSET", "offset"), ("_EXTENT_BYTES", "extent_bytes")):
            monkeypatch.setattr(manager_module, getter, probe(name))
        assert l1.reclaimable_spans() == reference_spans(l1)
        assert read_under_lock == []
    finally:
        l1.close()
