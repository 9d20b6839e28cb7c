"""Reaping files a killed server left behind (shm segments, NVMe L1 block files).

A server killed with SIGKILL runs no cleanup.  Files it creates carry its pid in their
name, so the next start-up can tell which ones belong to processes that no longer exist.

A pid alone is not proof: servers in containers that share ``/dev/shm`` (``--ipc=host``)
but not a pid namespace cannot see each other's processes, so each would take the other's
live segment for a dead one.  The creator therefore holds a shared ``flock`` on its file
for as long as it lives (:func:`hold_as_creator`; the kernel drops it when the process
dies, in whatever namespace), and a file is removed only when its pid is not visible here
*and* that lock is free.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re

from lmcache_tiers.errors import TiersError

logger = logging.getLogger(__name__)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def hold_as_creator(fd: int, path: str) -> None:
    """Take the creator's shared lock on the file just created at ``path`` and open as
    ``fd``; it lasts while any descriptor of this open file stays open.

    Between the ``O_EXCL`` create and this lock another server's start-up could take the
    new file for a dead one: its exclusive lock then refuses ours, or the name is already
    gone -- either way the file is not usable, and that is an error here rather than a
    segment no client can open.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        removed = True
    else:
        removed = os.fstat(fd).st_nlink == 0
    if removed:
        raise TiersError(
            f"{path} was removed as stale by another server starting at the same moment; start again"
        )


def _remove_if_unlocked(path: str) -> str | None:
    """Unlink ``path`` unless a live creator holds its lock: ``""`` when this removed it,
    None when it was gone already, otherwise why it was left in place."""
    # O_NONBLOCK: anyone can create a FIFO of this name, and opening one would wait for a
    # writer; O_NOFOLLOW: a symlink of this name is not the creator's file.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.ELOOP):
            return f"not removable by this process ({exc.strerror})"
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "its creator still holds it (a process this pid namespace does not show)"
        # Unlinked while the lock is held: no new file of this name can be created
        # meanwhile (O_EXCL), and a creator of this one that has yet to lock it finds the
        # name gone (hold_as_creator).
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        except PermissionError as exc:  # a sticky /dev/shm: another user's file
            return f"not removable by this process ({exc.strerror})"
        return ""
    finally:
        os.close(fd)


def remove_files_of_dead_processes(directory: str, pattern: re.Pattern[str], what: str) -> list[str]:
    """Unlink entries of ``directory`` matching ``pattern`` (group 1 = creator pid) whose
    creator is gone; returns the names removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = pattern.match(entry)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or process_exists(pid):
            continue
        path = os.path.join(directory, entry)
        outcome = _remove_if_unlocked(path)
        if outcome is None:  # removed by someone else meanwhile
            continue
        if outcome:
            logger.info("%s %s of process %d left in place: %s", what, path, pid, outcome)
            continue
        logger.warning("removed stale %s %s left by dead process %d", what, path, pid)
        removed.append(entry)
    return removed
