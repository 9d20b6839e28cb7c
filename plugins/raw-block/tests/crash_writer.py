"""Child process of the crash test: stores objects through a raw_block adapter until killed.

Run as ``python crash_writer.py DEVICE_PATH``.  Object ``i`` has key ``make_keys(1,
start=i)`` and the bytes of :func:`expected`.  The writer keeps at most :data:`LIVE`
objects, deleting the oldest batch before storing a new one once there are that many, so
slots are reused all the time.  It prints ``stored N`` after every acknowledged store
(objects below N were stored) and ``deleted N`` after every delete (objects below N were
deleted), so the parent knows which objects must survive.
"""

from __future__ import annotations

import sys
from functools import cache

from lmcache_plugin_raw_block import RawBlockConfig
from rb_helpers import Arena, client, open_raw

from lmcache_tiers.testing.l2 import make_keys, pattern

BATCH = 8
SLOT = 64 << 10
SLOTS = 256
#: objects kept at once; the rest of the slots absorb writes in flight and retired slots
LIVE = 192


def crash_config(path: str) -> RawBlockConfig:
    # Checkpoints every second, so the kill lands after some and between others.
    return RawBlockConfig(
        device_path=path,
        slot_bytes=SLOT,
        capacity_bytes=(SLOTS + 4) * SLOT,
        meta_checkpoint_interval_sec=1,
    )


def object_size(index: int) -> int:
    # Sizes vary so that kills land in writes of different lengths and alignments.
    return 20_000 + (index * 7919) % (SLOT - 4096 - 20_000)


@cache
def _random_block() -> bytes:
    return pattern(0, 4 << 20)


def expected(index: int) -> bytes:
    size = object_size(index)
    offset = (index * 104_729) % ((4 << 20) - size)
    return index.to_bytes(8, "big") + _random_block()[offset + 8 : offset + size]


def main(path: str) -> None:
    arena = Arena(4 << 20)
    adapter = open_raw(crash_config(path))
    blocking = client(adapter)
    index = oldest = 0
    while True:
        if index - oldest >= LIVE:
            if adapter.delete(make_keys(BATCH, start=oldest)) != [True] * BATCH:
                raise SystemExit(f"delete of batch at {oldest} failed")
            oldest += BATCH
            print("deleted", oldest, flush=True)
        keys = make_keys(BATCH, start=index)
        views = [arena.filled(expected(i)) for i in range(index, index + BATCH)]
        if blocking.store(keys, views) != [True] * BATCH:
            raise SystemExit(f"store of batch at {index} failed")
        index += BATCH
        print("stored", index, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
