"""What the L1 arena and its clients need to know about tmpfs: which filesystem a file
is on, how the tmpfs holding a directory hands out huge pages, and how much of a mapping
the kernel actually maps with them.

Only Linux answers these questions; elsewhere every function says "unknown" (None, or no
mount), and callers treat that as "no huge pages", which is always safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

#: where POSIX shared memory lives, and the L1 segment unless ``--shm-dir`` says otherwise
SHM_DIR = "/dev/shm"
#: ``f_type`` of a tmpfs (and of /dev/shm) in statfs(2)
TMPFS_MAGIC = 0x01021994
#: the ``huge=`` values of a tmpfs mount that give huge pages (``advise`` only to
#: mappings that ask with ``madvise(MADV_HUGEPAGE)``)
HUGE_MODES = ("always", "within_size", "advise")
_DEFAULT_HUGE_PAGE = 2 << 20
_THP = "/sys/kernel/mm/transparent_hugepage"
_VMA_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ")


def libc_function(name: str, argtypes: tuple[Any, ...]) -> Any:
    """The C library's ``name`` (returning int, errno kept for ``ctypes.get_errno``) through
    ctypes, which releases the GIL for the call; None off Linux or where it is missing."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        function = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    return function


_fstatfs = libc_function("fstatfs", (ctypes.c_int, ctypes.c_void_p))


def fs_magic(fd: int) -> int | None:
    """The statfs ``f_type`` of the filesystem ``fd`` is on (None where unknown)."""
    if _fstatfs is None:
        return None
    # struct statfs starts with f_type (a C long on every Linux ABI this runs on); the
    # buffer is larger than the struct on any of them.
    buffer = ctypes.create_string_buffer(512)
    if _fstatfs(fd, buffer) != 0:
        return None
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


def is_tmpfs(path: str) -> bool:
    """True if ``path`` (a file or directory) is on a tmpfs."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return fs_magic(fd) == TMPFS_MAGIC
    finally:
        os.close(fd)


def huge_page_size() -> int:
    """Bytes of one PMD-mapped huge page (2 MiB on x86-64)."""
    try:
        with open(f"{_THP}/hpage_pmd_size", encoding="ascii") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return _DEFAULT_HUGE_PAGE


def shmem_override() -> str:
    """``deny`` or ``force`` when the system setting overrides every tmpfs mount's
    ``huge=`` option (``shmem_enabled``), else ""."""
    try:
        with open(f"{_THP}/shmem_enabled", encoding="ascii") as handle:
            text = handle.read()
    except OSError:
        return ""
    chosen = re.search(r"\[(\w+)\]", text)
    value = chosen.group(1) if chosen else ""
    return value if value in ("deny", "force") else ""


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo: where, which filesystem, its options."""

    point: str
    fstype: str
    options: tuple[str, ...]

    @property
    def huge(self) -> str:
        """The tmpfs ``huge=`` option ("never" when absent)."""
        for option in self.options:
            if option.startswith("huge="):
                return option[len("huge=") :]
        return "never"


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash as octal escapes
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def mount_of(path: str) -> Mount | None:
    """The mount holding ``path`` (the innermost, most recent one), or None where
    /proc/self/mountinfo cannot be read."""
    target = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    best: Mount | None = None
    for line in lines:
        head, _, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if len(fields) < 6 or len(rest) < 3:
            continue
        point = _unescape(fields[4])
        inside = target == point or point == "/" or target.startswith(point.rstrip("/") + "/")
        # later lines are mounted on top of earlier ones at the same point
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, rest[0], tuple(fields[5].split(",")) + tuple(rest[2].split(",")))
    return best


def pmd_mapped_bytes(address: int, length: int, smaps: str = "/proc/self/smaps") -> int | None:
    """Bytes of ``[address, address + length)``'s mappings that the kernel maps with huge
    pages (ShmemPmdMapped + FilePmdMapped of every mapping overlapping the range), from
    ``smaps`` (another process's: ``/proc/<pid>/smaps``); None where it cannot be read."""
    try:
        with open(smaps, encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    total, inside = 0, False
    end = address + length
    for line in lines:
        header = _VMA_HEADER.match(line)
        if header is not None:
            start, stop = int(header.group(1), 16), int(header.group(2), 16)
            inside = start < end and address < stop
        elif inside and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
            total += int(line.split()[1]) * 1024
    return total
