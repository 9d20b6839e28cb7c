"""One mapped DAX device or file: opened, locked, mapped shared, formatted or reopened.

A regular file is created or extended to the mapped size and preallocated: a store into
a hole of a full filesystem (``/dev/shm`` included) would kill the process with SIGBUS.
The mapping is populated when made (``MAP_POPULATE``), so stores never pay for first
touches.  The index's commit words are reached through a strided numpy view, one aligned
8-byte store per commit or delete.
"""

from __future__ import annotations

import errno
import gc
import logging
import mmap
import os
import stat

import numpy as np
from lmcache_plugin_raw_block.guards import lock_device, remove_created, under_dev
from lmcache_plugin_raw_block.superblock import (
    DAX_MAGIC,
    SIGNATURE_PROBE_BYTES,
    decode_superblock,
    encode_superblock,
    foreign_signature,
    has_magic,
    new_identity,
    unreadable_reason,
)

from lmcache_plugin_dax.layout import (
    COMMIT_BYTES,
    ENTRY_BYTES,
    SUPERBLOCK_BYTES,
    DaxLayout,
    mapped_bytes,
    plan_layout,
)
from lmcache_tiers.plugin import ConfigError

log = logging.getLogger(__name__)

SUPERBLOCK_MAGIC = DAX_MAGIC
_NAME = "dax"


def _geometry_change(found: dict[str, int], layout: DaxLayout) -> str:
    """Why a mapping of ``found``'s geometry is formatted for ``layout``, naming each value
    that changed (the edit that emptied the cache, as the operator reads it)."""
    changed = sorted(
        f"{name} {found.get(name)} -> {value}"
        for name, value in layout.as_dict().items()
        if found.get(name) != value
    )
    return "its geometry changed (" + ", ".join(changed) + ")"


