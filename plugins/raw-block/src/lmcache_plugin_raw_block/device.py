"""Opening the device of a ``raw_block`` adapter, with a one-line error for each way that
can fail, and aligned reads and writes of its metadata."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import struct
from dataclasses import dataclass

from lmcache_plugin_raw_block.aligned import AlignedBlock, round_up
from lmcache_plugin_raw_block.config import RawBlockConfig
from lmcache_plugin_raw_block.guards import (
    InFlight,
    lock_device,
    lock_loop_backing_file,
    probe_device,
    probe_loop_backing_file,
    remove_created,
    under_dev,
)
from lmcache_plugin_raw_block.superblock import (
    RAW_BLOCK_MAGIC,
    SIGNATURE_PROBE_BYTES,
    foreign_signature,
    own_block,
)
from lmcache_tiers.plugin import ConfigError

log = logging.getLogger(__name__)

_BLKSSZGET = 0x1268  # ioctl: logical block size of a block device
_BLKROGET = 0x125E  # ioctl: whether a block device is read-only
_NAME = "raw_block"
#: why an exclusive open of a block device fails with EBUSY
_HELD = "it is in use (mounted, or held by another program)"


@dataclass
class BlockDevice:
    fd: int
    path: str
    size: int
    is_block_device: bool
    direct: bool
    align: int
    #: the stat of the file this start-up created at ``path`` (None: it was there before)
    created: os.stat_result | None = None
    #: a descriptor holding the lock on the file behind a loop device (-1: none)
    backing_lock_fd: int = -1

    def __post_init__(self) -> None:
        self.in_flight = InFlight()

    def remove_if_created(self) -> None:
        """After a refused start-up, once closed: remove the file it created, if it did."""
        if self.created is not None:
            remove_created(self.path, self.created, _NAME)

    def read_at(self, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` (both aligned), through an aligned buffer."""
        block = AlignedBlock(round_up(length, self.align), self.align)
        try:
            got = os.preadv(self.fd, [block.view], offset)
            return bytes(block.view[: min(got, length)])
        finally:
            block.close()

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """``data`` at ``offset`` (aligned), zero-padded to a whole number of blocks."""
        length = memoryview(data).nbytes
        block = AlignedBlock(round_up(max(length, 1), self.align), self.align)
        try:
            block.view[:length] = data
            block.view[length:] = bytes(block.size - length)
            written = os.pwritev(self.fd, [block.view], offset)
            if written != block.size:
                raise OSError(errno.EIO, f"short write of {written} of {block.size} bytes at {offset}")
        finally:
            block.close()

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self, timeout_s: float) -> None:
        """Close the descriptor (and so drop the lock) once no call uses it any more."""
        if self.in_flight.drain(timeout_s):
            os.close(self.fd)
            if self.backing_lock_fd >= 0:
                os.close(self.backing_lock_fd)
                self.backing_lock_fd = -1
        else:
            log.error("%s: %s left open: device calls are still running", _NAME, self.path)


def preflight_device(config: RawBlockConfig) -> None:
    """Before L1 exists: ``device_path`` is a block device or a regular file, or a file
    this user can create (with ``capacity_bytes``), and no other adapter holds it."""
    from lmcache_tiers.plugin import FieldError, check_file

    path = config.device_path
    if not os.path.exists(path) and under_dev(os.path.realpath(path)):
        raise FieldError("device_path", f"{path} does not exist (no file is created under /dev)")
    if not os.path.exists(path) and config.capacity_bytes == 0:
        raise FieldError(
            "device_path",
            f"{path} does not exist; name a block device or a preallocated file, "
            "or set capacity_bytes to have a file of that size created",
        )
    check_file(path, "device_path", devices="block")
    probe_device(path, "device_path", _NAME)
    probe_loop_backing_file(path, "device_path", _NAME)
    if _held_exclusively(path):
        raise FieldError("device_path", f"cannot open {path}: {_HELD}")
    if _read_only_device(path):
        raise FieldError("device_path", _read_only(path))


