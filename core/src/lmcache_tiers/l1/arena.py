"""The L1 arena: one named POSIX shared-memory segment, mapped once for the server's lifetime.

The segment lives in ``/dev/shm`` (or the tmpfs directory ``--shm-dir`` names) under a name
local clients can open, so an engine on the same host copies KV bytes straight into and out
of the arena (one copy each way, nothing through the socket); on a tmpfs that offers huge
pages it is on them (:mod:`lmcache_tiers.l1.segment`).  The file is created with
``O_EXCL`` and unlinked by its creator on ``close()``, at garbage collection or at
interpreter exit, whichever comes first; names carry the creator's pid, and the creator
holds a lock on the file for its life, so :func:`remove_stale_segments` can reap what a
killed server left behind and nothing else (:mod:`lmcache_tiers.l1.stale`).

Behind the object bytes the segment may carry a **generation table**: one native-endian
uint64 per ``generation_block`` bytes of arena, bumped by the L1 manager each time an
extent starting in that block goes back to the allocator.  Clients map the whole segment,
so a reader can tell, after copying out of an extent, whether it changed hands meanwhile
(see ``docs/server.md``, "Leases").
"""

from __future__ import annotations

import contextlib
import gc
import logging
import mmap
import os
import re
import secrets
import sys
import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import Self  # annotations only: Python 3.10 has no typing.Self

from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.l1.segment import ArenaPages, address_of, create_segment, survey_mappings
from lmcache_tiers.l1.stale import release_as_creator, remove_files_of_dead_processes
from lmcache_tiers.tmpfs import SHM_DIR

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "lmcache_tiers_"
# The pid as this code writes it: ASCII, no leading zero, and short enough for kill(2)'s
# pid_t (Linux pids stay below 2**22); anyone can create a file in /dev/shm, and a longer
# "pid" made the reaping at start-up fail with OverflowError.  Both patterns end in \Z:
# $ also matches before a final newline.
_DEFAULT_NAME = re.compile(rf"^{SEGMENT_PREFIX}([1-9][0-9]{{0,8}})_[0-9a-f]+\Z")
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}\Z")


def default_segment_name() -> str:
    """``lmcache_tiers_<pid>_<random>``: unique per server, and traceable to its process."""
    return f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"


def _segment_path(name: str, directory: str = SHM_DIR) -> str:
    if not _SAFE_NAME.match(name) or name in (".", ".."):
        raise ConfigError(
            f"shared-memory name {name!r} is not allowed: use 1-200 characters from [A-Za-z0-9._-]"
        )
    return os.path.join(directory, name)


def _pin(segment: mmap.mmap, size: int) -> int | None:
    """Page-lock the arena for GPU DMA via cudaHostRegister; the address, or None if unavailable.

    torch is imported only here: importing it costs seconds and most deployments have no GPU.
    """
    try:
        import torch
    except ImportError:
        logger.info("L1 pinning unavailable (torch is not installed); continuing unpinned")
        return None
    if not torch.cuda.is_available():
        logger.info("L1 pinning unavailable (no CUDA device); continuing unpinned")
        return None
    address = address_of(segment)
    status = _cudart(torch).cudaHostRegister(address, size, 0)
    if int(status) != 0:
        logger.warning("cudaHostRegister of the L1 arena failed (%s); continuing unpinned", status)
        return None
    return address


def _cudart(torch: Any) -> Any:
    # torch's cudart binding is untyped; keep that to one place.
    return torch.cuda.cudart()


def _unpin(address: int) -> None:
    import torch

    status = _cudart(torch).cudaHostUnregister(address)
    if int(status) != 0:
        logger.warning("cudaHostUnregister of the L1 arena failed (%s)", status)


def _views_into(segment: mmap.mmap, value: object) -> bool:
    if not isinstance(value, memoryview):
        return False
    try:
        return value.obj is segment
    except ValueError:  # released
        return False


def _view_holders(segment: mmap.mmap) -> str:
    """Who holds the views still open into ``segment``: functions (file and line) whose
    locals hold one, on any thread, and the types of objects that refer to one; for the
    warning that says the arena could not be unmapped."""
    holders: set[str] = set()
    with warnings.catch_warnings():  # looking at arbitrary objects may touch deprecated ones
        warnings.simplefilter("ignore")
        _find_holders(segment, holders)
    return ", ".join(sorted(holders)[:6]) or "objects the garbage collector does not track"