def _open(path: str) -> tuple[int, bool, tuple[str, os.stat_result] | None]:
    """A read-write descriptor of ``path`` (a regular file is created if missing), whether
    it is a character device, and the path and stat of the file if this call created it
    (a symbolic link's target, for a link to a missing file)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if under_dev(os.path.realpath(path)):
            raise ConfigError(
                f"{_NAME}: device_path {path} does not exist (no file is created under /dev)"
            ) from None
        mode = stat.S_IFREG
    except OSError as exc:
        raise ConfigError(f"{_NAME}: cannot use device_path {path}: {exc.strerror}") from None
    is_device = stat.S_ISCHR(mode)
    if not (is_device or stat.S_ISREG(mode)):
        raise ConfigError(f"{_NAME}: device_path {path} is neither a DAX character device nor a regular file")
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        if is_device:
            return os.open(path, flags), True, None
        made = path
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            if not (os.path.islink(path) and not os.path.exists(path)):
                return os.open(path, flags | os.O_CREAT, 0o600), False, None  # there before
            # A symbolic link to a missing file (O_EXCL creates nothing through a link):
            # the file made is its target, which a refused start-up removes.
            made = os.path.realpath(path)
            try:
                fd = os.open(made, flags | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:  # made meanwhile by another: not ours to remove
                return os.open(path, flags | os.O_CREAT, 0o600), False, None
        try:
            return fd, False, (made, os.fstat(fd))
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        raise ConfigError(f"{_NAME}: cannot open device_path {path}: {exc.strerror}") from None


class DaxRegion:
    """The mapping of one device; ``identity`` and ``layout`` are set once it is mounted."""

    def __init__(self, path: str, max_dax_size_gb: float, slot_bytes: int) -> None:
        self.path = path
        self.fd, self.is_device, self.created = _open(path)
        self._map: mmap.mmap | None = None
        try:
            lock_device(self.fd, path, _NAME)
            size = mapped_bytes(max_dax_size_gb, device=self.is_device)
            self.layout: DaxLayout = plan_layout(size, slot_bytes)
            if self.layout.slot_count < 1:
                raise ConfigError(f"{_NAME}: {path}: {size} bytes cannot hold the index and one slot")
            if not self.is_device:
                # Before the file grows: another store (a raw_block using the whole file)
                # would take a longer file for another geometry and reformat it.
                self._refuse_foreign(os.pread(self.fd, SIGNATURE_PROBE_BYTES, 0))
                self._preallocate(size)
            self._map = self._mmap(size)
            self.buffer = memoryview(self._map)
            words = np.frombuffer(
                self._map,
                dtype=np.uint64,
                count=self.layout.slot_count * ENTRY_BYTES // 8,
                offset=self.layout.index_offset,
            )
            #: commit word of every slot: the sequence number of the write it holds, 0 if free
            self.commits = words[:: ENTRY_BYTES // 8]
        except BaseException:
            self.discard()
            raise
        self.identity = b""

    def _preallocate(self, size: int) -> None:
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as exc:
            raise ConfigError(
                f"{_NAME}: cannot preallocate {size} bytes for {self.path}: {exc.strerror}"
            ) from None

    def _mmap(self, size: int) -> mmap.mmap:
        try:
            return mmap.mmap(
                self.fd,
                size,
                flags=mmap.MAP_SHARED | mmap.MAP_POPULATE,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as exc:
            hint = (
                " (larger than the device?)" if exc.errno in (errno.EINVAL, errno.ENXIO, errno.ENOMEM) else ""
            )
            raise ConfigError(
                f"{_NAME}: cannot map {size} bytes of {self.path}: {exc.strerror}{hint}"
            ) from None

    # -- superblock ------------------------------------------------------------------------

    def _refuse_foreign(self, head: bytes) -> None:
        """Raise if ``head`` (the start of the mapping) says it holds something else."""
        # The superblock's page holds the superblock and zeros: a signature in it was
        # written since (a filesystem made over the file that left its first bytes alone).
        # Past it lie the index and slots, whose bytes may match a signature by chance.
        within = SUPERBLOCK_BYTES if has_magic(head, SUPERBLOCK_MAGIC) else None
        foreign = foreign_signature(head, SUPERBLOCK_MAGIC, within=within)
        if foreign is not None:
            raise ConfigError(
                f"{_NAME}: {self.path} holds {foreign}; refusing to overwrite it "
                "(if it is meant for dax, erase its signatures first: wipefs, or zero its first 68 KiB)"
            )

    def mount(self, *, keep: bool) -> bool:
        """Reopen the contents when ``keep`` and the superblock matches (True), or format;
        raise if the mapping holds something else."""
        head = bytes(self.buffer[: min(SIGNATURE_PROBE_BYTES, self.layout.mapped_bytes)])
        self._refuse_foreign(head)
        superblock = decode_superblock(head, SUPERBLOCK_MAGIC)
        if superblock is not None and keep and superblock.geometry == self.layout.as_dict():
            self.identity = superblock.identity
            return True
        if superblock is not None:
            reason = (
                "persist_enabled is false" if not keep else _geometry_change(superblock.geometry, self.layout)
            )
            # A cache of ours, emptied: said so, as the operator's edit may not have meant it.
            reason += "; its objects are dropped"
        elif has_magic(head, SUPERBLOCK_MAGIC):
            reason = unreadable_reason(head)
        else:
            reason = "it holds no dax superblock"
        level = logging.WARNING if head.strip(b"\0") else logging.INFO
        log.log(level, "%s: formatting %s (%s): %d slots", _NAME, self.path, reason, self.layout.slot_count)
        self.identity = new_identity()
        self.commits[:] = 0
        block = encode_superblock(SUPERBLOCK_MAGIC, self.identity, self.layout.as_dict())
        self.buffer[:SUPERBLOCK_BYTES] = block + bytes(SUPERBLOCK_BYTES - len(block))
        return False

    # -- slots and entries -----------------------------------------------------------------

    def slot(self, local: int, length: int) -> memoryview:
        start = self.layout.slot_offset(local)
        return self.buffer[start : start + length]

    def entry_header(self, local: int) -> memoryview:
        """The slot header part of an entry (after its commit word)."""
        start = self.layout.entry_offset(local) + COMMIT_BYTES
        return self.buffer[start : start + ENTRY_BYTES - COMMIT_BYTES]

    def write_entry(self, local: int, header: bytes, seq: int) -> None:
        """Write a slot's header, then commit it: the commit word goes last."""
        start = self.layout.entry_offset(local) + COMMIT_BYTES
        self.buffer[start : start + len(header)] = header
        self.commits[local] = seq

    def clear(self, local: int) -> None:
        self.commits[local] = 0

    def committed(self) -> list[tuple[int, int]]:
        """(slot, seq) of every committed entry."""
        locals_ = np.flatnonzero(self.commits)
        return [(int(local), int(self.commits[local])) for local in locals_]

    def discard(self) -> None:
        """Close after a refused start-up, removing the file if this start-up created it."""
        self.close()
        if self.created is not None:
            remove_created(*self.created, _NAME)

    def close(self) -> None:
        """Unmap and close; a view a caller still holds keeps the mapping until collected."""
        for name in ("commits", "buffer"):
            view = self.__dict__.pop(name, None)
            if isinstance(view, memoryview):
                view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                gc.collect()  # a view held only by a reference cycle goes now
                try:
                    self._map.close()
                except BufferError:
                    # The mapping holds its own descriptor, and with it the lock.
                    log.warning(
                        "%s: %s stays mapped and locked until its last view is collected", _NAME, self.path
                    )
            self._map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
