"""Record files: header sizes known without reading a file, and write failures counted.

A record file is core's record header (:mod:`lmcache_tiers.l2.record`) padded to
:data:`RECORD_ALIGN` bytes, then the payload.  The padding keeps payloads block-aligned
for ``O_DIRECT``, and it makes the header's length a function of the key alone (keys,
layouts and serde chains are far shorter than a block), so a listing learns an object's
size from the file size without opening it.  A header that came out longer than that is
refused when it is written, never read at the wrong offset.
"""

from __future__ import annotations

import errno
from collections.abc import Callable

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.keycodec import printable
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.record import MAX_HEADER_LEN, decode_header

__all__ = [
    "MAX_HEADER_LEN",
    "RECORD_ALIGN",
    "HeaderSizes",
    "WriteFailures",
    "is_out_of_space",
    "record_key",
    "unreadable_header_counter",
]

#: headers are padded to this, the payload starts on a block boundary
RECORD_ALIGN = 4096


class HeaderSizes:
    """Padded header length of each key's record, cached per encoded key length."""

    def __init__(self, encode_header: Callable[[ObjectKey, memoryview], bytes]) -> None:
        self._encode = encode_header
        self._lengths: dict[int, int] = {}

    def length(self, key: ObjectKey) -> int:
        key_len = len(key.to_bytes())
        length = self._lengths.get(key_len)
        if length is None:
            length = len(self._encode(key, memoryview(b"")))
            self._lengths[key_len] = length
        return length


def record_key(data: bytes | memoryview) -> ObjectKey:
    """The key a record header names (for digest-named files, whose name does not tell);
    raises a :class:`~lmcache_tiers.l2.record.RecordError` for a damaged header."""
    return decode_header(data).key


def unreadable_header_counter(file_size: int) -> str:
    """The counter of a removed record whose header cannot be read (a digest-named one,
    whose key only the header tells): like a named record, one shorter than its header is
    truncated -- every header is at least ``RECORD_ALIGN`` bytes, being padded to it --
    and a longer one with a header that does not decode is corrupt."""
    return "truncated_records_removed" if file_size < RECORD_ALIGN else "corrupt_records_removed"


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class WriteFailures:
    """Counts and logs records that could not be written, once per burst of each kind.

    ``store_no_space``: the filesystem is full (or the quota reached) -- the rest of the
    batch is still tried, as smaller records may fit; ``store_io_errors``: anything else.
    """

    def __init__(self, name: str, root: str, count: Callable[[str, int], None]) -> None:
        self.name = name
        self.root = root
        self._count = count
        self._burst = BurstLog()

    def failed(self, key_name: str, exc: BaseException) -> None:
        if is_out_of_space(exc):
            self._count("store_no_space", 1)
            self._burst.warn(
                "no_space",
                "%s: no space left in %s: stores fail until space returns (first: %s)",
                self.name,
                printable(self.root, 200),
                printable(key_name, 200),
            )
            return
        self._count("store_io_errors", 1)
        self._burst.warn(
            "io_error",
            "%s: cannot write %s: %s",
            self.name,
            printable(key_name, 200),
            printable(str(exc), 300),
        )