def _find_holders(segment: mmap.mmap, holders: set[str]) -> None:
    for top in sys._current_frames().values():
        frame: types.FrameType | None = top
        while frame is not None:
            if frame.f_code.co_name not in ("_view_holders", "_find_holders") and any(
                _views_into(segment, value) for value in frame.f_locals.values()
            ):
                code = frame.f_code
                holders.add(f"{code.co_name} ({code.co_filename}:{frame.f_lineno})")
            frame = frame.f_back
    tracked = gc.get_objects()
    for candidate in tracked:
        if _views_into(segment, candidate):
            holders.update(
                type(referrer).__name__
                for referrer in gc.get_referrers(candidate)
                if referrer is not tracked and not isinstance(referrer, types.FrameType)
            )


def _close_segment(segment: mmap.mmap) -> None:
    """Unmap ``segment``.  Views held only by garbage cycles (an exception kept with its
    traceback, whose frames hold buffers) go with one collection; views still referenced
    keep the mapping until they go, which is said once with who holds them."""
    for attempt in range(2):
        try:
            segment.close()
            return
        except BufferError:
            if attempt == 0:
                gc.collect()
    logger.warning(
        "L1 arena closed while memory views into it are still alive (held by %s); "
        "it stays mapped until they are released",
        _view_holders(segment),
    )


def _release(
    segment: mmap.mmap,
    path: str | None,
    owner_pid: int,
    pinned_at: int | None,
    lock_fd: int | None,
    own_views: tuple[memoryview, ...] = (),
) -> None:
    """Finalizer: unpin, unmap and (for the creating process only) unlink the segment,
    then close the descriptor holding the creator's lock (after the unlink, so the name
    never exists unlocked while its creator lives).

    Must not reference the arena object, or the arena could never be collected; it holds
    the arena's own views (``own_views``) instead, released first, so an arena collected
    without ``close`` unmaps cleanly.  A forked child inherits the finalizer; the pid
    check keeps it from unlinking its parent's segment (closing its copy of the
    descriptor leaves the parent's lock in place).
    """
    for view in own_views:
        with contextlib.suppress(BufferError):
            view.release()
    if pinned_at is not None and os.getpid() == owner_pid:
        try:
            _unpin(pinned_at)
        except Exception:  # unpinning is best effort during teardown
            logger.exception("unpinning the L1 arena failed")
    _close_segment(segment)
    if path is not None and os.getpid() == owner_pid:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    if lock_fd is not None:
        release_as_creator(lock_fd)


