"""The embedded default L2 that ``lmcache-tiers serve`` uses when none is configured."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmcache_tiers.registry import ComponentRegistry, Kind

#: Environment variable that moves the default cache directory (tests, containers).
CACHE_DIR_ENV = "LMCACHE_TIERS_CACHE_DIR"
DEFAULT_L2_CAPACITY_GB = 10


def cache_dir() -> Path:
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("lmcache-tiers"))


def default_l2_adapters(registry: ComponentRegistry) -> list[dict[str, Any]]:
    """A capacity-capped file L2 under the user cache directory, from whichever file
    adapter plugin is installed; an empty list (L1 only) when there is none."""
    names = {name.lower() for name in registry.names(Kind.L2_ADAPTER)}
    directory = str(cache_dir() / "l2")
    if "fs" in names:
        return [{"type": "fs", "path": directory, "max_capacity_gb": DEFAULT_L2_CAPACITY_GB}]
    if "nixl_store_dynamic" in names:
        return [
            {
                "type": "nixl_store_dynamic",
                "backend": "POSIX",
                "backend_params": {
                    "file_path": directory,
                    "use_direct_io": "false",
                    "max_capacity_gb": str(DEFAULT_L2_CAPACITY_GB),
                    "shard_dirs": "true",
                },
            }
        ]
    return []
