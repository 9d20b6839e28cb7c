"""The arena's segment file: its directory checked, created whole, on huge pages where the
tmpfs holding it offers them, and pre-faulted.

A client's first copy into a fresh mapping of the arena pays one page fault per page it
touches.  With 4 KiB pages that is ~2 ms of CPU per 32 MiB (several times the memcpy);
with 2 MiB pages it is 512 times fewer faults, and a fresh client's first store runs near
memcpy speed (``bench/bench_workload.py --huge-tmpfs``).  tmpfs hands out huge pages per
mount (``huge=always|within_size|advise``, ``advise`` only to mappings that ask with
``madvise(MADV_HUGEPAGE)``) unless the system setting ``shmem_enabled`` says ``deny``
(none) or ``force`` (all).  The arena takes them
wherever they are offered: on such a mount the segment is rounded up to whole huge pages,
and after pre-faulting the server reads its own ``/proc/self/smaps`` to say whether the
kernel really mapped it with them (it falls back to 4 KiB pages when memory is too
fragmented).  Nothing else changes with the page size: bytes, offsets, clients and
their population of the mapping all work the same on either.

The whole segment is reserved at start-up (``posix_fallocate``, or pre-faulting on an
``advise`` mount, whose huge pages only a mapping can ask for), so a tmpfs too small for
it is a one-line error here instead of a SIGBUS on some later write.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import re
from dataclasses import dataclass
from typing import Any

from lmcache_tiers.errors import ConfigError, SettingRefused
from lmcache_tiers.l1.stale import create_as_creator, creator_lock_held, release_as_creator
from lmcache_tiers.tmpfs import (
    HUGE_MODES,
    huge_page_size,
    is_tmpfs,
    mount_of,
    pmd_mapped_bytes,
    shmem_override,
)

# Not exported by the mmap module before Python 3.13; the values are fixed by the Linux ABI.
# Populating page tables in one madvise call is the cheapest way to pre-fault (kernel >= 5.14).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class ArenaPages:
    """How the arena's memory is paged: what the tmpfs offers and what the kernel gave."""

    directory: str
    #: ``huge=`` of the tmpfs holding the directory ("never" when none), or the system's
    #: ``deny``/``force`` when it overrides every mount
    offered: str
    #: bytes of the server's mapping PMD-mapped after pre-faulting; None: not checked
    #: (no pre-fault, or smaps unreadable)
    huge_bytes: int | None
    size: int
    huge_page: int

    @property
    def huge(self) -> bool:
        """True when (nearly) the whole arena is mapped with huge pages."""
        return self.huge_bytes is not None and self.huge_bytes * 2 >= self.size

    def hint(self) -> str | None:
        """One line on how to get huge pages, when the arena is not on them."""
        if self.huge:
            return None
        if self.offered == "deny":
            return (
                "huge pages are off for every tmpfs (shmem_enabled=deny); "
                "set it to advise or never to let mounts choose"
            )
        if self.offered in HUGE_MODES or self.offered == "force":
            if self.huge_bytes is None:
                return "huge pages are offered but the mapping was not checked (no pre-fault)"
            return (
                f"the tmpfs offers huge pages (huge={self.offered}) but the kernel mapped 4 KiB "
                "ones (memory too fragmented?); restarting once memory is free may help"
            )
        return (
            f"for huge pages (a fresh client's first store near memcpy speed) mount a tmpfs with "
            f"huge=always (mount -t tmpfs -o huge=always,size=<L1 size + 1G> tmpfs DIR) and pass "
            f"--shm-dir DIR, or remount {self.directory} with huge=always"
        )

    def describe(self) -> str:
        if self.huge:
            return f"{self.huge_page >> 20} MiB huge pages (tmpfs huge={self.offered})"
        return "4 KiB pages"

    def status(self) -> dict[str, Any]:
        return {
            "directory": self.directory,
            "huge_pages": self.huge,
            "tmpfs_huge": self.offered,
            "huge_page_mapped_bytes": self.huge_bytes,
            "hint": self.hint(),
        }


