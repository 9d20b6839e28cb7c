"""lmcache-tiers: a two-level KV-cache storage server built as a plugin framework."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lmcache-tiers")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0"

__all__ = ["__version__"]
