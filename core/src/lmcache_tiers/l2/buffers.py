"""Byte copies for adapters that keep objects in memory (or stage them there).

A ``memoryview`` slice assignment (``target[:] = source``) copies with the GIL held, so
while an adapter thread copies a multi-MiB object, the front end and the controllers
cannot run even on an idle core.  :func:`copy_into` does the same copy through numpy,
which releases the GIL for the memcpy; small copies stay on the plain path, where the
GIL hand-off would cost more than the copy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GIL_FREE_COPY_BYTES", "copy_into", "copy_views"]

#: copies of at least this many bytes release the GIL
GIL_FREE_COPY_BYTES = 64 << 10


def copy_views(target: memoryview, source: bytes | bytearray | memoryview) -> tuple[memoryview, memoryview]:
    """Byte views of a copy's two sides, once checked: ``ValueError`` when their lengths
    differ, ``TypeError`` for a read-only target."""
    out = memoryview(target).cast("B")
    data = memoryview(source).cast("B")
    if out.readonly:
        raise TypeError("cannot copy into a read-only buffer")
    if out.nbytes != data.nbytes:
        raise ValueError(f"cannot copy {data.nbytes} bytes into a buffer of {out.nbytes}")
    return out, data


def copy_into(target: memoryview, source: bytes | bytearray | memoryview) -> None:
    """Copy all of ``source`` into the writable ``target`` of exactly the same length.

    Both must be C-contiguous; they are copied as bytes whatever their format.  Raises
    ``ValueError`` when the lengths differ (never a partial or broadcast copy) and
    ``TypeError`` for a read-only target, whichever path the copy takes.
    """
    out, data = copy_views(target, source)
    if out.nbytes < GIL_FREE_COPY_BYTES:
        out[:] = data
        return
    np.copyto(np.frombuffer(out, dtype=np.uint8), np.frombuffer(data, dtype=np.uint8))
