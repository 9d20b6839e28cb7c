"""Record files on an fsspec filesystem (``memory://``, ``s3://``, ...): the same records,
names and layout as a local directory, through fsspec's file API.

A record is written to a temporary name and moved over its final name (object stores
write an object whole when its file closes, so a reader never sees part of one either
way).  A listing is one ``find`` with sizes: no record is opened.  Removing a record that
failed verification re-reads its header first and keeps it when a store replaced it
meanwhile.  As for a local directory, digest-named records whose header cannot be read
are removed when listed, and records where the layout does not put their key (another
``shard_dirs`` setting) are kept, counted and reported.
"""

from __future__ import annotations

import logging
import posixpath
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, suppress
from functools import partial
from typing import Any, NoReturn

from lmcache_plugin_fs.closing import explain_unwritten
from lmcache_tiers.plugin import (
    RECORD_ALIGN,
    BackendContext,
    BurstLog,
    DeleteFailures,
    EntryKind,
    FileLayout,
    HeaderSizes,
    KeptByDelete,
    KeyStripes,
    ObjectKey,
    ObjectSize,
    RecordError,
    RemovalFailures,
    WriteFailures,
    classify_name,
    copy_into,
    header_length,
    is_temp_name,
    judge_digest_record,
    log_unreadable_header,
    printable,
    record_name,
    record_verdict,
    redact_url_secrets,
    verify_payload,
)

log = logging.getLogger(__name__)

#: the record format's bound on a header
MAX_HEADER_BYTES = 1 << 16


def shown(text: str) -> str:
    """``text`` (a path, URL or error) as lines and errors name it: without the password a
    URL may carry (``ftp://user:password@host/...``; an ``http://`` store's paths are
    such URLs), which is the user's secret."""
    return printable(redact_url_secrets(text), 300)


class _Closing(Exception):
    """A store stopped because its adapter started closing (nothing published)."""


def _raising_listing(fs: Any) -> dict[str, Any]:
    """What makes ``fs.find`` raise for a directory it cannot list.  fsspec's generic walk
    leaves such a directory out (``on_error="omit"``), so an unreachable store would look
    empty: its records neither accounted nor swept.  A directory not found is still left
    out (a root not made yet is an empty store; a shard directory gone since the listing
    of its parent holds nothing to list).  Stores with a ``find`` of their own (s3fs) raise
    already, and take no ``on_error``."""
    from fsspec.asyn import AsyncFileSystem
    from fsspec.spec import AbstractFileSystem

    kind = type(fs)
    if isinstance(fs, AsyncFileSystem):
        generic = getattr(kind, "_find", None) is AsyncFileSystem._find
    else:
        generic = getattr(kind, "find", None) is AbstractFileSystem.find
    return {"on_error": _raise_unless_not_found} if generic else {}


def _raise_unless_not_found(exc: BaseException) -> None:
    if not isinstance(exc, FileNotFoundError):
        raise exc


