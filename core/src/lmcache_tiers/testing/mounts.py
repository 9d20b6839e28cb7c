"""Mounting a private tmpfs (huge pages, a small size, read-only) -- or another in-memory
filesystem such as ramfs -- for tests and benchmarks.

Mounting needs root (or CAP_SYS_ADMIN); where the system refuses, :func:`mount_tmpfs`
says why in one line instead of raising, so a test can skip with that reason and a
benchmark can print it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator


def mount_tmpfs(directory: str, options: str, fstype: str = "tmpfs") -> str | None:
    """Mount a fresh tmpfs (or ``fstype``) on the existing ``directory`` with ``options``
    (``mount -o``); None once mounted, else the reason the system refused."""
    try:
        result = subprocess.run(
            ["mount", "-t", fstype, "-o", options, fstype, directory],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run mount: {exc}"
    if result.returncode != 0:
        return f"mount -t {fstype} -o {options} refused: {(result.stderr or result.stdout).strip()}"
    return None


def unmount(directory: str) -> None:
    """Unmount ``directory`` (lazily if something still has it open)."""
    result = subprocess.run(["umount", directory], capture_output=True, timeout=30, check=False)
    if result.returncode != 0:
        subprocess.run(["umount", "-l", directory], capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def tmpfs_at(directory: str, options: str, fstype: str = "tmpfs") -> Iterator[str | None]:
    """Create ``directory``, mount a tmpfs (or ``fstype``) there for the block and remove
    both after; yields None when mounted, else the reason (then nothing is mounted)."""
    os.makedirs(directory, exist_ok=True)
    refused = mount_tmpfs(directory, options, fstype)
    try:
        yield refused
    finally:
        if refused is None:
            unmount(directory)
        with contextlib.suppress(OSError):
            os.rmdir(directory)
