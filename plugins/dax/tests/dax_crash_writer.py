"""Child process of the dax crash test: stores (and deletes) objects until killed.

Run as ``python dax_crash_writer.py PATH``.  Object ``i`` has key ``make_keys(1,
start=i)`` and the bytes of :func:`expected`.  At most :data:`LIVE` objects are kept: the
oldest batch is deleted before a new one is stored, so slots are reused all the time.
It prints ``stored N`` after every acknowledged store and ``deleted N`` after every
delete, so the parent knows what must survive and what must not.
"""

from __future__ import annotations

import sys
from functools import cache

from dax_helpers import SLOT, client, open_dax, size_gb
from lmcache_plugin_dax import DaxConfig

from lmcache_tiers.testing.l2 import make_keys, pattern

BATCH = 8
SLOTS = 256
LIVE = 192


def crash_config(path: str) -> DaxConfig:
    return DaxConfig(device_path=path, max_dax_size_gb=size_gb(SLOTS), slot_bytes=SLOT, num_store_workers=2)


def object_size(index: int) -> int:
    return 20_000 + (index * 7919) % (SLOT - 20_000)


@cache
def _random_block() -> bytes:
    return pattern(0, 4 << 20)


def expected(index: int) -> bytes:
    size = object_size(index)
    offset = (index * 104_729) % ((4 << 20) - size)
    return index.to_bytes(8, "big") + _random_block()[offset + 8 : offset + size]


def main(path: str) -> None:
    adapter = open_dax(crash_config(path))
    blocking = client(adapter)
    index = oldest = 0
    while True:
        if index - oldest >= LIVE:
            if adapter.delete(make_keys(BATCH, start=oldest)) != [True] * BATCH:
                raise SystemExit(f"delete of batch at {oldest} failed")
            oldest += BATCH
            print("deleted", oldest, flush=True)
        keys = make_keys(BATCH, start=index)
        views = [memoryview(bytearray(expected(i))) for i in range(index, index + BATCH)]
        if blocking.store(keys, views) != [True] * BATCH:
            raise SystemExit(f"store of batch at {index} failed")
        index += BATCH
        print("stored", index, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
