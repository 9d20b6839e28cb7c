"""What the lease check costs a zero-copy reader, next to the copy it guards.

After copying its objects out of the arena, a client compares each slot's generation with
the segment's generation table (``MappedSegment.changed``); the server reads the same
table once per RETRIEVE (``L1Manager.generations``).  This measures both, in the same
process and on the same arena, next to the limit they add to: one memcpy of the same
objects out of the arena into pre-faulted buffers (what ``retrieve_into`` does anyway).

It also measures what a TTL reap pass (``L1Manager.expire_locks``, run under the L1 lock
every fraction of a second) holds the lock for with ``--reap-locked`` objects read-locked:
a pass with no lock due, and one reaping ``--reap-expired`` objects' locks among them.  A
pass that walked every locked object cost ~70 ms with 100k; it now costs what expired.

    python bench/bench_leases.py                      # 64 x 1 MiB and 1024 x 64 KiB
    python bench/bench_leases.py --shapes 4096x16     # 4096 objects of 16 KiB
    python bench/bench_leases.py --reap-locked 10000,100000
    python bench/bench_leases.py --reap-locked '' --mass-expiry 100000

With ``--mass-expiry`` it reaps that many locks expiring at once (a client that died holding
them; a burst of write reservations past the write TTL, of writers through the API or into
the shared arena, fenced) pass after pass, as the L1 eviction thread does, and reports the
longest pass: one pass reaping 100k held the lock 70-270 ms.  It counts the full (oldest
generation) collections during the passes too: a quarantine record per expired reservation
brought one or two of 40-130 ms into every mass expiry of 100k.
"""

from __future__ import annotations

import gc
import json
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from bench_args import BenchParser, at_least_one
from cases import count_by_size

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager
from lmcache_tiers.sweep_cadence import SWEEP_COST_FACTOR
from lmcache_tiers.wire import protocol as p
from lmcache_tiers.wire.shm import MappedSegment, segment_identity

KIB = 1 << 10


