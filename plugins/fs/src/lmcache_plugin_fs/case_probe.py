"""Whether a local root tells letter case apart in names.

Record names keep a key's model name and cache_salt as they are, so on a filesystem that
folds case (exFAT, FAT, an ext4 or tmpfs directory with casefolding, the defaults of macOS
and Windows) keys that differ only in case share one file: a store of one replaces the
other's record, whose key is then a miss (another key's record: ``foreign_records``).
Escaping upper case in names would rename every existing cache, so the start-up asks
instead, by creating one file and looking for its name in upper case, and says so."""

from __future__ import annotations

import contextlib
import os


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