def check_directory(directory: str, setting: str = "l1_shm_dir") -> None:
    """Raise SettingRefused (one line, naming ``setting`` by its config key: ``serve``
    names the flag instead when one set it) unless ``directory`` is an existing, writable
    directory on a tmpfs given by an absolute path."""
    if not os.path.isabs(directory):
        raise SettingRefused(setting, directory, "give an absolute path")
    if not os.path.exists(directory):
        raise SettingRefused(setting, directory, "does not exist; create it (a tmpfs mount) first")
    if not os.path.isdir(directory):
        raise SettingRefused(setting, directory, "is a file, not a directory")
    try:
        on_tmpfs = is_tmpfs(directory)
    except OSError as exc:
        raise SettingRefused(setting, directory, f"cannot open it: {exc.strerror}") from None
    if not on_tmpfs:
        raise SettingRefused(
            setting,
            directory,
            "not on a tmpfs; the L1 arena must be shared memory "
            f"(mount -t tmpfs -o huge=always,size=... tmpfs {directory})",
        )
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SettingRefused(setting, directory, "not writable by this user (or mounted read-only)")


def offered_huge(directory: str) -> str:
    """What the tmpfs holding ``directory`` offers (see :attr:`ArenaPages.offered`)."""
    override = shmem_override()
    if override:
        return override
    mount = mount_of(directory)
    return mount.huge if mount is not None and mount.fstype == "tmpfs" else "never"


