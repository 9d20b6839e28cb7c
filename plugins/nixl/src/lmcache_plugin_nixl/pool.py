"""nixl_store's storage: a fixed pool of slots created and registered once at start-up.

File backends get one file per slot in ``file_path`` (``nixl-pool-000000.bin`` ...), all
opened and registered with NIXL in a single call; an object always starts at offset 0 of
its slot's file, which grows to fit it.  Object backends (OBJ, AZURE_BLOB) get one object
key per slot, registered the same way.  The pool does not outlive the adapter: slot files
are truncated when it starts and removed when it closes.

With ``use_direct_io`` each slot file is opened twice, with and without ``O_DIRECT``:
transfers whose memory address and length are 4096-aligned (KV chunks in the L1 arena
usually are) bypass the page cache, others take the buffered descriptor rather than fail
with EINVAL.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import resource
from typing import Protocol

from lmcache_plugin_nixl.availability import check_direct_io
from lmcache_plugin_nixl.memory import direct_io_ok
from lmcache_plugin_nixl.runtime import NixlRuntime, Registration
from lmcache_tiers.plugin import DirectoryInUseError, DirectoryLock, FieldError, ProcessClaim

log = logging.getLogger(__name__)

_OBJECT_PREFIX = "lmcache-tiers-nixl-pool"


def lock_what(directory: str) -> str:
    """How the directory lock and its pre-flight probe name the pool's directory."""
    return f"the nixl_store directory {os.path.abspath(directory)}"


def object_pool_identity(backend: str) -> str:
    """What one nixl_store adapter of a process holds alone on an object backend: NIXL
    takes one set of parameters per backend and process, so every adapter on ``backend``
    names the same bucket (container) and would write the same fixed object names."""
    return f"nixl_store-object-pool:{backend}"


def object_pool_taken(backend: str) -> str:
    """The refusal of a second nixl_store adapter on the object backend ``backend``."""
    where = "container" if backend == "AZURE_BLOB" else "bucket"
    return (
        f"another nixl_store adapter of this server keeps its pool in the {backend} backend, "
        f"whose objects ({_OBJECT_PREFIX}-000000 ...) this one would overwrite: NIXL gives every "
        f"adapter on {backend} the same parameters, so the same {where}; configure one "
        f"nixl_store adapter per object backend"
    )


def slot_file_name(slot: int) -> str:
    return f"nixl-pool-{slot:06d}.bin"


_SLOT_FILE = re.compile(r"nixl-pool-(\d{6,})\.bin")


