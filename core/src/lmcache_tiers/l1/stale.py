"""Reaping files a killed server left behind (shm segments, NVMe L1 block files).

A server killed with SIGKILL runs no cleanup.  Files it creates carry its pid in their
name, so the next start-up can tell which ones belong to processes that no longer exist.

A pid alone is not proof: servers in containers that share ``/dev/shm`` (``--ipc=host``)
but not a pid namespace cannot see each other's processes, so each would take the other's
live segment for a dead one.  The creator therefore holds a shared ``flock`` on its file
for as long as it lives (:func:`hold_as_creator`; the kernel drops it when the process
dies, in whatever namespace), and a file is removed only when its pid is not visible here
*and* that lock is free.  A file named with this process's own pid is not taken for live on
that ground: a server restarted in a fresh container often gets the pid its killed
predecessor had.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import threading
from collections.abc import Callable
from typing import Protocol

from lmcache_tiers.errors import TiersError

logger = logging.getLogger(__name__)

# Held from a create to its creator's lock (create_as_creator), and by this process's
# reaping of files named with its own pid, which the pid check cannot protect.  Reentrant:
# a garbage collection inside either can run a finalizer that releases another file.
_own_creations = threading.RLock()
# (st_dev, st_ino) of the files this process holds as creator: its reaping never opens
# those (on filesystems that emulate flock with POSIX locks, closing any descriptor of a
# file drops this process's lock on it, and its own LOCK_EX would not conflict with it).
_own_files: set[tuple[int, int]] = set()


def _after_fork_in_child() -> None:
    # A lock another thread held at the fork stays held forever in the child, whose
    # finalizers release the inherited descriptors through it.
    global _own_creations
    _own_creations = threading.RLock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def hold_as_creator(fd: int, path: str, *, required: bool) -> None:
    """Take the creator's shared lock on the file just created at ``path`` and open as
    ``fd``; it lasts while any descriptor of this open file stays open.

    Between the ``O_EXCL`` create and this lock another server's start-up could take the
    new file for a dead one: its exclusive lock then refuses ours, or the name is already
    gone -- either way the file is not usable, and that is an error here rather than a
    segment no client can open.  A lock the filesystem refuses otherwise is an error too
    when ``required``: on a filesystem where other processes can take locks (a tmpfs),
    a live file without its creator's lock is one another start-up may remove.
    """
    taken_by_reaper = False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        taken_by_reaper = True  # it holds its exclusive lock on the new file
    except OSError as exc:
        if required:
            raise TiersError(
                f"{path}: the creator's lock cannot be taken ({exc.strerror}); without it "
                "another server's start-up could remove this live file: start again"
            ) from None
        # No flock on this filesystem (ENOLCK: NFS without a lock manager): the reaping
        # cannot check any lock here either and leaves every file in place, so the file
        # is safe without it; refusing would end a start-up that worked before the lock.
        logger.warning(
            "%s: the creator's lock cannot be taken (%s): start-up reaping will leave this "
            "file in place if this server is killed",
            path,
            exc.strerror,
        )
    if taken_by_reaper or os.fstat(fd).st_nlink == 0:
        raise TiersError(
            f"{path} was removed as stale by another server starting at the same moment; start again"
        )


def create_as_creator(path: str, flags: int, *, lock_required: bool) -> int:
    """``os.open(path, flags, 0o600)`` (``flags`` include ``O_CREAT | O_EXCL``) followed by
    :func:`hold_as_creator`; errors of the open propagate unchanged.  On any failure of the
    lock the new file is closed and removed."""
    with _own_creations:
        fd = os.open(path, flags, 0o600)
        try:
            hold_as_creator(fd, path, required=lock_required)
            info = os.fstat(fd)
            _own_files.add((info.st_dev, info.st_ino))
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:  # gone if the lock was refused
                pass
            raise
    return fd


def release_as_creator(fd: int) -> None:
    """Close ``fd`` from :func:`create_as_creator` (after unlinking the name, so that the
    name never exists unlocked while its creator lives); its inode may then be reused."""
    with _own_creations:
        info = os.fstat(fd)
        _own_files.discard((info.st_dev, info.st_ino))
        os.close(fd)


class MappingJudge(Protocol):
    """What a pass over the processes' mappings tells about the files it was made for."""

    def why_kept(self, info: os.stat_result, open_elsewhere: bool | None) -> str:
        """Why the file ``info`` must stay ("" when nothing shows it in use), given whether
        another open file of it exists anywhere (None: could not be told)."""
        ...


class _OneSurvey:
    """The mapping survey of a start-up's candidates, made once at its first need: one
    pass over every process's maps for all of them, not one per file."""

    def __init__(self, survey: Callable[[list[str]], MappingJudge], paths: list[str]) -> None:
        self._survey = survey
        self._paths = paths
        self._judge: MappingJudge | None = None

    def why_kept(self, info: os.stat_result, open_elsewhere: bool | None) -> str:
        if self._judge is None:
            self._judge = self._survey(self._paths)
        return self._judge.why_kept(info, open_elsewhere)


