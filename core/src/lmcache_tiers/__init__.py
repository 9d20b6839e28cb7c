"""lmcache-tiers: a two-level KV-cache storage server built as a plugin framework.

Plugin authors use :mod:`lmcache_tiers.plugin` (also reachable as ``lmcache_tiers.plugin``
after ``import lmcache_tiers``), the public API for third-party packages.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import Any

try:
    __version__ = version("lmcache-tiers")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"

__all__ = ["__version__", "plugin"]


def __getattr__(name: str) -> Any:
    if name == "plugin":  # imported on first use: ``import lmcache_tiers`` stays cheap
        return importlib.import_module("lmcache_tiers.plugin")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