def _remove_slots_beyond(directory: str, pool_size: int) -> None:
    """Remove slot files a larger pool left here: a server killed before its close kept
    them, and this pool neither truncates nor removes slots it does not have."""
    for name in os.listdir(directory):
        match = _SLOT_FILE.fullmatch(name)
        if match is None or int(match.group(1)) < pool_size or name != slot_file_name(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            pass
        except OSError as exc:  # never served: not worth refusing to start over
            log.warning("cannot remove %s, a slot file of an earlier, larger pool: %s", name, exc)


class SlotStorage(Protocol):
    """Where slot ``i`` lives, as NIXL addresses it."""

    storage_mem: str

    def device(self, slot: int, address: int, length: int) -> int:
        """The NIXL device id (fd or object id) to transfer ``length`` bytes at ``address``."""
        ...

    def written(self, slot: int, length: int) -> None:
        """Record that slot now holds ``length`` bytes."""
        ...

    def held_bytes(self, slot: int) -> int | None:
        """How many bytes the slot holds in storage now, None when that cannot be told."""
        ...

    def no_space_for(self, slot: int, length: int) -> OSError | None:
        """After a failed write: the error when the slot's storage has no room for
        ``length`` bytes (ENOSPC, EDQUOT), else None."""
        ...

    def close(self) -> int:
        """Release the slots (once); how many files failed to close (each logged)."""
        ...


def _ensure_fd_budget(needed: int) -> None:
    """Raise the soft open-file limit if the pool needs it, or explain why it cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Headroom for sockets, the arena, per-operation files of other adapters.
    wanted = needed + 256
    if soft != resource.RLIM_INFINITY and soft < wanted:
        if hard != resource.RLIM_INFINITY and hard < wanted:
            raise FieldError(
                "pool_size",
                f"nixl_store needs {needed} open files for its pool but the open-file limit is "
                f"{hard}; lower pool_size or raise the limit (ulimit -n)",
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


class FileSlots:
    """One preallocated file per slot, registered with NIXL once."""

    storage_mem = "FILE"

    def __init__(
        self, runtime: NixlRuntime, backend: str, directory: str, pool_size: int, direct_io: bool
    ) -> None:
        self.directory = os.path.abspath(directory)
        os.makedirs(self.directory, exist_ok=True)
        self._lock = DirectoryLock(self.directory, what=lock_what(self.directory))
        self._buffered: list[int] = []
        self._direct: list[int] = []
        self._registration: Registration | None = None
        try:
            if direct_io:
                check_direct_io(self.directory)
            _ensure_fd_budget(pool_size * (2 if direct_io else 1))
            _remove_slots_beyond(self.directory, pool_size)
            flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
            for slot in range(pool_size):
                path = os.path.join(self.directory, slot_file_name(slot))
                # O_TRUNC: bytes a previous server left in the slot are never served.
                self._buffered.append(os.open(path, flags | os.O_TRUNC, 0o644))
                if direct_io:
                    self._direct.append(os.open(path, flags | os.O_DIRECT, 0o644))
            self._registration = runtime.register_files(backend, self._buffered + self._direct)
        except BaseException:
            self._close_files(remove=True)
            raise

    def device(self, slot: int, address: int, length: int) -> int:
        if self._direct and direct_io_ok(address, length, 0):
            return self._direct[slot]
        return self._buffered[slot]

    def written(self, slot: int, length: int) -> None:
        # A smaller object must not leave the tail of a larger one on disk, nor of a write
        # that failed or was abandoned part way (no store recorded its length): the file's
        # own size says what is there.
        fd = self._buffered[slot]
        if os.fstat(fd).st_size > length:
            os.ftruncate(fd, length)

    def held_bytes(self, slot: int) -> int | None:
        try:
            return os.fstat(self._buffered[slot]).st_size
        except OSError:
            return None

    def no_space_for(self, slot: int, length: int) -> OSError | None:
        # Asked only after a write failed, so the allocation costs nothing on the way of
        # stores that succeed; blocks it does get stay with the free slot.
        try:
            os.posix_fallocate(self._buffered[slot], 0, length)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                return exc
        return None

    def _close_files(self, *, remove: bool) -> int:
        """Close every slot descriptor, remove the files if asked and unlock the directory;
        how many descriptors failed to close.  One failing close stops none of the rest:
        the other files would stay open, and the directory locked, until the process ends."""
        failures = 0
        for fd in self._buffered + self._direct:
            try:
                os.close(fd)
            except OSError as exc:
                failures += 1
                log.warning("slot file descriptor %d of %s could not be closed: %s", fd, self.directory, exc)
        if remove:
            self._remove_slot_files()
        self._buffered, self._direct = [], []
        self._lock.release()
        return failures

    def _remove_slot_files(self) -> None:
        """Unlink every slot file; those that fail are truncated by the next start on this
        directory.  One line for all of them: a pool of many slots in a directory gone
        read-only must not log a line a slot."""
        failed: list[tuple[int, OSError]] = []
        for slot in range(len(self._buffered)):
            try:
                os.unlink(os.path.join(self.directory, slot_file_name(slot)))
            except FileNotFoundError:
                pass
            except OSError as exc:
                failed.append((slot, exc))
        if failed:
            slot, first = failed[0]
            log.warning(
                "%d of %d slot files of %s could not be removed (slot %d: %s); the next start "
                "on this directory truncates them",
                len(failed),
                len(self._buffered),
                self.directory,
                slot,
                first,
            )

    def close(self) -> int:
        if self._registration is not None:
            self._registration.release()
            self._registration = None
        if self._buffered:
            return self._close_files(remove=True)
        return 0


class ObjectSlots:
    """One object key per slot in an object store, registered with NIXL once.

    The keys are fixed (``lmcache-tiers-nixl-pool-000000`` ...), so a server overwrites
    its own previous pool instead of leaking objects; one bucket or container per server,
    and one pool per object backend in a server (:func:`object_pool_identity`), held
    until :meth:`close`.
    """

    storage_mem = "OBJ"

    def __init__(self, runtime: NixlRuntime, backend: str, pool_size: int) -> None:
        try:
            self._claim = ProcessClaim(object_pool_identity(backend), what=f"the {backend} object pool")
        except DirectoryInUseError:
            raise FieldError("backend", object_pool_taken(backend)) from None
        try:
            self._registration: Registration | None = runtime.register_objects(
                backend, [(slot, f"{_OBJECT_PREFIX}-{slot:06d}") for slot in range(pool_size)]
            )
        except BaseException:
            self._claim.release()
            raise

    def device(self, slot: int, address: int, length: int) -> int:
        return slot

    def written(self, slot: int, length: int) -> None:
        return None

    def held_bytes(self, slot: int) -> int | None:
        return None

    def no_space_for(self, slot: int, length: int) -> OSError | None:
        return None

    def close(self) -> int:
        try:
            if self._registration is not None:
                self._registration.release()
                self._registration = None
        finally:
            self._claim.release()  # once the objects are no longer this pool's to write
        return 0
