"""Shared-memory data plane helpers: map the server's L1 segment, and view any buffer as bytes.

A local client maps the server's arena segment read-write and copies its bytes straight
into the extents STORE_RESERVE hands out, and out of the extents RETRIEVE names: one
memcpy each way, nothing through the socket.  The mapping is opened by name from
``/dev/shm`` and checked against the device and inode the server reported, so a client on
another host, or in a container with its own ``/dev/shm``, never writes into an unrelated
segment that merely has the same name.  The client only ever unmaps; unlinking is the
server's job (no resource tracker is involved, so a client exiting cannot remove it).
"""

from __future__ import annotations

import mmap
import os
import re
import sys
from typing import Any

import numpy as np

SHM_DIR = "/dev/shm"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,200}$")

#: Anything ``store`` accepts: bytes-likes, numpy arrays, torch CPU tensors.
BufferLike = Any


class SegmentMismatch(Exception):
    """The named segment is missing here or is not the one the server created."""


def segment_identity(name: str) -> tuple[int, int]:
    """(st_dev, st_ino) of ``/dev/shm/<name>``, reported to clients in the handshake."""
    st = os.stat(os.path.join(SHM_DIR, _checked(name)))
    return st.st_dev, st.st_ino


def _checked(name: str) -> str:
    # The name comes from the server over the wire: never let it escape /dev/shm.
    if not _SAFE_NAME.match(name) or name in (".", ".."):
        raise SegmentMismatch(f"refusing shared-memory name {name!r}")
    return name


class MappedSegment:
    """A client's read-write mapping of the server's arena."""

    def __init__(self, name: str, size: int, device: int, inode: int) -> None:
        path = os.path.join(SHM_DIR, _checked(name))
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise SegmentMismatch(f"cannot open {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != (device, inode) or st.st_size != size:
                raise SegmentMismatch(f"{path} is not the server's segment (another host or namespace)")
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.name = name
        self.size = size
        self.buffer = memoryview(self._mmap)
        # numpy slices copy with one memcpy and release the GIL while doing it.
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)

    def check_slot(self, offset: int, size: int) -> None:
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"slot ({offset}, {size}) lies outside the {self.size}-byte segment")

    def close(self) -> None:
        """Unmap; if views handed to the caller are still alive the mapping stays until they go."""
        self.array = np.empty(0, dtype=np.uint8)
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass


def as_byte_array(buffer: BufferLike) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A flat uint8 numpy view of ``buffer`` without copying when it is contiguous.

    Accepts bytes, bytearray, memoryview, numpy arrays (any dtype) and torch CPU tensors
    (any dtype, including bfloat16, which numpy itself cannot represent).
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise TypeError(f"only CPU tensors can be stored directly, got one on {buffer.device}")
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
