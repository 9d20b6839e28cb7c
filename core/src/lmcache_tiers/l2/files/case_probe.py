"""Whether a local root tells letter case apart in names, told once at start-up.

Record names keep a key's model name and cache_salt as they are, so on a filesystem that
folds case (exFAT, FAT, an ext4 or tmpfs directory with casefolding, the defaults of macOS
and Windows) keys that differ only in case share one file: a store of one replaces the
other's record, whose key is then a miss (another key's record: ``foreign_records``).
Escaping upper case in names would rename every existing cache, so a local store's
start-up asks instead, by creating one file and looking for its name in upper case, and
says so (``fs`` and ``nixl_store_dynamic`` use the same names, and this one probe)."""

from __future__ import annotations

import contextlib
import logging
import os

log = logging.getLogger("lmcache_tiers.l2.files")


def folds_case(root: str) -> bool | None:
    """True when ``root`` finds a file by its name in another case; None when the probe
    could not tell (a full or read-only disk: the stores will count and log theirs).  The
    probe's name is a temporary name (``.tmp-*.part``), which the next start sweeps if
    this process dies before it removes it."""
    name = f".tmp-{os.getpid()}-case-probe.part"
    path = os.path.join(root, name)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644))
    except OSError:
        return None
    try:
        # Existence, not the inode: a FUSE filesystem (exfat-fuse) may give one file
        # another inode number under each name it is looked up by.
        return os.path.lexists(os.path.join(root, name.upper()))
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def warn_if_root_folds_case(root: str, name: str) -> bool:
    """Probe the local store directory ``root`` (which exists) of the adapter ``name``;
    when its filesystem folds letter case, say so in one warning line and return True
    (the adapter reports it as ``case_insensitive_root`` in its stats)."""
    if folds_case(root) is not True:
        return False
    log.warning(
        "%s: the filesystem of %s does not tell letter case apart in names: keys whose "
        "model name or cache_salt differ only in case share one record file, and a store "
        "of one replaces the other's record (that key's stored object is then gone: a "
        "miss, never the other's bytes); give the adapter a directory on a "
        "case-sensitive filesystem",
        name,
        root,
    )
    return True