def _read_only(path: str) -> str:
    return f"{path} is a read-only block device; make it writable (blockdev --setrw) or name another"


def _read_only_device(path: str) -> bool:
    """Whether ``path`` is a block device the kernel keeps read-only (``losetup -r``, a
    write-protected disk, ``blockdev --setro``).  Opening it for writing succeeds even so,
    and only the first write fails (EPERM): checked before L1 is built."""
    try:
        if not stat.S_ISBLK(os.stat(path).st_mode):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # the open says what it says
        return False
    try:
        return _is_read_only(fd)
    finally:
        os.close(fd)


def _is_read_only(fd: int) -> bool:
    try:
        flag: int = struct.unpack("i", fcntl.ioctl(fd, _BLKROGET, b"\0" * 4))[0]
    except OSError:
        return False  # no answer: the writes say what they say
    return flag != 0


def _held_exclusively(path: str) -> bool:
    """Whether the open's exclusive claim of the block device ``path`` would be refused:
    a filesystem mounted on it, or LVM, md or another exclusive opener holding it.  Tried
    and let go at once, so that a server is refused before it builds L1 (which can take
    many seconds); the open, which keeps the claim, stays the authority."""
    try:
        if not stat.S_ISBLK(os.stat(path).st_mode):
            return False
        fd = os.open(path, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        return exc.errno == errno.EBUSY  # other failures: the open says what it says
    os.close(fd)
    return False


def _missing(config: RawBlockConfig) -> os.stat_result | None:
    """Create the regular file ``device_path`` names, or say why it is not created: its
    stat, or None if another process created it meanwhile."""
    path = config.device_path
    if config.capacity_bytes == 0:
        raise ConfigError(
            f"{_NAME}: device_path {path} does not exist; name a block device or a "
            "preallocated file, or set capacity_bytes to have a file of that size created"
        )
    real = os.path.realpath(path)
    parent = os.path.dirname(real) or "."
    if under_dev(real):
        raise ConfigError(f"{_NAME}: device_path {path} does not exist (no file is created under /dev)")
    if not os.path.isdir(parent):
        raise ConfigError(f"{_NAME}: device_path {path}: directory {parent} does not exist")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        if os.path.islink(path) and not os.path.exists(path):
            # O_EXCL creates nothing through a symbolic link: say so rather than fail later.
            raise ConfigError(
                f"{_NAME}: device_path {path} is a symbolic link to {real}, which does not exist"
            ) from None
        return None  # another process created it meanwhile
    except OSError as exc:
        raise ConfigError(f"{_NAME}: cannot create device_path {path}: {exc.strerror}") from None
    try:
        created = os.fstat(fd)
    finally:
        os.close(fd)
    log.info("%s: created %s (to be %d bytes, preallocated)", _NAME, path, config.capacity_bytes)
    return created


def _open(config: RawBlockConfig, is_block_device: bool) -> int:
    path = config.device_path
    flags = os.O_RDWR | os.O_CLOEXEC
    if config.use_odirect:
        flags |= os.O_DIRECT
    if is_block_device:
        # A block device opened O_EXCL is refused while it is mounted or claimed by
        # another exclusive opener (a filesystem, LVM, md): never write under them.
        flags |= os.O_EXCL
    try:
        return os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.EBUSY:
            reason = _HELD
        elif exc.errno == errno.EINVAL and config.use_odirect:
            reason = "its filesystem does not support O_DIRECT; set use_odirect to false"
        else:
            reason = exc.strerror or str(exc)
        raise ConfigError(f"{_NAME}: cannot open device_path {path}: {reason}") from None


def _refuse_foreign_file(fd: int, config: RawBlockConfig) -> None:
    """Raise if the regular file holds something else, before :func:`_size` grows it: a
    refused start-up leaves another store's file (a dax mapping) or a filesystem image as
    it was, not preallocated to ``capacity_bytes``.  The mount checks again (devices)."""
    if os.fstat(fd).st_size == 0:
        return  # nothing in it yet
    align = config.block_align
    block = AlignedBlock(round_up(SIGNATURE_PROBE_BYTES, align), align)
    try:
        try:
            got = os.preadv(fd, [block.view], 0)
        except OSError:
            return  # unreadable as configured: _check_alignment says why, the mount checks
        head = bytes(block.view[: min(got, SIGNATURE_PROBE_BYTES)])
    finally:
        block.close()
    within = own_block(head, RAW_BLOCK_MAGIC, align)
    foreign = foreign_signature(head, RAW_BLOCK_MAGIC, within=within)
    if foreign is not None:
        raise ConfigError(
            f"{_NAME}: {config.device_path} holds {foreign}; refusing to overwrite it "
            "(if it is meant for raw_block, erase its signatures first: wipefs, or zero its first 68 KiB)"
        )


def _size(fd: int, config: RawBlockConfig, is_block_device: bool) -> int:
    path = config.device_path
    if is_block_device:
        size = os.lseek(fd, 0, os.SEEK_END)
        if config.capacity_bytes > size:
            log.warning(
                "%s: capacity_bytes %d exceeds %s (%d bytes); using the whole device",
                _NAME,
                config.capacity_bytes,
                path,
                size,
            )
        return size
    size = os.fstat(fd).st_size
    wanted = max(size, config.capacity_bytes)
    if wanted == 0:
        return 0
    try:
        # Allocates holes too: a write into a sparse file must never run out of space.
        os.posix_fallocate(fd, 0, wanted)
    except OSError as exc:
        raise ConfigError(f"{_NAME}: cannot preallocate {wanted} bytes for {path}: {exc.strerror}") from None
    return wanted


def _check_alignment(fd: int, config: RawBlockConfig, is_block_device: bool) -> None:
    path = config.device_path
    if is_block_device:
        logical = struct.unpack("I", fcntl.ioctl(fd, _BLKSSZGET, b"\0" * 4))[0]
        if config.block_align < logical or config.block_align % logical:
            raise ConfigError(
                f"{_NAME}: block_align {config.block_align} is not a multiple of the logical "
                f"block size of {path} ({logical})"
            )
    if not config.use_odirect:
        return
    probe = AlignedBlock(config.block_align, config.block_align)
    try:
        os.preadv(fd, [probe.view], 0)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise ConfigError(f"{_NAME}: cannot read {path}: {exc.strerror}") from None
        raise ConfigError(
            f"{_NAME}: {path} refuses O_DIRECT reads of block_align {config.block_align} bytes; "
            "raise block_align to its logical block size or set use_odirect to false"
        ) from None
    finally:
        probe.close()


def open_device(config: RawBlockConfig) -> BlockDevice:
    """Open, lock and size ``config.device_path`` (a block device or a regular file)."""
    path = config.device_path
    created = None
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        created = _missing(config)
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{_NAME}: cannot use device_path {path}: {exc.strerror}") from None
    if not (stat.S_ISBLK(mode) or stat.S_ISREG(mode)):
        raise ConfigError(f"{_NAME}: device_path {path} is neither a block device nor a regular file")
    is_block_device = stat.S_ISBLK(mode)
    fd = backing_lock_fd = -1
    try:
        fd = _open(config, is_block_device)
        if is_block_device and _is_read_only(fd):
            raise ConfigError(f"{_NAME}: {_read_only(path)}")
        lock_device(fd, path, _NAME)
        if is_block_device:
            backing_lock_fd = lock_loop_backing_file(fd, path, _NAME)
        else:
            _refuse_foreign_file(fd, config)
        size = _size(fd, config, is_block_device)
        _check_alignment(fd, config, is_block_device)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if backing_lock_fd >= 0:
            os.close(backing_lock_fd)
        # A refused start-up leaves no file behind it: only the one it created goes.
        if created is not None:
            remove_created(path, created, _NAME)
        raise
    return BlockDevice(
        fd, path, size, is_block_device, config.use_odirect, config.block_align, created, backing_lock_fd
    )
