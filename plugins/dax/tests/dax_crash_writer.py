"""Child process of the dax crash test: a store storm (``storm.py``) until killed.

Run as ``python dax_crash_writer.py PATH``.
"""

from __future__ import annotations

import sys

from dax_helpers import SLOT, open_dax, size_gb
from lmcache_plugin_dax import DaxConfig
from storm import SLOTS, storm


def crash_config(path: str) -> DaxConfig:
    return DaxConfig(device_path=path, max_dax_size_gb=size_gb(SLOTS), slot_bytes=SLOT, num_store_workers=2)


if __name__ == "__main__":
    storm(open_dax(crash_config(sys.argv[1])), SLOT)