def timed(action: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure(count: int, size: int, repeats: int) -> dict[str, float]:
    capacity = max(count * size * 2, 64 << 20)
    with L1Manager(capacity, lock_ttl_s=60.0) as l1:
        keys = [ObjectKey("bench", 0, index.to_bytes(8, "big")) for index in range(count)]
        reserved = l1.reserve_write(keys, [size] * count)
        l1.finish_write(keys)
        objects = list(reserved.values())
        arena = l1.arena
        device, inode = segment_identity(arena.name)
        segment = MappedSegment(
            arena.name,
            arena.segment_size,
            device,
            inode,
            generation_offset=arena.generation_offset,
            generation_block=arena.generation_block,
        )
        try:
            generations = l1.generations(objects)
            slots = [p.Slot(obj.offset, obj.size, gen) for obj, gen in zip(objects, generations, strict=True)]
            targets = [np.ones(size, dtype=np.uint8) for _ in range(count)]  # pre-faulted
            source = segment.array

            def copy() -> None:
                for slot, target in zip(slots, targets, strict=True):
                    target[:] = source[slot.offset : slot.offset + slot.size]

            copy_s = timed(copy, repeats)
            check_s = timed(lambda: segment.changed(slots), repeats * 5)
            server_s = timed(lambda: l1.generations(objects), repeats * 5)
            assert segment.changed(slots) == []
        finally:
            segment.close()
    return {"copy_s": copy_s, "client_check_s": check_s, "server_read_s": server_s}


def measure_reap(locked: int, expired: int, repeats: int) -> dict[str, float]:
    """Median seconds of a reap pass with ``locked`` read-locked objects: with none due,
    and with ``expired`` more due (locked one grid step of the lock TTL before the others)."""
    align, ttl = 512, 6.4
    idle: list[float] = []
    reaping: list[float] = []
    for _ in range(repeats):
        with L1Manager((locked + expired) * align, align=align, lock_ttl_s=ttl, prefault=False) as l1:
            old = [ObjectKey("bench", 0, index.to_bytes(8, "big")) for index in range(expired)]
            new = [ObjectKey("bench", 1, index.to_bytes(8, "big")) for index in range(locked)]
            l1.reserve_write(old + new, [align] * (expired + locked))
            l1.finish_write_and_reserve_read(old)
            time.sleep(1.5 * l1.lock_grid_s)  # the others' locks end at a later grid step
            l1.finish_write_and_reserve_read(new)
            first = l1.get(old[0])
            assert first is not None
            # Untimed: the first pass after the reservations ended drops their index (once
            # per burst of writes), and the collector's debt from building 100k objects is
            # not the reap's.
            l1.expire_locks(first.lock_deadline - 2 * l1.lock_grid_s)
            gc.collect()
            start = time.perf_counter()
            l1.expire_locks(first.lock_deadline - l1.lock_grid_s)
            idle.append(time.perf_counter() - start)
            start = time.perf_counter()
            reaped = l1.expire_locks(first.lock_deadline)
            reaping.append(time.perf_counter() - start)
            assert reaped == expired, (reaped, expired)
    return {"reap_idle_s": statistics.median(idle), "reap_due_s": statistics.median(reaping)}


def measure_mass_expiry(count: int, kind: str) -> dict[str, float]:
    """Reap passes after ``count`` locks expired at once -- a client that died holding that
    many read locks (``kind`` "reads"), or a burst of write reservations past the write TTL
    ("writes"; "fenced": of writers into the shared arena) -- run back to back until none is
    due: the longest pass is how long every store, lookup and retrieve waited for the L1
    lock at worst, against the total."""
    align = 512
    with L1Manager(count * align, align=align, lock_ttl_s=60.0, write_ttl_s=60.0, prefault=False) as l1:
        keys = [ObjectKey("bench", 0, index.to_bytes(8, "big")) for index in range(count)]
        reserved = l1.reserve_write(keys, [align] * count)
        if kind == "reads":
            l1.finish_write_and_reserve_read(keys)
        elif kind == "fenced":
            l1.fence_writers(list(reserved.values()))
        deadline = max(obj.lock_deadline for obj in reserved.values())
        gc.collect()
        # The collector's pauses (a full collection with 100k objects alive takes 10-40 ms)
        # stop every thread whatever lock it waits for: timed apart from the reap's own hold.
        collecting = [0.0, 0.0]  # start of the collection under way, time collected in this pass
        full_collections = 0

        def collector(phase: str, info: dict[str, int]) -> None:
            nonlocal full_collections
            if phase == "start":
                collecting[0] = time.perf_counter()
                full_collections += info["generation"] == 2
            else:
                collecting[1] += time.perf_counter() - collecting[0]

        holds: list[float] = []
        own: list[float] = []
        reaped = 0
        gc.callbacks.append(collector)
        try:
            while True:
                collecting[1] = 0.0
                start = time.perf_counter()
                reaped += l1.expire_locks(deadline)
                holds.append(time.perf_counter() - start)
                own.append(holds[-1] - collecting[1])
                # Before the reap had a budget, one pass reaped everything (no ``reap_backlog``).
                if not getattr(l1, "reap_backlog", False):
                    break
        finally:
            gc.callbacks.remove(collector)
        assert reaped == count, (reaped, count)
    return {
        "max_hold_s": max(holds),
        "max_own_hold_s": max(own),
        "median_hold_s": statistics.median(holds),
        # the 99th percentile: a lone long pass on this shared machine is often the scheduler's
        "p99_hold_s": sorted(holds)[int(0.99 * (len(holds) - 1))],
        "total_s": sum(holds),
        # the eviction thread spaces passes by their cost (``next_sweep_at``): the drain's length
        "drain_s": (1 + SWEEP_COST_FACTOR) * sum(holds),
        "passes": len(holds),
        "full_collections": full_collections,
    }


def reap_counts(text: str) -> list[int]:
    """An argparse ``type`` for ``--reap-locked``: checked with the other flags, since a
    malformed count failed as a traceback only once every shape had been measured."""
    return [at_least_one(part.strip()) for part in text.split(",") if part.strip()]


class LeaseShape(NamedTuple):
    """Objects per retrieve and their size in KiB; shown as given (``64x1024``)."""

    count: int
    kib: int

    def __repr__(self) -> str:
        return f"{self.count}x{self.kib}"


def lease_shape(text: str) -> LeaseShape:
    """``COUNTxKIB`` (``64x1024``) as an argparse ``type``: a malformed one is one error line."""
    return LeaseShape(*count_by_size(text, noun="shape", form="COUNTxKIB", unit="KiB", example="64x1024"))


def main() -> None:
    parser = BenchParser(__doc__)
    parser.add_argument(
        "--shapes",
        nargs="+",
        type=lease_shape,
        default=[LeaseShape(64, 1024), LeaseShape(1024, 64)],
        help="COUNTxKIB: objects per retrieve and their size in KiB",
    )
    parser.add_argument("--repeats", type=at_least_one, default=20)
    parser.add_argument(
        "--reap-locked",
        type=reap_counts,
        default="10000,100000",
        help="read-locked counts for the reap, comma-separated ('' for no reap pass)",
    )
    parser.add_argument(
        "--reap-expired", type=at_least_one, default=100, help="of them, locks due at the reap"
    )
    parser.add_argument(
        "--mass-expiry",
        type=reap_counts,
        default="100000",
        help="locks expiring at once (read locks, then write reservations, then fenced ones): the "
        "longest hold of the L1 lock while they are reaped, comma-separated ('' for none)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead")
    args = parser.parse_args()
    results = []
    for count, kib in args.shapes:
        figures = measure(count, kib * KIB, args.repeats)
        results.append({"shape": f"{count}x{kib}", **figures})
        if args.json:
            continue
        copy_us = figures["copy_s"] * 1e6
        print(
            f"{count} x {kib} KiB: client check {figures['client_check_s'] * 1e6:.1f} us + server read "
            f"{figures['server_read_s'] * 1e6:.1f} us per retrieve, next to the copy of the same objects "
            f"{copy_us:.0f} us ({count * kib * KIB / figures['copy_s'] / 1e9:.2f} GB/s): "
            f"{(figures['client_check_s'] + figures['server_read_s']) / figures['copy_s']:.2%} of it"
        )
    for locked in args.reap_locked:
        figures = measure_reap(locked, args.reap_expired, max(3, args.repeats // 4))
        results.append({"reap_locked": locked, "reap_expired": args.reap_expired, **figures})
        if not args.json:
            print(
                f"reap pass with {locked} objects read-locked: {figures['reap_idle_s'] * 1e3:.3f} ms with "
                f"none due, {figures['reap_due_s'] * 1e3:.3f} ms reaping {args.reap_expired} of them"
            )
    for count in args.mass_expiry:
        for kind in ("reads", "writes", "fenced"):
            figures = measure_mass_expiry(count, kind)
            results.append({"mass_expiry": count, "kind": kind, **figures})
            if not args.json:
                what = {
                    "reads": "read locks",
                    "writes": "write reservations",
                    "fenced": "fenced write reservations",
                }
                print(
                    f"mass expiry of {count} {what[kind]}: "
                    f"longest hold of the L1 lock {figures['max_hold_s'] * 1e3:.3f} ms "
                    f"({figures['max_own_hold_s'] * 1e3:.3f} ms without the collector's pauses, "
                    f"median {figures['median_hold_s'] * 1e3:.3f} ms, "
                    f"p99 {figures['p99_hold_s'] * 1e3:.3f} ms), "
                    f"{figures['passes']:.0f} passes, {figures['total_s'] * 1e3:.1f} ms in all, "
                    f"{figures['full_collections']:.0f} full collections; drained in "
                    f"{figures['drain_s']:.1f} s at the eviction thread's spacing"
                )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
