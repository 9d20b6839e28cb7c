"""Test helpers for file-backed adapters: a page-aligned arena and a small filesystem.

``small_tmpfs`` mounts a tmpfs of a few MiB so tests can fill a filesystem for real
(ENOSPC, not a mock); it needs root and skips, with the reason printed, otherwise.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["AlignedArena", "small_tmpfs"]


class AlignedArena:
    """Page-aligned stand-in for the L1 arena; ``take`` hands out 4096-aligned slices."""

    def __init__(self, size: int = 64 << 20) -> None:
        self._map = mmap.mmap(-1, size)
        self.view = memoryview(self._map)
        self._offset = 0

    def take(self, size: int) -> memoryview:
        start = -(-self._offset // 4096) * 4096
        if start + size > self.view.nbytes:
            raise MemoryError("test arena exhausted")
        self._offset = start + size
        return self.view[start : start + size]

    def filled(self, data: bytes) -> memoryview:
        view = self.take(len(data))
        view[:] = data
        return view


@contextmanager
def small_tmpfs(size_bytes: int) -> Iterator[str]:
    """A freshly mounted tmpfs of ``size_bytes``, unmounted afterwards (root only)."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill it needs root")
    directory = tempfile.mkdtemp(prefix="lmcache-tmpfs-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", directory],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", directory], check=False)
        os.rmdir(directory)
