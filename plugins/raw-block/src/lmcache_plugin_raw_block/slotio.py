"""One system call per slot: header and payload written, or read, together.

A slot is ``header_bytes`` of header followed by the payload.  With ``O_DIRECT`` every
piece of an I/O vector must be block-aligned in address and length, so a payload whose
buffer is aligned (L1 extents are) is moved in place and only its last partial block
goes through a staging block; a payload in an unaligned buffer is staged whole.  The
header block and the tail are per-thread staging blocks reused for every slot.  Without
``O_DIRECT`` the payload is always moved in place.

Each call counts as in flight on the device (``InFlight``) from its first touch of a
staging block to its last, not only for its system call: close releases the staging
blocks only once no call is in flight, so a call that started before the close (a load
core gave up on at its timeout) finishes with them intact, and one that starts after
finds the device closed (OSError) before it touches them.
"""

from __future__ import annotations

import errno
import os

from lmcache_plugin_raw_block.aligned import Staging, address_of, round_up
from lmcache_plugin_raw_block.device import BlockDevice
from lmcache_plugin_raw_block.geometry import Geometry
from lmcache_tiers.plugin import copy_into


class SlotIO:
    """Reads and writes whole slots of one device; safe to call from many threads."""

    def __init__(self, device: BlockDevice, geometry: Geometry) -> None:
        self.device = device
        self.geometry = geometry
        self._align = geometry.block_align
        self._staging = Staging(geometry.header_bytes, geometry.payload_bytes, geometry.block_align)

    def close(self) -> None:
        self._staging.close()

    def _aligned(self, buffer: memoryview) -> bool:
        return address_of(buffer) % self._align == 0

    def _check(self, done: int, expected: int, what: str, slot: int) -> None:
        if done != expected:
            raise OSError(errno.EIO, f"short {what} of slot {slot}: {done} of {expected} bytes")

    def write(self, slot: int, header: bytes, payload: memoryview) -> None:
        """Write ``header`` (at most ``header_bytes``) and ``payload`` into ``slot``."""
        with self.device.in_flight.use() as usable:
            if not usable:
                raise OSError(errno.EBADF, "the device is closed")
            self._write(slot, header, payload)

    def _write(self, slot: int, header: bytes, payload: memoryview) -> None:
        header_block = self._staging.header()
        header_block[: len(header)] = header
        header_block[len(header) :] = bytes(self.geometry.header_bytes - len(header))
        size = payload.nbytes
        vector: list[memoryview] = [header_block]
        if not self.device.direct:
            vector.append(payload)
        elif self._aligned(payload):
            bulk = size - size % self._align
            if bulk:
                vector.append(payload[:bulk])
            if bulk < size:
                tail = self._staging.tail()
                tail[: size - bulk] = payload[bulk:]
                tail[size - bulk :] = bytes(self._align - (size - bulk))
                vector.append(tail)
        else:
            padded = round_up(size, self._align)
            staged = self._staging.payload()[:padded]
            copy_into(staged[:size], payload)
            staged[size:] = bytes(padded - size)
            vector.append(staged)
        expected = sum(part.nbytes for part in vector)
        done = os.pwritev(self.device.fd, vector, self.geometry.slot_offset(slot))
        self._check(done, expected, "write", slot)

    def read(self, slot: int, buffer: memoryview) -> bytes:
        """Fill ``buffer`` with the first ``buffer.nbytes`` payload bytes of ``slot``;
        returns the slot's header block (verified by the caller)."""
        with self.device.in_flight.use() as usable:
            if not usable:
                raise OSError(errno.EBADF, "the device is closed")
            return self._read(slot, buffer)

    def _read(self, slot: int, buffer: memoryview) -> bytes:
        header_block = self._staging.header()
        size = buffer.nbytes
        vector: list[memoryview] = [header_block]
        staged: memoryview | None = None
        tail: memoryview | None = None
        bulk = size
        if not self.device.direct:
            vector.append(buffer)
        elif self._aligned(buffer):
            bulk = size - size % self._align
            if bulk:
                vector.append(buffer[:bulk])
            if bulk < size:
                tail = self._staging.tail()
                vector.append(tail)
        else:
            staged = self._staging.payload()[: round_up(size, self._align)]
            vector.append(staged)
        expected = sum(part.nbytes for part in vector)
        done = os.preadv(self.device.fd, vector, self.geometry.slot_offset(slot))
        self._check(done, expected, "read", slot)
        if staged is not None:
            copy_into(buffer, staged[:size])
        elif tail is not None:
            buffer[bulk:] = tail[: size - bulk]
        return bytes(header_block)

    def read_header(self, slot: int) -> bytes:
        """The header block of ``slot`` alone (recovery)."""
        with self.device.in_flight.use() as usable:
            if not usable:
                raise OSError(errno.EBADF, "the device is closed")
            header_block = self._staging.header()
            done = os.preadv(self.device.fd, [header_block], self.geometry.slot_offset(slot))
            self._check(done, header_block.nbytes, "header read", slot)
            return bytes(header_block)
