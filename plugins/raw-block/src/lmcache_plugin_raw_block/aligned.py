"""Aligned memory for ``O_DIRECT``: buffer addresses and reusable staging blocks.

``O_DIRECT`` wants every buffer address, length and file offset aligned to the device's
logical block.  Staging blocks come from anonymous mappings populated when created --
first touches of fresh memory are slow, so each block is made once and reused for every
later batch (one set per worker thread, kept for the adapter's lifetime).
"""

from __future__ import annotations

import mmap
import threading

import numpy as np


def address_of(buffer: memoryview) -> int:
    """Address of a contiguous buffer's first byte (read-only buffers too)."""
    if buffer.nbytes == 0:
        return 0
    return int(
        np.frombuffer(buffer.cast("B") if buffer.format != "B" else buffer, dtype=np.uint8).ctypes.data
    )


def round_up(value: int, align: int) -> int:
    return -(-value // align) * align


class AlignedBlock:
    """``size`` bytes at an address that is a multiple of ``align``, populated at once."""

    def __init__(self, size: int, align: int) -> None:
        # Anonymous mappings are page-aligned; a larger alignment needs some slack.
        slack = 0 if align <= mmap.PAGESIZE else align
        self._map = mmap.mmap(-1, size + slack, flags=mmap.MAP_PRIVATE | mmap.MAP_POPULATE)
        whole = memoryview(self._map)
        start = (-address_of(whole)) % align
        self.view = whole[start : start + size]
        self.size = size

    def close(self) -> None:
        self.view.release()
        try:
            self._map.close()
        except BufferError:
            pass  # a view a caller still holds keeps it mapped until collected


class Staging:
    """Per-thread staging for one slot I/O: a header block, a tail block, and a block as
    large as a slot's payload for buffers that are not aligned (created on first use)."""

    def __init__(self, header_bytes: int, payload_bytes: int, align: int) -> None:
        self._header_bytes = header_bytes
        self._payload_bytes = payload_bytes
        self._align = align
        self._local = threading.local()
        self._all: list[AlignedBlock] = []
        self._lock = threading.Lock()

    def _block(self, name: str, size: int) -> memoryview:
        block: AlignedBlock | None = getattr(self._local, name, None)
        if block is None:
            block = AlignedBlock(size, self._align)
            with self._lock:
                self._all.append(block)
            setattr(self._local, name, block)
        return block.view

    def header(self) -> memoryview:
        return self._block("header", self._header_bytes)

    def tail(self) -> memoryview:
        return self._block("tail", self._align)

    def payload(self) -> memoryview:
        return self._block("payload", self._payload_bytes)

    def close(self) -> None:
        with self._lock:
            blocks, self._all = self._all, []
        for block in blocks:
            block.close()
