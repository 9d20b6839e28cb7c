"""The embedded default L2 that ``lmcache-tiers serve`` uses when none is configured.

An ``fs`` adapter in ``<user cache dir>/lmcache-tiers/l2`` (``LMCACHE_TIERS_CACHE_DIR``
moves the whole cache directory), sharded, with a capacity of 10 GiB or 10% of the size
of the filesystem holding it, whichever is smaller (``LMCACHE_TIERS_CACHE_GB`` sets it),
and LRU eviction at 80% usage freeing 20%.  Records move with ``O_DIRECT`` where the
filesystem takes it (``use_odirect: "auto"``): buffered writes copy every stored byte into
the page cache inside the kernel, and on kernels without preemption of kernel code
(``PREEMPT_NONE``) those copies, and the flushing after them, keep request threads and the
engine off the CPU for tens of milliseconds (docs/adapters/fs.md).  The capacity depends
on the filesystem's size, not on its free space, so it is the same at every start while the
cache fills.  The start-up scan counts what earlier runs left, so the cache stays under its
capacity across restarts.

One default server per user and cache directory: a second one is refused with a hint
(:func:`claim_default_l2`, taken before the pre-flight), not left to fail on the
adapter's directory lock or its pre-flight probe.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmcache_tiers.config import MAX_GIB
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.registry import ComponentRegistry, Kind

#: Environment variable that moves the default cache directory (tests, containers).
CACHE_DIR_ENV = "LMCACHE_TIERS_CACHE_DIR"
#: Environment variable that sets the default L2's capacity in GiB.
CACHE_GB_ENV = "LMCACHE_TIERS_CACHE_GB"
DEFAULT_L2_CAPACITY_GB = 10
#: at most this fraction of the size of the filesystem holding the cache
DEFAULT_L2_DISK_FRACTION = 0.10
DEFAULT_L2_EVICTION: dict[str, Any] = {
    "eviction_policy": "LRU",
    "trigger_watermark": 0.8,
    "eviction_ratio": 0.2,
}
_GIB = 1 << 30


def cache_dir() -> Path:
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("lmcache-tiers"))


def default_l2_dir() -> Path:
    return cache_dir() / "l2"


def _filesystem_size(directory: Path) -> int | None:
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stat = os.statvfs(probe)
    except OSError:
        return None
    return stat.f_blocks * stat.f_frsize


def default_capacity_gb(directory: Path | None = None) -> tuple[float, str]:
    """The default L2's capacity in GiB and how it was chosen (for the banner); OSError
    for a directory on a filesystem of no size."""
    raw = os.environ.get(CACHE_GB_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        # at most what any size field takes: a larger value would be refused later, as the
        # default L2's fault (with a hint about its directory), not as this variable's
        if not 0 < value <= MAX_GIB:
            raise ConfigError(
                f"{CACHE_GB_ENV}={raw!r} must be a positive number of GiB, at most {MAX_GIB:.0f}"
            )
        return value, f"set by {CACHE_GB_ENV}"
    where = directory or default_l2_dir()
    size = _filesystem_size(where)
    if size == 0:
        # /proc, /sys: a share of nothing is a capacity of 0, which eviction would refuse
        # as the operator's max_capacity_gb, a field no operator of the default set.
        raise OSError(f"{where} is on a filesystem of 0 bytes, not a disk")
    cap = float(DEFAULT_L2_CAPACITY_GB)
    if size is not None and size * DEFAULT_L2_DISK_FRACTION < cap * _GIB:
        share = size * DEFAULT_L2_DISK_FRACTION / _GIB
        # Rounded for the banner, but a filesystem under ~5 MiB keeps its tiny share: rounded
        # to 0 it would read as "unbounded", refused with eviction as the operator's mistake.
        return round(share, 3) or share, f"{DEFAULT_L2_DISK_FRACTION:.0%} of its filesystem"
    return (
        cap,
        f"the smaller of {DEFAULT_L2_CAPACITY_GB} GiB and {DEFAULT_L2_DISK_FRACTION:.0%} of its filesystem",
    )


def default_l2_adapters(registry: ComponentRegistry) -> list[dict[str, Any]]:
    """A capacity-capped file L2 under the user cache directory, from whichever file
    adapter plugin is installed; an empty list (L1 only) when there is none."""
    names = {name.lower() for name in registry.names(Kind.L2_ADAPTER)}
    directory = default_l2_dir()
    capacity, _rule = default_capacity_gb(directory)
    if "fs" in names:
        return [
            {
                "type": "fs",
                "path": str(directory),
                "max_capacity_gb": capacity,
                "shard_dirs": True,
                "use_odirect": "auto",
                "eviction": dict(DEFAULT_L2_EVICTION),
            }
        ]
    if "nixl_store_dynamic" in names:
        return [
            {
                "type": "nixl_store_dynamic",
                "backend": "POSIX",
                "backend_params": {
                    "file_path": str(directory),
                    "use_direct_io": "false",
                    "max_capacity_gb": str(capacity),
                    "shard_dirs": "true",
                },
                "eviction": dict(DEFAULT_L2_EVICTION),
            }
        ]
    return []


def _adapter_dir(adapter: dict[str, Any]) -> str | None:
    if adapter.get("type") == "fs":
        return adapter.get("path") or adapter.get("base_path")
    if adapter.get("type") == "nixl_store_dynamic":
        return (adapter.get("backend_params") or {}).get("file_path")
    return None


def describe_default(adapter: dict[str, Any]) -> str | None:
    """The banner's line for an adapter that is the embedded default, else None."""
    directory = _adapter_dir(adapter)
    if directory is None or os.path.abspath(directory) != os.path.abspath(default_l2_dir()):
        return None
    _capacity, rule = default_capacity_gb()
    eviction = adapter.get("eviction") or {}
    evicts = (
        f"{eviction.get('eviction_policy', 'LRU')} eviction at {eviction.get('trigger_watermark', 0.8):.0%} "
        f"frees {eviction.get('eviction_ratio', 0.2):.0%}"
        if eviction
        else "no eviction"
    )
    return (
        f"the embedded default: capacity {rule}, {evicts}; {CACHE_DIR_ENV} moves it, "
        f"{CACHE_GB_ENV} sizes it, --no-default-l2 turns it off"
    )


def claim_default_l2() -> object:
    """Take the default L2 for this process (keep the returned lock for its lifetime).

    Raises ConfigError with a hint when another default server of this user holds it.
    """
    from lmcache_tiers.l2.files import DirectoryInUseError, PathLock

    directory = default_l2_dir()
    try:
        return PathLock(f"default-l2:{os.path.realpath(directory)}", what=f"the default L2 cache {directory}")
    except DirectoryInUseError as exc:
        holder = f" (pid {exc.holder_pid})" if exc.holder_pid else ""
        raise ConfigError(
            f"another lmcache-tiers server{holder} already uses the default L2 cache in {directory}; "
            f"give this one its own with {CACHE_DIR_ENV}=<dir>, or run it without L2 (--no-default-l2)"
        ) from None