def _remove_if_unlocked(path: str, mapped: _OneSurvey | None) -> str | None:
    """Unlink ``path`` unless a live creator holds its lock or it may be in use otherwise
    (``mapped``): ``""`` when this removed it, None when it was gone already, otherwise
    why it was left in place."""
    # O_NONBLOCK: anyone can create a FIFO of this name, and opening one would wait for a
    # writer; O_NOFOLLOW: a symlink of this name is not the creator's file.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as exc:
        # EACCES/EPERM: another user's; ELOOP: a symlink; ENXIO: a socket, and so on.
        # Anyone can create such a name: it must not stop start-up.
        return f"not removable by this process ({exc.strerror})"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "its creator still holds it (a live process this start-up cannot see)"
        except OSError as exc:  # no flock here (some network filesystems): no proof either way
            return f"its creator's lock cannot be checked ({exc.strerror})"
        info = os.fstat(fd)
        if mapped is not None and not _unmappable(info):
            in_use = mapped.why_kept(info, _open_elsewhere(fd))
            if in_use:
                return in_use
        # Unlinked while the lock is held: no new file of this name can be created
        # meanwhile (O_EXCL), and a creator of this one that has yet to lock it finds the
        # name gone (hold_as_creator).
        try:
            os.unlink(path)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a sticky /dev/shm: another user's file; EISDIR: a directory
            return f"not removable by this process ({exc.strerror})"
        return ""
    finally:
        os.close(fd)


def creator_lock_held(path: str) -> bool | str:
    """Whether a live process holds the creator's lock on the existing file ``path``
    (True or False), or why that cannot be told (a string); nothing is removed.

    For a name that is taken: a segment whose lock is free was left by a creator that
    died (or was never a server's file), one whose lock is held belongs to a live server.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
    with _own_creations:
        try:
            info = os.lstat(path)
            if (info.st_dev, info.st_ino) in _own_files:
                return True  # this process's own (opening it could drop our lock; see above)
            fd = os.open(path, flags)
        except FileNotFoundError:
            return "it is gone now"
        except OSError as exc:
            return f"it cannot be opened: {exc.strerror}"
    try:
        # Taken and dropped at once: a creator locks its new file right after creating it,
        # so holding this any longer could make that creator take it for reaped.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        return f"its lock cannot be checked: {exc.strerror}"
    finally:
        os.close(fd)
    return False


def _unmappable(info: os.stat_result) -> bool:
    """A FIFO, socket or directory (anyone can create one of a segment's name) is never
    mapped, so no process's maps can keep it."""
    return stat.S_ISFIFO(info.st_mode) or stat.S_ISSOCK(info.st_mode) or stat.S_ISDIR(info.st_mode)


def _open_elsewhere(fd: int) -> bool | None:
    """Whether another open file of ``fd``'s file exists, in any process of any namespace
    (a mapping keeps the file it was made from open): a write lease is granted only when
    none does, and is given back at once.  None when the lease cannot be asked for (not
    the file's owner without CAP_LEASE, leases disabled, a filesystem without them)."""
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        return None  # leases are for regular files (a FIFO's is refused as if in use)
    try:
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_WRLCK)
    except BlockingIOError:
        return True
    except OSError:
        return None
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


def remove_files_of_dead_processes(
    directory: str,
    pattern: re.Pattern[str],
    what: str,
    *,
    mapped_by: Callable[[list[str]], MappingJudge] | None = None,
    kept: list[str] | None = None,
) -> list[str]:
    """Unlink entries of ``directory`` matching ``pattern`` (group 1 = creator pid) whose
    creator is gone; returns the names removed.  ``mapped_by(paths)``, when given, surveys
    the processes mapping those files (called at most once, for all the candidates): a
    file it shows may be in use is left in place (a creator of a release before the
    creator's lock, seen here under another pid or not at all).  ``kept``, when given,
    receives the names of the files of dead-looking creators left in place (each also
    logged with why), so that the caller can count them."""
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    candidates = [(entry, int(match.group(1))) for entry in entries if (match := pattern.match(entry))]
    paths = [os.path.join(directory, entry) for entry, _ in candidates]
    mapped = _OneSurvey(mapped_by, paths) if mapped_by is not None else None
    for entry, pid in candidates:
        path = os.path.join(directory, entry)
        if pid == os.getpid():
            # Not proof of life either: a predecessor killed in a container often had the
            # pid this process has now.  This process's own files are known by inode, and
            # none is being created meanwhile.
            with _own_creations:
                try:
                    info = os.lstat(path)
                except FileNotFoundError:
                    continue
                if (info.st_dev, info.st_ino) in _own_files:
                    continue
                outcome = _remove_if_unlocked(path, mapped)
        elif process_exists(pid):
            continue
        else:
            outcome = _remove_if_unlocked(path, mapped)
        if outcome is None:  # removed by someone else meanwhile
            continue
        if outcome:
            logger.info("%s %s of process %d left in place: %s", what, path, pid, outcome)
            if kept is not None:
                kept.append(entry)
            continue
        logger.warning("removed stale %s %s left by dead process %d", what, path, pid)
        removed.append(entry)
    return removed