def file_bytes(size: int, directory: str) -> int:
    """The size of the file a segment of ``size`` bytes takes in ``directory``: rounded up
    to whole huge pages where the tmpfs offers them (a partial one would be 4 KiB pages)."""
    offered = offered_huge(directory)
    if offered in HUGE_MODES or offered == "force":
        page = huge_page_size()
        return -(-size // page) * page
    return size


def create_segment(
    path: str, size: int, directory: str, *, prefault: bool
) -> tuple[mmap.mmap, ArenaPages, int]:
    """Create the segment file ``path`` (``O_EXCL``) of at least ``size`` bytes, reserve
    and map it, pre-fault it if asked; the caller unlinks ``path`` on failure only after
    this returned.  The mapping's length is the file's (rounded up to whole huge pages on
    a mount that offers them).  Also returns the file's descriptor, which holds the
    creator's lock (:func:`~lmcache_tiers.l1.stale.hold_as_creator`): the caller keeps it
    open until the name is unlinked, then closes it with
    :func:`~lmcache_tiers.l1.stale.release_as_creator`."""
    offered = offered_huge(directory)
    size = file_bytes(size, directory)
    try:
        # A tmpfs takes flock: without the lock (a passing ENOLCK) the live segment could
        # be reaped by another server's start-up.
        fd = create_as_creator(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, lock_required=True)
    except FileExistsError:
        raise ConfigError(_name_taken(path)) from None
    try:
        segment = _reserve_and_map(fd, size, directory, advise=offered == "advise", prefault=prefault)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        release_as_creator(fd)
        raise
    huge_bytes = pmd_mapped_bytes(address_of(segment), size) if prefault else None
    return segment, ArenaPages(directory, offered, huge_bytes, size, huge_page_size()), fd


def _name_taken(path: str) -> str:
    """Why ``path`` cannot be created, telling a live server's segment from one left
    behind by the creator's lock.  Never removed here, even when nothing holds it: a
    custom name carries no pid, and the file could be another program's (fail closed)."""
    held = creator_lock_held(path)
    if held is True:
        return (
            f"shared-memory segment {path} already exists and a live server holds it: "
            "stop that server or pick another name"
        )
    if held is False:
        users, unreadable = processes_mapping(path)
        if users:
            # Servers before the creator's lock (28c5b5b) hold none: a mapping
            # is what shows such a live server, whose segment must not be removed.
            return (
                f"shared-memory segment {path} already exists and process {users[0]} maps it "
                "(a server of an earlier release, which holds no creator's lock, or another "
                "program): stop it or pick another name"
            )
        if unreadable:
            # Another user's process: its maps are not ours to read, and a live server of
            # an earlier release among them would look exactly like a killed one's file.
            return (
                f"shared-memory segment {path} already exists and holds no creator's lock; "
                f"{unreadable} processes' maps could not be read (another user's), so a "
                "server of an earlier release may still map it: remove it only once no "
                "server uses it, or pick another name"
            )
        return (
            f"shared-memory segment {path} already exists and nothing holds it: left by a server "
            f"that was killed (or made by another program); remove {path} if it is this "
            "server's, or pick another name"
        )
    return (
        f"shared-memory segment {path} already exists ({held}): another server uses this name, "
        "or a killed one left it behind (remove the file if it is this server's, or pick another name)"
    )


def processes_mapping(path: str) -> tuple[list[int], int]:
    """The pids of the processes visible here that map the file ``path`` (by device and
    inode, from ``/proc/<pid>/maps``), and how many other users' processes' maps could
    not be read (such a process may map it unseen).  A process that exits during the
    scan is neither."""
    try:
        info = os.stat(path)
    except OSError:
        return [], 0
    survey = survey_mappings([path])
    # One of our own user's that we may not read (a container's init) is no server of
    # ours: an earlier release's server runs as a plain process, readable by its user.
    others = sum(count for uid, count in survey.unreadable.items() if uid != os.geteuid())
    return survey.mappers.get(_file_id(info), []), others


@dataclass(frozen=True)
class MapsSurvey:
    """What one pass over every ``/proc/<pid>/maps`` showed about a set of files."""

    #: (st_dev, st_ino) -> the sorted pids of the visible processes mapping that file
    mappers: dict[tuple[int, int], list[int]]
    #: uid -> how many of that user's processes' maps could not be read
    unreadable: dict[int, int]

    def why_kept(self, info: os.stat_result, open_elsewhere: bool | None) -> str:
        """Why the file ``info`` (whose creator's lock is free) must stay, "" when nothing
        shows it in use.  ``open_elsewhere`` is what a write lease told: True when another
        open file of it exists somewhere (a mapping holds one), False when none does, None
        when the lease could not be asked for."""
        users = self.mappers.get(_file_id(info), [])
        if users:
            return (
                f"process {users[0]} maps it (a server of an earlier release, which holds no creator's lock?)"
            )
        if open_elsewhere is False:
            return ""
        if open_elsewhere:
            return (
                "another process has it open or mapped, none this start-up can see (a server of "
                "an earlier release in another pid namespace, or a process of another user?)"
            )
        doubtful = self._unreadable_that_could_open(info)
        if not doubtful:
            return ""
        users_named = ", ".join(f"{count} of uid {uid}" for uid, count in sorted(doubtful.items()))
        return (
            f"the maps of processes that may open it could not be read ({users_named}), so a "
            "server of an earlier release may still map it"
        )

    def _unreadable_that_could_open(self, info: os.stat_result) -> dict[int, int]:
        """The unreadable processes, by uid, that could have opened the file: a file only
        its owner may open (mode 0600, as servers create them) can be mapped only by the
        owner's processes and root's; one with group or other bits by anyone's."""
        if info.st_mode & 0o077:
            return dict(self.unreadable)
        return {uid: n for uid, n in self.unreadable.items() if uid in (info.st_uid, 0)}


def survey_mappings(paths: list[str]) -> MapsSurvey:
    """Read every visible process's maps once and find which of ``paths`` each maps (by
    device and inode; a path gone meanwhile is left out).  A process that exits during
    the pass is neither a mapper nor unreadable."""
    places: dict[str, tuple[int, int]] = {}
    for path in paths:
        try:
            info = os.stat(path)
        except OSError:
            continue
        places[_maps_place(info)] = _file_id(info)
    mappers: dict[tuple[int, int], list[int]] = {}
    unreadable: dict[int, int] = {}
    if not places:
        return MapsSurvey(mappers, unreadable)
    # The device and inode fields of a maps line (after address, perms and offset); one
    # search over a whole maps file: a big process has thousands of lines, and a host
    # thousands of processes.
    line_of = re.compile(
        r"^\S+ \S+ \S+ (" + "|".join(re.escape(place) for place in places) + r")(?: |$)", re.MULTILINE
    )
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{pid}/maps") as maps:
                found = {match.group(1) for match in line_of.finditer(maps.read())}
        except PermissionError:
            uid = _owner(pid)
            if uid is not None:
                unreadable[uid] = unreadable.get(uid, 0) + 1
            continue
        except OSError:  # gone meanwhile (ENOENT, or ESRCH while reading)
            continue
        for place in found:
            mappers.setdefault(places[place], []).append(pid)
    return MapsSurvey({file: sorted(pids) for file, pids in mappers.items()}, unreadable)


def _file_id(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _maps_place(info: os.stat_result) -> str:
    """The file's "<device> <inode>" as a maps line has it between the offset and the path."""
    return f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x} {info.st_ino}"


def _owner(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except OSError:  # gone meanwhile
        return None


def _reserve_and_map(fd: int, size: int, directory: str, *, advise: bool, prefault: bool) -> mmap.mmap:
    if not advise:
        # huge=always/within_size give huge pages to fallocate itself; the whole file is
        # reserved before anything is mapped.
        _fallocate(fd, size, directory)
        segment = _map(fd, size)
        if prefault:
            _prefault(segment, size, directory)
        return segment
    # huge=advise gives huge pages only to faults through a mapping that asked for them:
    # map, ask, fault everything in, then reserve whatever pre-faulting did not.
    _check_free(size, directory)
    os.ftruncate(fd, size)
    segment = _map(fd, size)
    try:
        segment.madvise(_MADV_HUGEPAGE)
        if prefault:
            _prefault(segment, size, directory)
        _fallocate(fd, size, directory)
    except BaseException:
        segment.close()
        raise
    return segment


def _map(fd: int, size: int) -> mmap.mmap:
    """Map the whole segment; ENOMEM here is the process's address-space limit
    (``ulimit -v``, RLIMIT_AS) or the map count, not the tmpfs (already reserved)."""
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise ConfigError(
            f"cannot map a {size / 2**30:.2f} GiB L1 segment: the process may not map that much "
            "(ulimit -v); lower --l1-size-gb or raise the limit"
        ) from None


def _no_room(size: int, directory: str) -> ConfigError:
    info = os.statvfs(directory)
    free = info.f_bavail * info.f_frsize
    return ConfigError(
        f"cannot place a {size / 2**30:.2f} GiB L1 segment in {directory} ({free / 2**30:.2f} GiB "
        f"free): lower --l1-size-gb or enlarge {directory} (mount -o remount,size=...)"
    )


def _check_free(size: int, directory: str) -> None:
    info = os.statvfs(directory)
    if info.f_bavail * info.f_frsize < size:
        raise _no_room(size, directory)


def _fallocate(fd: int, size: int, directory: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise _no_room(size, directory) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, size)


def _prefault(segment: mmap.mmap, size: int, directory: str) -> None:
    """Touch every page once so the first client write does not pay for page faults.

    First touch costs roughly a second per GB on small VMs; paying it at start-up keeps it
    out of request latency. MADV_POPULATE_WRITE faults the whole range in-kernel (EFAULT:
    the tmpfs ran out of room); older kernels fall back to writing one byte per page.
    """
    try:
        segment.madvise(_MADV_POPULATE_WRITE)
        return
    except OSError as exc:
        if exc.errno == errno.EFAULT:
            raise _no_room(size, directory) from None
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    view = memoryview(segment)
    try:
        for offset in range(0, size, _PAGE):
            view[offset] = 0
    finally:
        view.release()


def address_of(segment: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(segment)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the ctypes object holds a buffer export that would block mmap.close()
