"""Child process of the raw_block crash test: a store storm (``storm.py``) until killed.

Run as ``python rb_crash_writer.py DEVICE_PATH``.
"""

from __future__ import annotations

import sys

from lmcache_plugin_raw_block import RawBlockConfig
from rb_helpers import Arena, open_raw
from storm import SLOTS, storm

SLOT = 64 << 10
LARGEST = SLOT - 4096


def crash_config(path: str) -> RawBlockConfig:
    # Checkpoints every second, so the kill lands after some and between others.
    return RawBlockConfig(
        device_path=path, slot_bytes=SLOT, capacity_bytes=(SLOTS + 4) * SLOT, meta_checkpoint_interval_sec=1
    )


if __name__ == "__main__":
    arena = Arena(4 << 20)  # aligned buffers, as L1 extents are: payloads written in place
    storm(open_raw(crash_config(sys.argv[1])), LARGEST, arena.filled)
