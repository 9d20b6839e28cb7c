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

:func:`probe_directory` asks, before the server builds anything (its pre-flight, before L1
is pre-faulted), whether :class:`DirectoryLock` would be refused now: it tries both locks
and lets go at once, keeping nothing and creating nothing.  The open stays the authority
(a holder may appear in between); the probe only makes the usual refusal early and cheap.
Within :func:`preflight_claims` (one pre-flight of a whole config), a directory -- or any
identity passed to :func:`claim_in_preflight`, such as a device -- named by two adapters
is refused at the second, as the open would refuse it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Iterator
from contextvars import ContextVar

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.files.durable import fsync_directory, make_directories

log = logging.getLogger("lmcache_tiers.l2.files")

__all__ = [
    "LOCK_DIR_ENV",
    "DirectoryInUseError",
    "DirectoryLock",
    "PathLock",
    "ProcessClaim",
    "claim_in_preflight",
    "lock_directory",
    "preflight_claims",
    "probe_directory",
    "probe_path_lock",
    "probe_process_claim",
]

#: overrides where lock files go (tests; hosts whose runtime directory is not writable)
LOCK_DIR_ENV = "LMCACHE_TIERS_LOCK_DIR"

# One process holds a lock at most once: a second holder in the same process (two adapters
# on one directory) is refused like another process, before flock is even tried.
_held: set[str] = set()
_held_lock = threading.Lock()

#: identities claimed so far by the adapters of one pre-flight (None: not in one)
_preflight_claims: ContextVar[set[str] | None] = ContextVar("lmcache_tiers_preflight_claims", default=None)


# -- the refusals, worded once for the locks and their probes ----------------------------------


def _used_in_process(what: str) -> str:
    return f"{what} is already used by another adapter of this server; give each adapter its own directory"


def _used_by_server(what: str, pid: int | None) -> str:
    holder = f" (pid {pid})" if pid else ""
    return f"{what} is in use by another lmcache-tiers server{holder}; give each server its own directory"


def _used_elsewhere(what: str) -> str:
    return (
        f"{what} is in use by another lmcache-tiers server (another user's, or "
        "through another path); give each server its own directory"
    )


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


def _lock_file(identity: str) -> str:
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:32]
    return os.path.join(lock_directory(), f"{digest}.lock")


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
                raise DirectoryInUseError(_used_in_process(what), holder_pid=os.getpid(), directory=identity)
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
        os.makedirs(lock_directory(), mode=0o700, exist_ok=True)
        self.path = _lock_file(identity)
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
                raise DirectoryInUseError(
                    _used_by_server(what, pid), holder_pid=pid, directory=self.identity
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
    """The single-server lock of a local cache directory (created if missing; with
    ``durable``, each directory created is fsynced into its parent)."""

    def __init__(self, root: str, *, what: str | None = None, durable: bool = False) -> None:
        make_directories(root, fsync_directory if durable else None)
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
                _used_elsewhere(self.what), holder_pid=None, directory=self.root
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


# -- probes: would the locks be refused now? (pre-flight; nothing kept, nothing created) -------


@contextlib.contextmanager
def preflight_claims() -> Iterator[None]:
    """One pre-flight of a config: within it, :func:`probe_directory` and
    :func:`claim_in_preflight` refuse an identity an earlier adapter claimed."""
    token = _preflight_claims.set(set())
    try:
        yield
    finally:
        _preflight_claims.reset(token)


def claim_in_preflight(identity: str, message: str) -> None:
    """Within :func:`preflight_claims`: raise :class:`DirectoryInUseError` with ``message``
    if an earlier adapter of the config claimed ``identity``, else claim it.  Outside one,
    nothing is checked."""
    claimed = _preflight_claims.get()
    if claimed is None:
        return
    if identity in claimed:
        raise DirectoryInUseError(message, holder_pid=os.getpid(), directory=identity)
    claimed.add(identity)


def _probe_flock(fd: int) -> bool:
    """True when ``fd``'s file is locked by someone else; our try is let go at once."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a filesystem without flock: the open will say what it says
        return False
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _check_unclaimed(identity: str, what: str) -> None:
    """Raise :class:`DirectoryInUseError` when an adapter of this process holds ``identity``."""
    with _held_lock:
        if identity in _held:
            raise DirectoryInUseError(_used_in_process(what), holder_pid=os.getpid(), directory=identity)


def probe_process_claim(identity: str, *, what: str) -> None:
    """Raise :class:`DirectoryInUseError`, worded as :class:`ProcessClaim` words it, when
    ``ProcessClaim(identity, what=what)`` would be refused now (an adapter of this process
    holds it) or an earlier adapter of the same pre-flight claimed it."""
    claim_in_preflight(identity, _used_in_process(what))
    _check_unclaimed(identity, what)


def probe_path_lock(identity: str, *, what: str) -> None:
    """Raise :class:`DirectoryInUseError` when ``PathLock(identity)`` would be refused now:
    an adapter of this process holds it, or a live process holds its lock file (the
    refusal names its pid).  The lock file is opened read-only if it exists -- a missing
    one is a free lock -- and neither created nor written."""
    _check_unclaimed(identity, what)
    try:
        fd = os.open(_lock_file(identity), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # missing (free), or unreadable: the open is the authority
        return
    try:
        if _probe_flock(fd):
            pid = _read_pid(fd)
            raise DirectoryInUseError(_used_by_server(what, pid), holder_pid=pid, directory=identity)
    finally:
        os.close(fd)


def probe_directory(root: str, *, what: str | None = None) -> None:
    """Raise :class:`DirectoryInUseError`, worded as :class:`DirectoryLock` words it, when
    ``DirectoryLock(root, what=what)`` would be refused now: by an earlier adapter of the
    same pre-flight (:func:`preflight_claims`), an adapter of this process, another live
    process holding the lock file, or one holding the directory itself (another user's, a
    second path).  Both locks are tried and let go at once; nothing is created, so a
    directory that does not exist yet is free unless its lock file is held (a directory
    removed under a running server)."""
    real = os.path.realpath(root)
    what = what or real
    claim_in_preflight(f"directory:{real}", _used_in_process(what))
    probe_path_lock(real, what=what)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # missing, or not a directory: the pre-flight's path checks say what
        return
    try:
        if _probe_flock(fd):
            raise DirectoryInUseError(_used_elsewhere(what), holder_pid=None, directory=real)
    finally:
        os.close(fd)
