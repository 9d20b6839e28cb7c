"""Host-memory side of NIXL transfers: addresses of buffers and their registration.

The L1 arena is registered with the backend once, when the adapter starts; objects in it
transfer without further work.  So is staging memory an adapter reuses across batches
(``pin``): registered per batch, or per pipeline group of a load, it cost milliseconds
each time in profiles (the call drops the GIL and waits to take it back from the checksum
thread), a sixth of a 1 MiB-object load.  Other buffers (bytes
produced by a serde chain, or a caller's own buffer) are registered for the duration of
one batch, in one call, and released after it.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence

import numpy as np

from lmcache_plugin_nixl.runtime import NixlRuntime, Registration

#: O_DIRECT needs file offsets, lengths and memory addresses aligned to the device's
#: logical block; 4096 covers every common device.
DIRECT_IO_ALIGN = 4096


def buffer_address(buffer: memoryview) -> int:
    """Address of a contiguous buffer's first byte, read-only buffers included."""
    if not buffer.contiguous:
        raise ValueError("NIXL transfers need contiguous buffers")
    if buffer.nbytes == 0:
        return 0
    if not buffer.readonly:
        # ctypes is several times cheaper than numpy, and this runs for every buffer of
        # every NIXL request; it insists on a writable buffer, though.
        return ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    # numpy reads the address of any buffer-protocol object, including read-only bytes,
    # where ctypes.from_buffer would insist on a writable one.
    return int(
        np.frombuffer(buffer.cast("B") if buffer.format != "B" else buffer, dtype=np.uint8).ctypes.data
    )


def direct_io_ok(address: int, length: int, file_offset: int) -> bool:
    """Whether a transfer satisfies O_DIRECT's alignment rules."""
    return (address | length | file_offset) % DIRECT_IO_ALIGN == 0


class HostMemory:
    """The registered L1 arena of one adapter, plus per-batch registration of strays."""

    def __init__(self, runtime: NixlRuntime, backend: str, arena: memoryview | None) -> None:
        self._runtime = runtime
        self._backend = backend
        self._arena_start = 0
        self._arena_end = 0
        self._arena_registration: Registration | None = None
        self._lock = threading.Lock()
        # (start, end) of pinned staging memory; replaced, never mutated, so readers need
        # no lock.
        self._pinned: tuple[tuple[int, int], ...] = ()
        self._pinned_registrations: list[Registration] = []
        if arena is not None and arena.nbytes > 0:
            self._arena_start = buffer_address(arena)
            self._arena_end = self._arena_start + arena.nbytes
            self._arena_registration = runtime.register_dram(backend, [(self._arena_start, arena.nbytes)])

    def pin(self, buffer: memoryview) -> None:
        """Register ``buffer`` until :meth:`close`; the caller keeps its memory alive."""
        start = buffer_address(buffer)
        registration = self._runtime.register_dram(self._backend, [(start, buffer.nbytes)])
        with self._lock:
            self._pinned_registrations.append(registration)
            self._pinned = (*self._pinned, (start, start + buffer.nbytes))

    def is_registered(self, address: int, length: int) -> bool:
        """Whether the range lies in the arena or in pinned memory."""
        end = address + length
        if self._arena_start <= address and end <= self._arena_end:
            return True
        return any(start <= address and end <= stop for start, stop in self._pinned)

    def prepare(self, buffers: Sequence[memoryview]) -> tuple[list[int], Registration | None]:
        """Addresses of ``buffers`` and a registration covering those outside the arena."""
        addresses = [buffer_address(buffer) for buffer in buffers]
        strays = [
            (address, buffer.nbytes)
            for address, buffer in zip(addresses, buffers, strict=True)
            if buffer.nbytes and not self.is_registered(address, buffer.nbytes)
        ]
        registration = self._runtime.register_dram(self._backend, strays) if strays else None
        return addresses, registration

    def close(self) -> None:
        with self._lock:
            pinned, self._pinned_registrations, self._pinned = self._pinned_registrations, [], ()
        for registration in pinned:
            registration.release()
        if self._arena_registration is not None:
            self._arena_registration.release()
            self._arena_registration = None
