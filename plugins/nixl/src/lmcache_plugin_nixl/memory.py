"""Host-memory side of NIXL transfers: addresses of buffers and their registration.

The L1 arena is registered with the backend once, when the adapter starts; objects in it
transfer without further work.  Buffers outside the arena (bytes produced by a serde
chain, or a caller's own buffer) are registered for the duration of one batch, in one
call, and released after it.
"""

from __future__ import annotations

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
        if arena is not None and arena.nbytes > 0:
            self._arena_start = buffer_address(arena)
            self._arena_end = self._arena_start + arena.nbytes
            self._arena_registration = runtime.register_dram(backend, [(self._arena_start, arena.nbytes)])

    def in_arena(self, address: int, length: int) -> bool:
        return self._arena_start <= address and address + length <= self._arena_end

    def prepare(self, buffers: Sequence[memoryview]) -> tuple[list[int], Registration | None]:
        """Addresses of ``buffers`` and a registration covering those outside the arena."""
        addresses = [buffer_address(buffer) for buffer in buffers]
        strays = [
            (address, buffer.nbytes)
            for address, buffer in zip(addresses, buffers, strict=True)
            if buffer.nbytes and not self.in_arena(address, buffer.nbytes)
        ]
        registration = self._runtime.register_dram(self._backend, strays) if strays else None
        return addresses, registration

    def close(self) -> None:
        if self._arena_registration is not None:
            self._arena_registration.release()
            self._arena_registration = None
