"""Child process of the crash test: stores objects through nixl_store_dynamic until killed.

Run as ``python crash_writer.py ROOT [direct]`` (``direct``: with ``use_direct_io``).
Object ``i`` has key ``make_keys(1, start=i)`` and the bytes of :func:`expected`, so the
parent can check every hit after the restart.
"""

from __future__ import annotations

import sys
from functools import cache

from nixl_helpers import Arena, client, dynamic_config, open_dynamic

from lmcache_tiers.testing.l2 import make_keys, pattern

BATCH = 8
MAX_SIZE = (96 << 10) + 6 * 40_000 + 4


def object_size(index: int) -> int:
    # Sizes vary so that a kill lands in writes of different lengths and alignments.
    return (96 << 10) + (index % 7) * 40_000 + index % 5


@cache
def _random_block() -> bytes:
    return pattern(0, 8 << 20)


def expected(index: int) -> bytes:
    """Distinct bytes per object, cheap to make so the writer spends its time storing."""
    size = object_size(index)
    offset = (index * 7919) % ((8 << 20) - size)
    return index.to_bytes(8, "big") + _random_block()[offset + 8 : offset + size]


def main(root: str, direct_io: bool) -> None:
    arena = Arena(256 << 20)
    config = dynamic_config(root, capacity_gb=64, shard_dirs=True, direct_io=direct_io)
    adapter = open_dynamic(config, arena.view)
    blocking = client(adapter)
    buffers = [arena.take(MAX_SIZE) for _ in range(BATCH)]
    index = 0
    while True:
        keys = make_keys(BATCH, start=index)
        views = []
        for slot, position in enumerate(range(index, index + BATCH)):
            data = expected(position)
            buffers[slot][: len(data)] = data
            views.append(buffers[slot][: len(data)])
        if blocking.store(keys, views) != [True] * BATCH:
            raise SystemExit(f"store of batch at {index} failed")
        index += BATCH
        print(index, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["direct"])
