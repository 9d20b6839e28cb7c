"""An exclusive lock on a cache directory, so two servers never share one.

Both adapters delete files they consider theirs (orphaned temporaries, pool slots, or
everything when persistence is off); a second process on the same directory would lose
data to that.  ``flock`` is released by the kernel when a process dies, even by SIGKILL,
so a restart after a crash is never blocked by a stale lock.
"""

from __future__ import annotations

import fcntl
import os

from lmcache_tiers.plugin import ConfigError


class DirectoryLock:
    """Holds ``flock(LOCK_EX)`` on ``<directory>/<name>`` until released."""

    def __init__(self, directory: str, name: str) -> None:
        self.path = os.path.join(directory, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(
                f"{directory} is already used by another NIXL adapter (lock file {self.path} "
                "is held); give each adapter and each server its own file_path"
            ) from None
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        # Unlinking while still holding the lock leaves no moment where another process
        # could lock the old file and then see it vanish.
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
