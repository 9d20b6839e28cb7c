"""raw_block and dax stores for server tests: where their images live and their specs.

Both keep their image in /dev/shm: dax maps its file shared, and raw_block's file takes
O_DIRECT there.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

#: what a slot holds beyond the chunk: raw_block's header block
HEADER_BLOCK = 4096


def skip_without_block_plugins() -> None:
    """Skip the calling test module when raw_block or dax is not installed."""
    for module in ("lmcache_plugin_raw_block", "lmcache_plugin_dax"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed", allow_module_level=True)


def image_directory(prefix: str) -> Iterator[Path]:
    """A fresh directory in /dev/shm, removed afterwards (the body of a fixture)."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir="/dev/shm"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def block_adapter_spec(kind: str, directory: Path, *, chunk: int, slots: int, **extra: Any) -> dict[str, Any]:
    """The adapter JSON of a `kind` store ("raw_block" or "dax") of `slots` chunks of
    `chunk` bytes, its image in `directory`; `extra` fields are added as given."""
    if kind == "raw_block":
        slot = chunk + HEADER_BLOCK
        spec = {
            "type": "raw_block",
            "device_path": str(directory / "raw_block.img"),
            "slot_bytes": slot,
            "capacity_bytes": (slots + 8) * slot,
            "meta_checkpoint_interval_sec": 1,
        }
    else:
        spec = {
            "type": "dax",
            "device_path": str(directory / "dax.img"),
            "max_dax_size_gb": (slots * (chunk + HEADER_BLOCK) + (1 << 20)) / (1 << 30),
            "slot_bytes": chunk,
        }
    return spec | extra
