"""Shared-memory data plane helpers: map the server's L1 segment, and view any buffer as bytes.

A local client maps the server's arena segment read-write and copies its bytes straight
into the extents STORE_RESERVE hands out, and out of the extents RETRIEVE names: one
memcpy each way, nothing through the socket.  The mapping is opened by name from
``/dev/shm``, or from the directory the server reports in HELLO (``--shm-dir``, an
absolute path; the name is one path component, so nothing outside that directory is ever
opened), and only a regular file on a tmpfs whose device and inode are the ones the server
reported is mapped: a client on another host, or in a container with its own
``/dev/shm``, never writes into an unrelated file that merely has the same name.  The
client only ever unmaps; unlinking is the server's job (no resource tracker is involved, so
a client exiting cannot remove it).

On a tmpfs that gives huge pages (see ``lmcache_tiers.l1.segment``) a fresh mapping
faults 2 MiB at a time and is ready almost at once; otherwise its page tables are filled
in the background while the client is idle,
and a store's copy that comes first populates its extent piece by piece as it goes, on
two threads for a large request (:mod:`lmcache_tiers.wire.pagetables`), so even a
client's first store runs near memcpy.

Behind the object bytes the segment carries the server's generation table (one uint64
per allocation unit, bumped whenever an extent goes back to the server's allocator):
:meth:`MappedSegment.changed` tells which slots a reader was handed have changed hands
since, i.e. whose bytes it may not have read as they were.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from lmcache_tiers.tmpfs import SHM_DIR, TMPFS_MAGIC, fs_magic
from lmcache_tiers.wire.after_fork import renew_locks_after_fork
from lmcache_tiers.wire.pagetables import PageTables

_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}\Z")  # \Z: $ also matches before a final newline

#: Anything ``store`` accepts: bytes-likes, numpy arrays, torch CPU tensors.
BufferLike = Any


class _Extent(NamedTuple):
    offset: int
    size: int


class SegmentMismatch(Exception):
    """The named segment is missing here or is not the one the server created."""


class SegmentClosed(Exception):
    """The mapping was closed: nothing may start using it any more."""


class SlotLike(Protocol):
    @property
    def offset(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def generation(self) -> int: ...


def segment_identity(name: str, directory: str = SHM_DIR) -> tuple[int, int]:
    """(st_dev, st_ino) of ``<directory>/<name>``, reported to clients in the handshake."""
    st = os.stat(os.path.join(directory, _checked(name)))
    return st.st_dev, st.st_ino


def _checked(name: str) -> str:
    # The name comes from the server over the wire: never let it escape its directory.
    if not _SAFE_NAME.match(name) or name in (".", ".."):
        raise SegmentMismatch(f"refusing shared-memory name {name!r}")
    return name


def _checked_directory(directory: str) -> str:
    # Also from the wire: an absolute, normalized path, or the client refuses to look.
    if not directory:
        return SHM_DIR
    if "\0" in directory or not os.path.isabs(directory) or os.path.normpath(directory) != directory:
        raise SegmentMismatch(f"refusing shared-memory directory {directory!r}")
    return directory


class MappedSegment:
    """A client's read-write mapping of the server's arena.

    ``size`` is the segment file's size, ``directory`` where it is ("": /dev/shm);
    ``generation_offset`` (0: none) where the
    generation table starts, which is also where the object bytes end, and
    ``generation_block`` the arena bytes per table entry.  ``populate``: fill the page
    tables in the background from now on (see the module's docstring).

    Whoever copies or hands out views does it inside :meth:`in_use`; :meth:`close`
    unmaps once the last such block ends, so a close never pulls the mapping (or its
    generation table) from under a copy or a retrieve in progress.
    """

    def __init__(
        self,
        name: str,
        size: int,
        device: int,
        inode: int,
        *,
        generation_offset: int = 0,
        generation_block: int = 0,
        populate: bool = True,
        directory: str = SHM_DIR,
    ) -> None:
        path = os.path.join(_checked_directory(directory), _checked(name))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise SegmentMismatch(f"cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or fs_magic(fd) != TMPFS_MAGIC:
                raise SegmentMismatch(f"{path} is not a file on a tmpfs: not mapping it")
            if (st.st_dev, st.st_ino) != (device, inode) or st.st_size != size:
                raise SegmentMismatch(f"{path} is not the server's segment (another host or namespace)")
            if size <= 0:
                raise SegmentMismatch(f"{path} is empty: nothing to map")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        tracked = 0 < generation_offset < size and generation_offset % 8 == 0 and generation_block > 0
        if (generation_offset or generation_block) and not tracked:
            # A table described but unusable: mapped without it, no stale read would be seen.
            self._mmap.close()
            raise SegmentMismatch(
                f"{path}: the generation table the server describes (at {generation_offset}, one "
                f"entry per {generation_block} bytes) is not in the {size}-byte segment"
            )
        if tracked and (
            (size - generation_offset) % 8  # whole uint64 entries up to the end of the segment
            or (size - generation_offset) // 8 < -(-generation_offset // generation_block)
        ):
            self._mmap.close()
            raise SegmentMismatch(f"{path}: the generation table the server describes does not fit")
        self.name = name
        self.size = size
        # in_use blocks running, and whether close was called (both under _state)
        self._users = 0
        self._closing = False
        self._state = threading.Lock()
        renew_locks_after_fork(self)
        #: where object bytes may be: everything before the generation table
        self.data_size = generation_offset if tracked else size
        self.buffer = memoryview(self._mmap)
        # numpy slices copy with one memcpy and release the GIL while doing it.
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.generation_block = generation_block if tracked else 0
        self.generations = self.buffer[generation_offset if tracked else size :].cast("Q")
        self.pages = PageTables(self.array.ctypes.data, size)
        if populate:
            self.pages.start()

    def _after_fork(self) -> None:
        # A copy or a retrieve on another thread may have held the lock when the process
        # forked: in the child that thread does not exist, and ``close`` (a client's
        # close there) would wait for the lock forever.  Its ``in_use`` block never ends
        # in the child either, so the child's copy of the mapping goes when the process does.
        self._state = threading.Lock()

    @property
    def tracks_generations(self) -> bool:
        return self.generation_block > 0

    def check_slot(self, offset: int, size: int) -> None:
        self.check_slots((_Extent(offset, size),))

    def check_slots(self, slots: Iterable[SlotLike | _Extent]) -> None:
        """Raise ValueError naming the first slot that is not in the arena.  One call for a
        request's slots: a call per slot cost a store of hundreds of small chunks more
        than the bounds tests it made."""
        data_size = self.data_size
        for slot in slots:
            offset, size = slot.offset, slot.size
            # Objects have at least one byte: an empty slot at the arena's end would name a
            # generation entry past the table's last one.
            if offset < 0 or size < 1 or offset + size > data_size:
                raise ValueError(f"slot ({offset}, {size}) lies outside the {data_size}-byte arena")

    def changed(self, slots: Sequence[SlotLike]) -> list[int]:
        """Positions of the slots whose extent has changed hands since the server handed
        them out: their bytes may not be the object's.  Empty when the server keeps no
        generation table; slots without an extent (``offset`` -1) never count."""
        block = self.generation_block
        if not block:
            return []
        table = self.generations
        return [
            index
            for index, slot in enumerate(slots)
            if slot.offset >= 0 and table[slot.offset // block] != slot.generation
        ]

    def write(self, offset: int, source: np.ndarray[Any, Any]) -> None:
        """Copy ``source`` into the arena at ``offset`` (a slot checked with ``check_slot``)."""
        self.write_many([(offset, source)])

    def write_many(self, copies: Sequence[tuple[int, np.ndarray[Any, Any]]]) -> None:
        """Copy each ``source`` into the arena at its ``offset`` (slots checked with
        ``check_slot``): one request's copies together, so that a large one is split
        between two threads as a whole."""
        array = self.array
        self.pages.write_many(
            [(array[offset : offset + source.nbytes], source, offset) for offset, source in copies]
        )

    def read_into(self, offset: int, size: int, target: np.ndarray[Any, Any]) -> None:
        """Copy the arena's ``[offset, offset + size)`` into the start of ``target``."""
        self.read_many([(offset, size, target)])

    def read_many(self, copies: Sequence[tuple[int, int, np.ndarray[Any, Any]]]) -> None:
        """``read_into`` for each ``(offset, size, target)``, together (see ``write_many``)."""
        array = self.array
        self.pages.read_many(
            [(target[:size], array[offset : offset + size]) for offset, size, target in copies]
        )

    @property
    def closed(self) -> bool:
        return self._closing

    @contextlib.contextmanager
    def in_use(self) -> Iterator[None]:
        """Keep the mapping while the block runs (a request's copies, a retrieve's views;
        the background population pauses meanwhile): a ``close`` in the meantime, from
        this thread or another, unmaps when the last such block ends.  SegmentClosed once
        closed."""
        with self._state:
            if self._closing:
                raise SegmentClosed(f"the mapping of {self.name} is closed")
            self._users += 1
        try:
            with self.pages.in_use():
                yield
        finally:
            with self._state:
                self._users -= 1
                last = self._closing and self._users == 0
            if last:
                self._unmap()

    def close(self) -> None:
        """Unmap now, or when the last ``in_use`` block ends; views handed to the caller
        that outlive even that keep the mapping until they go."""
        with self._state:
            if self._closing:
                return
            self._closing = True
            idle = self._users == 0
        self.pages.stop()
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        # Once, by close or by the last in_use block (never both: decided under _state).
        # The last block may end before ``close`` (on another thread) has stopped the
        # background pass: stopped here too, or it would advise an address range that
        # may be another mapping's by then.
        self.pages.stop()
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.generations.release()
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass  # a view the caller kept (np.frombuffer of one) holds the mapping: GC unmaps it


_UINT8 = np.dtype(np.uint8)


def as_byte_array(buffer: BufferLike) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A flat uint8 numpy view of ``buffer`` without copying when it is contiguous.

    Accepts bytes, bytearray, memoryview, numpy arrays (any dtype) and torch CPU tensors
    (any dtype, including bfloat16, which numpy itself cannot represent).
    """
    if type(buffer) is np.ndarray and buffer.flags.c_contiguous:
        # Every chunk of a store passes here: a contiguous array is viewed with as few
        # numpy calls as it takes (a flat uint8 one is already what is asked for).
        if buffer.dtype is _UINT8 and buffer.ndim == 1:
            return buffer
        return buffer.reshape(-1).view(_UINT8)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if not buffer.is_cpu:
            raise TypeError(f"only CPU tensors can be stored directly, got one on {buffer.device}")
        if buffer.ndim and not buffer.requires_grad and buffer.is_contiguous():
            # The usual chunk, at half the cost of the general path below (each torch
            # call there costs about a microsecond, and a store has hundreds of chunks).
            # A 0-dim tensor cannot be viewed as bytes, nor a tensor needing grad as numpy.
            try:
                viewed: np.ndarray[Any, Any] = buffer.view(torch.uint8).numpy().reshape(-1)
            except RuntimeError:
                # Contiguous to torch yet not viewable: a last dimension of one element
                # whose stride is not 1 (a transposed row), which view refuses for a wider
                # dtype; the general path reshapes it first.  A catch costs nothing when
                # nothing is raised, where testing the stride cost a quarter microsecond.
                pass
            else:
                return viewed
        flat = buffer.detach().contiguous().reshape(-1)
        array: np.ndarray[Any, Any] = flat.view(torch.uint8).numpy()
        return array
    if isinstance(buffer, np.ndarray):
        return np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)
    try:
        view = memoryview(buffer)
    except TypeError:
        raise TypeError(
            f"cannot store a {type(buffer).__name__}: pass bytes, memoryview, a numpy array "
            "or a CPU torch tensor"
        ) from None
    if not view.c_contiguous:
        return np.ascontiguousarray(np.asarray(view)).reshape(-1).view(np.uint8)
    return np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, dtype=np.uint8)


def as_writable_byte_array(buffer: BufferLike) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Like :func:`as_byte_array` for a destination: must be writable and contiguous, since
    a copy would silently leave the caller's buffer untouched."""
    array = as_byte_array(buffer)
    if not array.flags.writeable:
        raise TypeError(f"destination {type(buffer).__name__} is read-only")
    torch = sys.modules.get("torch")
    contiguous = (
        buffer.is_contiguous()
        if torch is not None and isinstance(buffer, torch.Tensor)
        else np.asarray(buffer).flags.c_contiguous
        if isinstance(buffer, np.ndarray)
        else memoryview(buffer).c_contiguous
    )
    if not contiguous:
        raise TypeError("destination buffers must be contiguous")
    return array