class L1Arena:
    """One named POSIX shared-memory segment holding every L1 object.

    ``buffer`` is a writable memoryview over the whole arena. The creating process owns the
    segment and unlinks it on :meth:`close`; processes that :meth:`attach` only unmap it.
    """

    name: str
    size: int
    buffer: memoryview
    pinned: bool
    owner: bool
    #: file size: ``size`` plus the generation table, if any
    segment_size: int
    #: byte offset of the generation table in the segment (0: the segment has none)
    generation_offset: int
    #: arena bytes per generation entry (0: no table)
    generation_block: int
    #: the table as uint64 entries (an empty view when there is none)
    generations: memoryview
    #: the directory (a tmpfs) holding the segment file
    directory: str
    #: how the creator's mapping is paged (None in a process that only attached)
    pages: ArenaPages | None

    def __init__(
        self,
        size_bytes: int,
        *,
        name: str | None = None,
        prefault: bool = True,
        pin: bool = False,
        generation_block: int = 0,
        directory: str = SHM_DIR,
    ) -> None:
        if size_bytes <= 0:
            raise ConfigError(f"L1 arena size must be positive, got {size_bytes} bytes")
        if generation_block < 0:
            raise ConfigError(f"generation block must not be negative, got {generation_block}")
        table_offset, segment_size = _layout(size_bytes, generation_block)
        name = default_segment_name() if name is None else name
        path = _segment_path(name, directory)
        segment, pages, lock_fd = create_segment(path, segment_size, directory, prefault=prefault)
        pinned_at: int | None = None
        try:
            if pin:
                pinned_at = _pin(segment, size_bytes)
        except BaseException:
            _release(segment, path, os.getpid(), None, lock_fd)
            raise
        self.directory = directory
        self.pages = pages
        self._setup(name, segment, path, pinned_at, size_bytes, table_offset, generation_block, lock_fd)
        logger.info(
            "L1 arena %s: %.2f GiB on %s, prefault=%s, pinned=%s",
            path,
            size_bytes / 2**30,
            pages.describe(),
            prefault,
            self.pinned,
        )
        hint = pages.hint()
        if hint is not None:
            logger.info("L1 arena on 4 KiB pages: %s", hint)

    @classmethod
    def attach(cls, name: str, directory: str = SHM_DIR) -> L1Arena:
        """Map an existing segment by name (a client's view); ``close`` unmaps, never unlinks."""
        path = _segment_path(name, directory)
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise TiersError(f"shared-memory segment {path} is empty")
            segment = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arena = cls.__new__(cls)
        arena.directory = directory
        arena.pages = None
        arena._setup(name, segment, None, None, size, 0, 0, None)
        return arena

    def _setup(
        self,
        name: str,
        segment: mmap.mmap,
        path: str | None,
        pinned_at: int | None,
        size: int,
        table_offset: int,
        generation_block: int,
        lock_fd: int | None,
    ) -> None:
        self.name = name
        self.size = size
        self.segment_size = len(segment)
        self.owner = path is not None
        self.pinned = pinned_at is not None
        self.generation_offset = table_offset
        self.generation_block = generation_block if table_offset else 0
        self._segment = segment
        whole = memoryview(segment)
        self.buffer = whole[:size]
        self.generations = whole[table_offset:].cast("Q") if table_offset else whole[:0].cast("Q")
        whole.release()
        # weakref.finalize also runs at interpreter exit, which covers servers that exit
        # through an exception without calling close().
        self._finalizer = weakref.finalize(
            self, _release, segment, path, os.getpid(), pinned_at, lock_fd, (self.buffer, self.generations)
        )

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def read_into(self, offset: int, size: int, out: memoryview) -> None:
        """Copy ``size`` bytes at ``offset`` into the byte view ``out[:size]``."""
        if offset < 0 or offset + size > self.size:
            raise ValueError(f"{size} bytes at offset {offset} do not fit the {self.size}-byte arena")
        out[:size] = self.buffer[offset : offset + size]

    def write_from(self, offset: int, data: memoryview) -> None:
        """Copy the byte view ``data`` into the arena at ``offset``."""
        if offset < 0 or offset + data.nbytes > self.size:
            raise ValueError(f"{data.nbytes} bytes at offset {offset} do not fit the {self.size}-byte arena")
        self.buffer[offset : offset + data.nbytes] = data

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Unmap, and unlink if this process created the segment. Safe to call twice."""
        if not self._finalizer.alive:
            return
        try:
            self.buffer.release()
            self.generations.release()
        except BufferError:
            logger.warning("L1 arena buffer is still exported; it stays mapped until released")
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("owner" if self.owner else "attached")
        return f"L1Arena(name={self.name!r}, size={self.size}, {state})"


def segment_bytes(size: int, generation_block: int) -> int:
    """The size of the segment an arena of ``size`` bytes maps (its generation table
    included): what /dev/shm must have room for."""
    return _layout(size, generation_block)[1]


def _layout(size: int, generation_block: int) -> tuple[int, int]:
    """(offset of the generation table, segment size): the table starts at the first
    8-byte boundary after the object bytes and has one entry per started block before it.
    Counted up to the table, not the object bytes: a client knows only where the table
    starts, and maps no segment whose table misses an entry for a block before it."""
    if not generation_block:
        return 0, size
    table_offset = -(-size // 8) * 8
    entries = -(-table_offset // generation_block)
    return table_offset, table_offset + 8 * entries


def remove_stale_segments(directory: str = SHM_DIR, kept: list[str] | None = None) -> list[str]:
    """Unlink default-named segments in ``directory`` whose creating process no longer
    exists.

    Call at start-up to reclaim the memory of a server killed with SIGKILL.  Only names of
    the form ``lmcache_tiers_<pid>_<hex>`` are considered, never a custom name, and one
    that may still be in use is kept: another process has it open or mapped (a write
    lease is refused), a process visible here maps it, or, when the lease cannot be asked
    for, a process that could open it has maps that could not be read (see
    :meth:`~lmcache_tiers.l1.segment.MapsSurvey.why_kept`).  ``kept``, when given,
    receives the names of the segments of dead-looking creators so kept.
    """
    return remove_files_of_dead_processes(
        directory, _DEFAULT_NAME, "L1 segment", mapped_by=survey_mappings, kept=kept
    )
