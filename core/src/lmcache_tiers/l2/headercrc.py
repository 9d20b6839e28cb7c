"""The crc32 of a record header without running crc32 over its zero padding.

A record header (:mod:`lmcache_tiers.l2.record`) is a few hundred bytes of fields, then
zero padding up to its alignment (4096 bytes in the file stores), then a crc32 of
everything before it.  Every load checks that crc, and running ``zlib.crc32`` over ~4 KiB
of zeros per object cost a measurable share of a 1 MiB load (a few microseconds on this
project's machines, against ~170 us for the payload's copy).

CRC-32 is affine over GF(2): the crc of ``body`` followed by ``n`` zero bytes is a fixed
affine function of ``crc32(body)`` alone, ``E_n(c) = L_n(c) ^ E_n(0)`` with ``L_n``
linear.  :func:`crc32_zero_padded` evaluates it from four 256-entry tables per padding
length (built once from ``zlib.crc32`` itself, so they cannot disagree with it), after
checking with one ``memcmp`` that the padding really is all zeros.  Padding that is not
falls back to ``zlib.crc32`` over the whole range, so the value returned is always
exactly ``zlib.crc32(data[:end])``.
"""

from __future__ import annotations

import threading
import zlib
from typing import Final

__all__ = ["crc32_zero_padded"]

#: longest zero run checked against (a header is at most 64 KiB, see record.MAX_HEADER_LEN)
_ZEROS: Final = bytes(1 << 16)
#: below this much padding zlib.crc32 over it costs less than the table lookups
_MIN_PADDING: Final = 256
#: padding lengths whose tables are kept: a store uses a handful (one per key length);
#: damaged headers must not grow the cache without bound
_MAX_TABLES: Final = 64

_Tables = tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
_tables: dict[int, _Tables] = {}
_tables_lock = threading.Lock()


def _build(length: int) -> _Tables:
    """``E_length(0)`` and the linear part ``L_length`` split into one table per byte of
    the input crc: ``L(c) = T0[c & 255] ^ T1[c >> 8 & 255] ^ T2[c >> 16 & 255] ^ T3[c >> 24]``."""
    zeros = _ZEROS[:length]
    offset = zlib.crc32(zeros, 0)
    images = [zlib.crc32(zeros, 1 << bit) ^ offset for bit in range(32)]
    tables: list[tuple[int, ...]] = []
    for byte_index in range(4):
        bits = images[8 * byte_index : 8 * byte_index + 8]
        table = [0] * 256
        for value in range(1, 256):
            low = value & -value  # the lowest set bit: the rest of value is already done
            table[value] = table[value ^ low] ^ bits[low.bit_length() - 1]
        tables.append(tuple(table))
    return offset, tables[0], tables[1], tables[2], tables[3]


def _tables_for(length: int) -> _Tables:
    tables = _tables.get(length)
    if tables is None:
        tables = _build(length)
        with _tables_lock:
            if len(_tables) >= _MAX_TABLES:
                _tables.clear()
            _tables[length] = tables
    return tables


def crc32_zero_padded(data: memoryview, body_end: int, end: int) -> int:
    """``zlib.crc32(data[:end])``, cheaply when ``data[body_end:end]`` is all zeros.

    ``data`` is a byte view; ``0 <= body_end <= end <= len(data)``.
    """
    padding = end - body_end
    if padding < _MIN_PADDING or not _ZEROS.startswith(data[body_end:end]):
        return zlib.crc32(data[:end])
    offset, t0, t1, t2, t3 = _tables_for(padding)
    crc = zlib.crc32(data[:body_end])
    return offset ^ t0[crc & 255] ^ t1[crc >> 8 & 255] ^ t2[crc >> 16 & 255] ^ t3[crc >> 24]
