"""What the lease check costs a zero-copy reader, next to the copy it guards.

After copying its objects out of the arena, a client compares each slot's generation with
the segment's generation table (``MappedSegment.changed``); the server reads the same
table once per RETRIEVE (``L1Manager.generations``).  This measures both, in the same
process and on the same arena, next to the limit they add to: one memcpy of the same
objects out of the arena into pre-faulted buffers (what ``retrieve_into`` does anyway).

    python bench/bench_leases.py                      # 64 x 1 MiB and 1024 x 64 KiB
    python bench/bench_leases.py --shapes 4096x16     # 4096 objects of 16 KiB
"""

from __future__ import annotations

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
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
