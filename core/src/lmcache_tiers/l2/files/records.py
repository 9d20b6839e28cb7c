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
import logging
import os
from collections.abc import Callable

from lmcache_tiers.burst import BurstLog
from lmcache_tiers.config import redact_url_secrets
from lmcache_tiers.keycodec import printable
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.files.layout import record_name
from lmcache_tiers.l2.record import MAX_HEADER_LEN, RecordError, decode_header, record_verdict

_log = logging.getLogger("lmcache_tiers.l2.files")

__all__ = [
    "MAX_HEADER_LEN",
    "RECORD_ALIGN",
    "DeleteFailures",
    "HeaderSizes",
    "RemovalFailures",
    "WriteFailures",
    "is_out_of_space",
    "judge_digest_record",
    "keeps_unlisted",
    "log_unreadable_header",
    "record_key",
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


def judge_digest_record(
    data: bytes | memoryview, path: str, file_size: int, *, store: str, count: Callable[[str, int], None]
) -> ObjectKey | tuple[str, str] | None:
    """The key a digest-named record file at ``path`` holds, from its header ``data``; or,
    for a file to be removed, (the counter, the reason); or None for a record that is kept
    and not listed (its key unknown here): one of a format version this code does not
    read, which a newer server sharing the store wrote and reads (counted and logged by
    :func:`keeps_unlisted`).

    No lookup can reach a file whose header does not tell its key, so one whose header
    cannot be read (zero-length, torn, garbage) goes as a named record would:
    ``truncated_records_removed`` when shorter than any header (every header is padded to
    ``RECORD_ALIGN``), ``corrupt_records_removed`` otherwise.  So does one whose header
    names a key whose record has another name: no writer puts a record there (a load of
    this name's key would find it another key's, and keep it as a miss).  (Two keys of
    one digest name -- a hash collision -- share one file whose header names one of
    them, and that key's record name is this one: kept.)
    """
    name = os.path.basename(path)
    try:
        key = record_key(data)
    except RecordError as exc:
        if keeps_unlisted(store, path, exc, count):
            return None
        counter = "truncated_records_removed" if file_size < RECORD_ALIGN else "corrupt_records_removed"
        return counter, str(exc)
    if record_name(key) != name:
        return "corrupt_records_removed", (
            f"its header names {key.file_stem()}, whose record is {record_name(key)}"
        )
    return key


#: the lines of records a listing keeps unlisted: a newer server may have written many
_UNLISTED_LINES = BurstLog(_log)


def shown(text: str, limit: int = 300) -> str:
    """``text`` (a path, or an error that may quote one) as lines and errors name it: an
    fsspec store's paths are whole URLs, and an ``http://`` store's carry its password."""
    return printable(redact_url_secrets(text), limit)


def keeps_unlisted(store: str, path: str, error: RecordError, count: Callable[[str, int], None]) -> bool:
    """A listing's :func:`~lmcache_tiers.l2.record.record_verdict` on a record whose header
    it read to learn the key (a digest-named one) and which raised ``error``.  True: kept
    and not listed -- a newer format's, counted (``record_version_unknown``) and logged
    here.  False: damaged -- the caller removes it and counts it."""
    verdict = record_verdict(error)
    if verdict.kept:
        count(verdict.counter, 1)
        _UNLISTED_LINES.warn(
            f"{store}:{verdict.counter}",
            "%s: %s: %s; not listed, kept",
            store,
            shown(path),
            shown(str(error)),
        )
    return verdict.kept


def log_unreadable_header(store: str, path: str, exc: OSError) -> None:
    """The line for a record file whose header a listing could not read (counted as
    ``listing_read_errors`` by the caller): a read error is not damage, the file stays."""
    _log.warning(
        "%s: cannot read the header of %s: %s; it is not listed (kept: a read error is not damage)",
        store,
        shown(path),
        shown(str(exc)),
    )


def is_out_of_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


class RemovalFailures:
    """The record files a sweep removing every record of a store could not remove.

    One such file does not stop the sweep -- the others still go -- and none passes
    unseen: each is counted (``records_not_removed``) as it fails, and :meth:`report`
    tells them in one line and raises once the sweep is done.  A store that still holds
    records must not be taken for emptied: at start (``recover_on_start`` false) they
    would be served; at close they stay on disk, each complete and checksummed.
    """

    def __init__(self, store: str, count: Callable[[str, int], None]) -> None:
        self._store = store
        self._count = count
        self._failed = 0
        self._first = ""
        self._unlisted = 0
        self._first_unlisted = ""

    @property
    def count(self) -> int:
        """Files that could not be removed and directories that could not be read so far
        (a sweep stops reading again once it grew: nothing is counted twice)."""
        return self._failed + self._unlisted

    def failed(self, path: str, exc: BaseException) -> None:
        """``path`` could not be removed (``exc``)."""
        self._failed += 1
        self._count("records_not_removed", 1)
        if not self._first:
            self._first = f"{shown(path)}: {shown(str(exc))}"

    def unlisted(self, directory: str, exc: BaseException) -> None:
        """``directory`` could not be read (``exc``): whatever records it holds stay.  The
        sweep goes on with the other directories; this is counted
        (``directories_not_listed``), told in a line now and reported at the end."""
        self._unlisted += 1
        self._count("directories_not_listed", 1)
        _log.warning(
            "%s: cannot list %s: %s (its records stay)", self._store, shown(directory), shown(str(exc))
        )
        if not self._first_unlisted:
            self._first_unlisted = f"{shown(directory)}: {shown(str(exc))}"

    def report(self, removed: int) -> None:
        """After the sweep that removed ``removed`` files: one line, and an OSError, if
        any file could not be removed or any directory not be read."""
        if not self._failed and not self._unlisted:
            return
        told = []
        if self._failed:
            told.append(
                f"{self._failed} record files could not be removed and stay (the first: {self._first})"
            )
        if self._unlisted:
            told.append(
                f"{self._unlisted} directories could not be listed and their records stay "
                f"(the first: {self._first_unlisted})"
            )
        message = f"{'; '.join(told)}; {removed} were removed"
        _log.warning("%s: %s", self._store, message)
        raise OSError(message)


class DeleteFailures:
    """Counts deletes of records that failed for another reason than "no such file"
    (``delete_io_errors``: EIO, EACCES, ENOTDIR, a store's own error), logging one line per
    burst.  Such a record may be intact and stays accounted, so the L2 eviction offers it
    again each cycle: every attempt is counted, the log tells the burst."""

    def __init__(self, store: str, count: Callable[[str, int], None]) -> None:
        self._store = store
        self._count = count
        self._burst = BurstLog(_log)

    def failed(self, path: str, exc: BaseException) -> None:
        self._count("delete_io_errors", 1)
        self._burst.warn("delete", "%s: cannot delete %s: %s", self._store, shown(path), shown(str(exc)))


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
                shown(self.root, 200),
                shown(key_name, 200),
            )
            return
        self._count("store_io_errors", 1)
        self._burst.warn(
            "io_error",
            "%s: cannot write %s: %s",
            self.name,
            shown(key_name, 200),
            shown(str(exc)),
        )
