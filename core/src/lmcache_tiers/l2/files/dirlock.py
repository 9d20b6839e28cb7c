"""One server per cache directory: a lock that deleting the directory does not undo.

File stores delete files they consider theirs (orphaned temporaries, damaged records,
everything when persistence is off); a second process on the same directory would lose
data to that.  Two ``flock`` locks guard a directory, both released by the kernel when the
process dies (even by SIGKILL), so a restart after a crash is never blocked:

* one on a lock file *outside* the directory, in the user's runtime directory, named from
  the directory's real path: removing and re-creating the directory (``rm -rf`` while a
  server runs) gives a second server the same lock file, which it cannot take;
* one on the directory itself (its inode, through an ``O_DIRECTORY`` descriptor), which
  catches another user's server, or another path (a bind mount) to the same directory.

The lock file records the holder's pid, so the refusal can name it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import threading

from lmcache_tiers.errors import ConfigError

log = logging.getLogger("lmcache_tiers.l2.files")

__all__ = [
    "LOCK_DIR_ENV",
    "DirectoryInUseError",
    "DirectoryLock",
    "PathLock",
    "ProcessClaim",
    "lock_directory",
]

#: overrides where lock files go (tests; hosts whose runtime directory is not writable)
LOCK_DIR_ENV = "LMCACHE_TIERS_LOCK_DIR"

# One process holds a lock at most once: a second holder in the same process (two adapters
# on one directory) is refused like another process, before flock is even tried.
_held: set[str] = set()
_held_lock = threading.Lock()


class DirectoryInUseError(ConfigError):
    """Another server (or adapter) holds the lock; ``holder_pid`` when it is known."""

    def __init__(self, message: str, *, holder_pid: int | None, directory: str) -> None:
        super().__init__(message)
        self.holder_pid = holder_pid
        self.directory = directory


def lock_directory() -> str:
    """Where lock files live: ``$LMCACHE_TIERS_LOCK_DIR``, else ``$XDG_RUNTIME_DIR/lmcache-tiers``,
    else a per-user directory in the system temp directory."""
    override = os.environ.get(LOCK_DIR_ENV)
    if override:
        return override
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "lmcache-tiers")
    return os.path.join(tempfile.gettempdir(), f"lmcache-tiers-{os.getuid()}")


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").split()
        return int(text[0]) if text else None
    except (OSError, ValueError):
        return None


class ProcessClaim:
    """``identity`` claimed by one adapter of this process at a time (the whole lock of
    stores that live in the process, such as fsspec's ``memory://``)."""

    def __init__(self, identity: str, *, what: str) -> None:
        self.identity = identity
        with _held_lock:
            if identity in _held:
                raise DirectoryInUseError(
                    f"{what} is already used by another adapter of this server; "
                    "give each adapter its own directory",
                    holder_pid=os.getpid(),
                    directory=identity,
                )
            _held.add(identity)
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            with _held_lock:
                _held.discard(self.identity)


class PathLock:
    """An exclusive ``flock`` on the lock file of ``identity`` (any string, e.g. a path)."""

    def __init__(self, identity: str, *, what: str) -> None:
        directory = lock_directory()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        self.path = os.path.join(directory, f"{digest}.lock")
        self.identity = identity
        self._claim = ProcessClaim(identity, what=what)
        try:
            self._fd = self._acquire(what)
        except BaseException:
            self._claim.release()
            raise

    def _acquire(self, what: str) -> int:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pid = _read_pid(fd)
                os.close(fd)
                holder = f" (pid {pid})" if pid else ""
                raise DirectoryInUseError(
                    f"{what} is in use by another lmcache-tiers server{holder}; "
                    "give each server its own directory",
                    holder_pid=pid,
                    directory=self.identity,
                ) from None
            # The previous holder may have unlinked the file between our open and flock:
            # then we hold a lock nobody else can find; start over on the current file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"{os.getpid()} {self.identity}\n".encode("utf-8", "surrogateescape"), 0)
                return fd
            os.close(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        # Unlinking while still holding the lock: a process that opened the file before
        # the unlink finds it is no longer the current one (see _acquire) and retries.
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(fd)
        self._claim.release()


class DirectoryLock:
    """The single-server lock of a local cache directory (created if missing)."""

    def __init__(self, root: str, *, what: str | None = None) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = os.path.realpath(root)
        self.what = what or self.root
        self._path_lock = PathLock(self.root, what=self.what)
        self._dir_fd = -1
        try:
            self._lock_inode()
        except BaseException:
            self._path_lock.release()
            raise

    def _lock_inode(self) -> None:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DirectoryInUseError(
                f"{self.what} is in use by another lmcache-tiers server (another user's, or "
                "through another path); give each server its own directory",
                holder_pid=None,
                directory=self.root,
            ) from None
        except OSError as exc:  # a filesystem without flock on directories: the file lock stands
            os.close(fd)
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
                raise
            return
        self._dir_fd = fd

    def root_recreated(self) -> None:
        """The directory was removed and created again: lock the new inode too."""
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        try:
            self._lock_inode()
        except ConfigError as exc:
            # The path lock is still ours, so no server of this user writes in there.
            log.warning("%s was re-created and %s", self.root, exc)

    def release(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1
        self._path_lock.release()