class RemoteRecords:
    """Reads and writes the record files of one ``fs`` adapter through an fsspec filesystem."""

    def __init__(
        self,
        fs: Any,
        layout: FileLayout,
        context: BackendContext,
        *,
        read_ahead: int | None,
        failures: WriteFailures,
    ) -> None:
        self.fs = fs
        self.layout = layout
        self.context = context
        self.read_ahead = read_ahead
        self.failures = failures
        self.sizes = HeaderSizes(lambda key, payload: context.record_header(key, payload, align=RECORD_ALIGN))
        self._stripes = KeyStripes()
        #: keys a delete found another key's record (or a newer format's) under, counted
        #: then: the lookup core makes next reads the header, so their accounting goes --
        #: they are no records of this adapter -- without counting them again
        self._deletes = KeptByDelete(context)
        self._delete_failures = DeleteFailures(context.name, context.count)
        self._temps_left = BurstLog(log)
        #: see :meth:`remove_temp_files`
        self.files_elsewhere: list[str] = []
        fs.makedirs(layout.root, exist_ok=True)

    def close(self) -> None:
        pass

    def _stripe(self, key: ObjectKey) -> threading.Lock:
        return self._stripes.of(key)

    # -- stores -------------------------------------------------------------------------------

    def write_many(self, keys: Sequence[ObjectKey], payloads: Sequence[memoryview]) -> list[bool]:
        """Records not yet published when the adapter starts closing fail (core counts them
        ``store_keys_failed``; one log line says why), as in a local directory."""
        results = [self._write(key, payload) for key, payload in zip(keys, payloads, strict=True)]
        explain_unwritten(self.context.name, self.context.closing, results)
        return results

    def _write(self, key: ObjectKey, payload: memoryview) -> bool:
        """Write ``key``'s record to a temporary object and move it over the record.

        Once the adapter is closing nothing more is written and nothing published: core
        closes the backend past its deadline while a call is stuck (a hung network store),
        fails the store and hands its payload buffer back, which may hold another object
        by then.  So the flag is asked before the temporary object is opened and right
        before the move; a store stopped there removes its temporary object and fails."""
        if self.context.closing:
            return False
        header_len = self.sizes.length(key)
        temp = self.layout.temp_path(key)
        try:
            header = self.context.record_header(key, payload, align=RECORD_ALIGN)
            if len(header) != header_len:
                self.context.header_too_long(key, len(header), header_len)
                return False
            self.fs.makedirs(posixpath.dirname(temp), exist_ok=True)
            self.fs.makedirs(self.layout.directory_for(key), exist_ok=True)
            if self.context.closing:
                raise _Closing
            with self.fs.open(temp, "wb") as handle:
                handle.write(header)
                handle.write(payload)
            if self.context.closing:
                raise _Closing
            with self._stripe(key):
                self._publish(temp, self.layout.path_for(key), header, header_len + payload.nbytes)
            return True
        except _Closing:
            pass  # logged by write_many
        except ValueError as exc:  # an unencodable header, or a store's refusal quoting its URL
            log.warning(
                "%s: cannot store %s: %s", self.context.name, shown(record_name(key)), shown(str(exc))
            )
        except Exception as exc:  # OSError, or what an fsspec store raises of its own (botocore, gcs)
            self.failures.failed(record_name(key), exc)
        self._remove_temp(temp)
        return False

    def _remove_temp(self, temp: str, published: str | None = None) -> None:
        """Remove the temporary object of a store that failed (or whose move published
        ``published`` all the same).  One that stays holds bytes no capacity counts until
        the next start removes it: counted (``store_temp_objects_left``) and told once a
        burst -- when the store went away, every store leaves one."""
        try:
            self.fs.rm_file(temp)
            return
        except FileNotFoundError:
            return  # never created (the open failed), or gone with a move that failed late
        except Exception as exc:  # what the filesystem raises is its own
            failure = exc
        if not self._may_exist(temp):
            return  # a store that cannot remove objects (read-only) created none either
        self.context.count("store_temp_objects_left", 1)
        self._temps_left.warn(
            "temp_left",
            "%s: cannot remove the temporary object %s of %s: %s (removed at the next start)",
            self.context.name,
            shown(temp),
            "a failed store" if published is None else f"the stored record {shown(published)}",
            shown(str(failure)),
        )

    def _may_exist(self, path: str) -> bool:
        """Whether ``path`` may be there: True unless the store says it is absent."""
        try:
            return bool(self.fs.exists(path))
        except Exception:
            return True

    def _publish(self, temp: str, path: str, header: bytes, size: int) -> None:
        """Move ``temp`` over ``path``.  On an object store ``mv`` copies, then deletes the
        temporary object: when only that delete failed, the record is published all the
        same, and failing the store would leave a record no accounting counts."""
        try:
            self.fs.mv(temp, path)
        except Exception:
            if not self._holds(path, header, size):
                raise
            self._remove_temp(temp, published=path)

    def _holds(self, path: str, header: bytes, size: int) -> bool:
        """Whether ``path`` is the record of ``header`` (which carries the payload's
        checksum) at its full size."""
        try:
            if self._size_or_raise(path) != size:
                return False
            with self.fs.open(path, "rb") as handle:
                return bool(handle.read(len(header)) == header)
        except Exception:
            return False

    # -- lookups and loads ----------------------------------------------------------------------

    def _size(self, path: str) -> int | None:
        """The size of ``path``; None if it is absent or cannot be asked about."""
        try:
            return self._size_or_raise(path)
        except OSError:
            return None

    def _size_or_raise(self, path: str) -> int | None:
        """The size of ``path``, None if it is absent -- or a directory, which holds no
        record (its size is the directory's own, which read as a record's would make a
        hit of it, or a damaged record to remove); other errors raise."""
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        size = info.get("size")
        return int(size) if size is not None else None

    def stored_size(self, key: ObjectKey) -> int | ObjectSize | None:
        path = self.layout.path_for(key)
        # A store that cannot be asked (a network error, EIO) fails the lookup batch, every
        # key a miss, instead of answering "absent": core takes that for a record removed
        # behind its back and forgets it.
        size = self._size_or_raise(path)
        if size is None:
            return None
        stored = size - self.sizes.length(key)
        if stored < 0:
            self.discard(key, size, None, "truncated_records_removed", "shorter than its header")
            return None
        # A key a delete found another key's record (or a newer format's) under is asked
        # of the header too: a size core knows of it came from a listing that read the
        # name only.
        counted = self._deletes.counted(key)
        if self.context.l1_size_of(key) is not None and counted is None:
            return stored
        # A key core does not know: its header tells the L1 size under a size-changing
        # chain, and whether the record is of this key at all (a hit is adopted, and
        # evicting it would delete another writer's object).
        try:
            with self.fs.open(path, "rb") as handle:
                prefix = handle.read(self.sizes.length(key))
            header = self.context.read_record_header(prefix, key)
        except RecordError as exc:
            # not counted again when the delete that found it counted (and logged) it
            if not self.context.kept_record(key, exc, counted=counted is record_verdict(exc)):
                self.discard(key, size, prefix, "corrupt_records_removed", str(exc))
            return None
        except FileNotFoundError:
            return None  # removed since the size was read (other errors fail the batch)
        return None if header is None else ObjectSize(header.payload_len, header.l1_size)

    def read_many(self, keys: Sequence[ObjectKey], buffers: Sequence[memoryview]) -> list[bool]:
        return [self._read(key, buffer) for key, buffer in zip(keys, buffers, strict=True)]

    def _read(self, key: ObjectKey, buffer: memoryview) -> bool:
        if self.context.closing:
            return False  # the buffer may belong to another object by now
        path = self.layout.path_for(key)
        header_len = self.sizes.length(key)
        options = {"block_size": self.read_ahead} if self.read_ahead else {}
        prefix = b""
        size = 0
        try:
            with self.fs.open(path, "rb", **options) as handle:
                size = int(handle.size)
                prefix = handle.read(header_len)
                header = self.context.read_record_header(prefix, key)
                if header is None:
                    return False  # another serde chain: kept
                if header.header_len + header.payload_len != size:
                    raise RecordError(
                        f"file is {size} bytes, its header says {header.header_len + header.payload_len}"
                    )
                if header.header_len != header_len or header.payload_len != buffer.nbytes:
                    # Another intact object (replaced since the lookup by another writer:
                    # another chunk size, or a header not padded as this one pads it): a
                    # miss, kept, counted and told as the local loads do.
                    self.context.count("load_size_changed")
                    self.context.warn(
                        "size_changed",
                        "%s is a record of %d bytes (header %d, payload %d), a load expected %d (header "
                        "%d, payload %d) (replaced since the lookup): a miss, kept",
                        shown(path),
                        size,
                        header.header_len,
                        header.payload_len,
                        header_len + buffer.nbytes,
                        header_len,
                        buffer.nbytes,
                    )
                    return False
                data = handle.read(buffer.nbytes)
            if len(data) != buffer.nbytes:
                raise RecordError(f"payload is {len(data)} bytes, its header says {buffer.nbytes}")
            verify_payload(header, data)
            if self.context.closing:
                # Core closes the backend past its deadline even while a read is stuck (a
                # hung store); the buffer may hold another object by then: a miss.
                return False
            copy_into(buffer, data)
            return True
        except FileNotFoundError:
            return False
        except RecordError as exc:
            if not self.context.kept_record(key, exc):
                self.discard(key, size, prefix, "corrupt_records_removed", str(exc))
        except OSError as exc:
            # A store that cannot be read fails every load alike (a network store gone):
            # each is counted, a burst is one line.
            self.context.count("load_read_errors")
            self.context.warn("load_read_error", "cannot read %s: %s", shown(path), shown(str(exc)))
        return False

    # -- removal --------------------------------------------------------------------------------

    def discard(self, key: ObjectKey, size: int, prefix: bytes | None, counter: str, reason: str) -> bool:
        """Remove a record judged bad, unless a store replaced it since (other size or
        header); its bytes are released (``record_removed``)."""
        accounted = self.context.accounted_size(key)  # before: a store settling since keeps its own
        path = self.layout.path_for(key)
        if not self._discard_path(path, self._stripe(key), size, prefix, counter, reason):
            return False
        self.context.record_removed(key, accounted)
        return True

    def _discard_path(
        self,
        path: str,
        lock: AbstractContextManager[Any],
        size: int,
        prefix: bytes | None,
        counter: str,
        reason: str,
    ) -> bool:
        """:meth:`discard` of ``path``; ``lock`` keeps the stores that could replace it out."""
        with lock:
            if self._size(path) != size:
                return False
            if prefix is not None:
                try:
                    with self.fs.open(path, "rb") as handle:
                        if handle.read(len(prefix)) != prefix:
                            return False
                except OSError:
                    return False
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                return False
            except (OSError, ValueError) as exc:
                # the damage stays, a miss at every lookup: counted, as its removal would be
                self.context.count("corrupt_remove_failures")
                log.warning(
                    "%s: cannot remove %s (%s): %s; it stays a miss",
                    self.context.name,
                    shown(path),
                    printable(reason, 300),
                    shown(str(exc)),
                )
                return False
        self.context.count(counter)
        log.warning("%s: removed %s: %s", self.context.name, shown(path), printable(reason, 300))
        return True

    def delete(self, key: ObjectKey) -> bool:
        path = self.layout.path_for(key)
        with self._stripe(key):
            try:
                if self._of_another_key(key, path):
                    return False
                self.fs.rm_file(path)
                return True
            except FileNotFoundError:
                return False
            except Exception as exc:  # OSError, or an fsspec store's own error: this key alone
                self._delete_failures.failed(path, exc)
                return False

    def _of_another_key(self, key: ObjectKey, path: str) -> bool:
        """Whether ``path`` holds an intact record of another key, or a record of a format
        version this code does not read (counted and logged).  The listing reads names
        only, so it accounts, e.g., the object an ``s3`` adapter sharing the folder stored
        for a key salted "t.bin" as the key salted "t" here; a delete of that key (the L2
        eviction's) must leave the other writer's object.  A newer server sharing the
        folder reads a record of its format: lookups keep it, and so does a delete.  A
        file that is no readable record is the key's to remove."""
        # Ranged reads: a file opened for reading may fetch a whole block (megabytes).
        prefix = bytes(self.fs.cat_file(path, start=0, end=self.sizes.length(key)))
        with suppress(RecordError):  # judged with the rest of the header below
            wanted = header_length(prefix)
            if wanted > len(prefix):  # a longer header than this key's (another key's)
                prefix += bytes(self.fs.cat_file(path, start=len(prefix), end=wanted))
        return self._deletes.keeps(key, prefix)

    # -- the tree -------------------------------------------------------------------------------

    def _entries(
        self,
        on_unlisted: Callable[[str, Exception], None] | None = None,
        elsewhere: list[str] | None = None,
    ) -> Iterator[tuple[str, str, int]]:
        """(directory, name, size) of every file in the directories of this store (the
        root, shard directories, the temporary directory): ``find`` lists the whole tree,
        and what lies deeper belongs to another store (one nested under this root), whose
        records and in-flight temporary files the sweeps must not remove.  A tree that
        cannot be listed raises, or is told to ``on_unlisted`` (a sweep) and yields nothing.
        The paths of the other files are appended to ``elsewhere`` when given."""
        try:
            found = self.fs.find(self.layout.root, detail=True, withdirs=False, **_raising_listing(self.fs))
        except FileNotFoundError:
            return
        except Exception as exc:  # OSError, or what an fsspec store raises of its own
            if on_unlisted is None:
                raise
            on_unlisted(self.layout.root, exc)
            return
        for path, info in found.items():
            path = str(path)
            if not path.startswith("/") and self.layout.root.startswith("/"):
                path = "/" + path
            directory, name = posixpath.split(path)
            if self.layout.is_store_directory(directory):
                yield directory, name, int(info.get("size") or 0)
            elif elsewhere is not None:
                elsewhere.append(path)

    def iter_records(self, header_length: Callable[[ObjectKey], int]) -> Iterator[tuple[ObjectKey, int]]:
        """``(key, payload bytes)`` of every record in this layout (see the local
        directory's listing, which this one follows)."""
        misplaced = self.layout.misplaced_records(self.context.name, self.context.count)
        for directory, name, size in self._entries():
            kind, key = classify_name(name)
            if kind is EntryKind.DIGEST:
                key = self._digest_record_key(directory, name, size)
            elif kind is not EntryKind.RECORD:
                continue
            if key is None:
                continue  # a digest record judged above
            if not self.layout.owns(directory, key):
                misplaced.found(directory, key)
                continue
            stored = size - self.sizes.length(key)
            if stored < 0:
                self.discard(
                    key, size, None, "truncated_records_removed", f"{size} bytes, shorter than its header"
                )
                continue
            yield key, stored
        misplaced.report()

    def _digest_record_key(self, directory: str, name: str, size: int) -> ObjectKey | None:
        """The key of a digest-named record, from its header; None if it has none (one
        judged damaged is removed and counted, as in a local directory:
        ``judge_digest_record``).  A read error says nothing about the file: it is counted
        and left."""
        path = posixpath.join(directory, name)
        try:
            with self.fs.open(path, "rb") as handle:
                prefix = handle.read(MAX_HEADER_BYTES)
        except FileNotFoundError:
            return None  # deleted since the tree was listed
        except OSError as exc:
            self.context.count("listing_read_errors")
            log_unreadable_header(self.context.name, path, exc)
            return None
        judged = judge_digest_record(prefix, path, size, store=self.context.name, count=self.context.count)
        if isinstance(judged, tuple):
            self._discard_path(path, self._stripes.every(), size, prefix, *judged)
            return None
        return judged

    def remove_temp_files(self) -> int:
        """Delete temporary files a killed writer left behind; returns how many.  One that
        cannot be removed, or a tree that cannot be listed, fails the start as on a local
        directory (``LocalFiles.remove_temp_files``): counted, one line naming it.

        The paths of the files outside this store's directories are kept in
        :attr:`files_elsewhere` until :meth:`take_files_elsewhere` (the search for
        temporary directories no record names reads them instead of listing again)."""
        self.files_elsewhere = []
        removed = 0
        unlisted = partial(self._sweep_failed, "directories_not_listed", "list")
        not_removed = partial(
            self._sweep_failed, "temp_files_not_removed", "remove the leftover temporary file"
        )
        for directory, name, _size in self._entries(on_unlisted=unlisted, elsewhere=self.files_elsewhere):
            if is_temp_name(name):
                removed += self._remove(posixpath.join(directory, name), not_removed)
        if removed:
            log.info("%s: removed %d temporary files left by an interrupted run", self.context.name, removed)
        self.context.count("orphan_temp_files_removed", removed)
        return removed

    def take_files_elsewhere(self) -> list[str]:
        """The paths :meth:`remove_temp_files` found outside this store's directories,
        handed over once (a tree of another store nested here may be large)."""
        files, self.files_elsewhere = self.files_elsewhere, []
        return files

    def _sweep_failed(self, counter: str, what: str, path: str, exc: Exception) -> NoReturn:
        self.context.count(counter)
        raise OSError(f"{self.context.name}: cannot {what} {shown(path)}: {shown(str(exc))}") from exc

    def remove_all_records(self) -> int:
        """Delete every record and temporary file of either layout; one that cannot be
        removed does not stop the others, and is counted and told (``RemovalFailures``)."""
        removed, failures = 0, RemovalFailures(self.context.name, self.context.count)
        for directory, name, _size in self._entries(on_unlisted=failures.unlisted):
            if classify_name(name).kind is not EntryKind.FOREIGN:
                removed += self._remove(posixpath.join(directory, name), failures.failed)
        failures.report(removed)
        return removed

    def _remove(self, path: str, failed: Callable[[str, Exception], None]) -> bool:
        """Remove ``path`` for a sweep; whether it was.  Gone meanwhile is no failure;
        any other error is told to ``failed``."""
        try:
            self.fs.rm_file(path)
            return True
        except FileNotFoundError:
            return False  # removed meanwhile
        except Exception as exc:  # what the filesystem raises is its own
            failed(path, exc)
            return False
