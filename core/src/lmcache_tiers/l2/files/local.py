"""A file-per-object store in a local directory: create, publish, discard, list, sweep.

Everything here that changes a key's record file -- publishing a new one, removing a
damaged or truncated one, deleting -- holds that key's stripe lock, and removals check
that the file is still the one that was judged (same device and inode): a record that a
store published meanwhile is never removed by a reader that found the previous one bad.

Fsync policy: with ``fsync=False`` (the default) nothing is fsynced.  A killed process
loses nothing the kernel already has; after a power loss or kernel crash a record may be
lost or torn, and a torn record fails its checksum on load and is a miss, never wrong
bytes.  With ``fsync=True`` each record is fsynced before it is renamed and its directory
after, so a store acknowledged to the controller survives a power loss too; a store whose
directory cannot be fsynced fails, and the record it published is removed again.

The listing serves the records of this layout only.  Records it cannot serve are never
skipped unseen: a digest-named record whose header cannot be read is removed and counted
like a damaged named one, and records left where the other ``shard_dirs`` setting (or a
hand) put them are counted and reported, and kept.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial
from typing import Any, NamedTuple, NoReturn, Protocol

from lmcache_tiers.keycodec import is_digest_name, name_to_key, printable
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.files.durable import fsync_directory, make_directories
from lmcache_tiers.l2.files.layout import (
    RECORD_SUFFIX,
    EntryKind,
    FileLayout,
    MisplacedRecords,
    classify_name,
    is_shard_name,
    is_temp_name,
)
from lmcache_tiers.l2.files.records import (
    DeleteFailures,
    RemovalFailures,
    judge_digest_record,
    log_unreadable_header,
)
from lmcache_tiers.l2.record import MAX_HEADER_LEN
from lmcache_tiers.protocols import ObjectSize

log = logging.getLogger("lmcache_tiers.l2.files")

__all__ = ["FileIdentity", "LocalFiles", "identity_of"]

#: told of a directory a sweep could not read, and the error (the sweep goes on)
Unlisted = Callable[[str, OSError], None]

#: stripes of the per-key lock (keys are spread by hash; collisions only serialise)
_STRIPES = 64


def _shard_directories(directory: str) -> list[str]:
    with os.scandir(directory) as entries:
        return [e.path for e in entries if is_shard_name(e.name) and e.is_dir(follow_symlinks=False)]


#: the errors that mean a record's file is not there: ENOENT alone.  Any other error of a
#: stat or open (EIO, EACCES, ELOOP, EMFILE) says nothing about it: a lookup that meets one
#: fails its batch -- every key a miss, counted -- rather than answering "absent", which
#: core takes for a record removed behind its back and forgets while the file may still be
#: on disk.  ENOTDIR is such an error too: something that is not a directory stands where
#: the store's directory (or a shard's) should be, e.g. a mount gone wrong or a directory
#: swapped aside, and the records may well be intact where they were.
ABSENT_FILE_ERRORS = (FileNotFoundError,)


class KeyStripes:
    """Per-key locks, striped by the key's hash (collisions only serialise), that keep a
    store from publishing a key's record while it is being judged or removed."""

    def __init__(self, count: int = _STRIPES) -> None:
        self._locks = [threading.Lock() for _ in range(count)]

    def of(self, key: ObjectKey) -> threading.Lock:
        return self._locks[hash(key) % len(self._locks)]

    @contextmanager
    def every(self) -> Iterator[None]:
        """Every stripe: held to remove a file whose key is not known (a digest-named file
        with an unreadable header), so no store of whichever key it is can publish over
        it meanwhile.  Taken in order; nothing else holds two stripes at once."""
        with ExitStack() as stack:
            for lock in self._locks:
                stack.enter_context(lock)
            yield


def _fsync_file(path: str) -> None:
    """fsync the file at ``path`` through a descriptor of its own: fsync flushes the
    file whichever descriptor asks, and (Linux 4.16+) a write-back error that no
    descriptor has reported yet is reported to this one."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileIdentity(NamedTuple):
    device: int
    inode: int


def identity_of(stat: os.stat_result) -> FileIdentity:
    return FileIdentity(stat.st_dev, stat.st_ino)


class Removals(Protocol):
    """Where a removal of a damaged record is told (the backend's ``BackendContext``)."""

    def accounted_size(self, key: ObjectKey) -> ObjectSize | None: ...

    def record_removed(self, key: ObjectKey, accounted: ObjectSize | None) -> None: ...


class LocalFiles:
    """The files of one store under a local root, in one :class:`FileLayout`.

    ``removals`` (the backend's context) is told of each record :meth:`discard` removes,
    so that the adapter releases its bytes at once."""

    def __init__(
        self,
        layout: FileLayout,
        *,
        name: str,
        count: Callable[[str, int], None],
        fsync: bool = False,
        on_root_recreated: Callable[[], None] | None = None,
        removals: Removals | None = None,
    ) -> None:
        self.layout = layout
        self._removals = removals
        self.name = name
        self._count = count
        self.fsync = fsync
        self._on_root_recreated = on_root_recreated
        self._stripes = KeyStripes()
        self._delete_failures = DeleteFailures(name, count)
        self._making_directories = threading.Lock()
        # Stores on several threads find a vanished root at once: one re-creates it (and
        # counts it, and re-takes the directory lock), the others find it there.
        self._recreating = threading.Lock()
        # The root's own entry too: whoever made it (the directory lock) may not have synced it.
        self._make_directory(layout.root, below=os.path.dirname(os.path.abspath(layout.root)))
        layout.remember(layout.root)
        if layout.temp_dir:
            self._make_directory(layout.temp_dir)
            layout.remember(layout.temp_dir)

    def stripe(self, key: ObjectKey) -> threading.Lock:
        return self._stripes.of(key)

    # -- writing ------------------------------------------------------------------------------

    def _ensure(self, directory: str) -> None:
        if not self.layout.is_known(directory):
            # Making a directory makes its missing parents too, the root included: a root
            # that vanished is re-created through _recreate (counted, lock re-taken).
            if directory != self.layout.root and not os.path.isdir(self.layout.root):
                self._recreate()
            self._make_directory(directory)
            self.layout.remember(directory)

    def _make_directory(self, directory: str, below: str | None = None) -> None:
        """Create ``directory`` (under the root unless ``below`` says otherwise) and its
        missing parents.

        With ``fsync`` each directory from it up to the root is fsynced into its parent
        too, once per run (callers remember the directories made): a record's own fsync
        and its directory's do not commit the entry that names a new directory, and a
        power loss could take the directory -- and every acknowledged record in it -- away
        (see :mod:`~lmcache_tiers.l2.files.durable`).  The lock keeps a second store from
        finding the directory made but not yet synced and publishing into it first.
        """
        if not self.fsync:
            os.makedirs(directory, exist_ok=True)
            return
        with self._making_directories:
            make_directories(directory, self._fsync_directory, below=below or self.layout.root)

    def create_temp(
        self, key: ObjectKey, flags: int = 0, *, stop: Callable[[], bool] | None = None
    ) -> tuple[int, str]:
        """Open a new temporary file for ``key``'s record: (fd, path).

        A root (or shard directory) that vanished -- someone removed the tree while the
        server ran -- is created again, once, instead of failing every store from then on;
        unless ``stop()`` says not to (the store's adapter started closing while the store
        was stuck, e.g. in the ``open`` of a hung mount): the FileNotFoundError is raised
        then.  The adapter may have released the directory by then, and creating the root
        again would lock the new directory once more (``on_root_recreated``), with
        nothing left to release that lock.
        """
        for attempt in (0, 1):
            directories = [self.layout.directory_for(key)]
            if self.layout.temp_dir:
                directories.append(self.layout.temp_dir)
            for directory in directories:
                self._ensure(directory)
            path = self.layout.temp_path(key)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flags, 0o644)
                return fd, path
            except FileNotFoundError:
                if attempt or (stop is not None and stop()):
                    raise
                self._recreate()
        raise AssertionError("unreachable")

    def _recreate(self) -> None:
        with self._recreating:
            root_gone = not os.path.isdir(self.layout.root)
            self.layout.forget_directories()
            self._make_directory(self.layout.root, below=os.path.dirname(os.path.abspath(self.layout.root)))
            self.layout.remember(self.layout.root)
            if root_gone:
                self._count("root_recreated", 1)
                log.warning("%s: %s vanished while in use; created it again", self.name, self.layout.root)
                if self._on_root_recreated is not None:
                    self._on_root_recreated()

    def publish(
        self, key: ObjectKey, temp_path: str, fd: int | None = None, *, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Rename a complete temporary file over ``key``'s record (fsync first when asked);
        True once it is published.

        ``fd``, the temporary file's open descriptor, is closed here in every case (the
        caller must not close it again), before the rename: a network filesystem (NFS)
        reports write-back errors such as ENOSPC at the close, and they must fail the
        store while nothing is published yet.  Without ``fd`` (the caller closed it) the
        file is opened again to be fsynced: a record renamed into place unsynced could be
        lost or torn by a power loss although its store was acknowledged as durable.

        False: ``stop()`` said so right before a rename (the store's adapter started
        closing while the store was stuck, e.g. in the fsync of a hung mount); nothing is
        published and the caller removes the temporary file.  Only a rename already under
        way may still land; see :meth:`_rename`.

        Raises OSError; the caller removes the temporary file then.  With ``fsync``, a
        directory that cannot be fsynced after the rename fails the store, and the record
        just published is removed again: a store reported failed leaves no record behind
        (one that would be live on disk yet not accounted until a restart listed it).
        """
        if fd is not None:
            try:
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)  # on Linux the descriptor is gone even when close fails
        elif self.fsync:
            _fsync_file(temp_path)
        final = self.layout.path_for(key)
        if not self.fsync:
            return self._rename(key, temp_path, final, stop)
        published = identity_of(os.lstat(temp_path))  # the inode keeps it through the rename
        if not self._rename(key, temp_path, final, stop):
            return False
        try:
            self._fsync_directory(os.path.dirname(final))
        except OSError:
            self._withdraw(key, published)
            raise
        return True

    def _rename(
        self, key: ObjectKey, temp_path: str, final: str, stop: Callable[[], bool] | None = None
    ) -> bool:
        """Move the temporary file over ``key``'s record; False if ``stop()`` said not to.

        ``stop`` is asked right before each rename: a store that returns from a stuck
        write or fsync after its adapter started closing must not publish, as the adapter
        may have released the directory to another server by then (and the root is not
        created again for it).  A rename already past that check may still land after the
        release: what it moves is a complete record whose checksum was taken while the
        payload was still the store's (closing begins before core hands the store's
        buffers back), so it is a valid record of its key, which the next adapter on the
        directory finds as it finds any record an earlier run left.  Closing that window
        would make close wait on a rename, which a hung mount can hold for ever.

        With a temporary directory apart from the records (``temp_dir``), creating the
        temporary file does not notice that the record's directory vanished (removed by an
        operator or a clean-up job) while the cache of known directories still lists it:
        the rename is what finds it missing.  The tree is created again and the rename tried
        once more, instead of failing every store into that directory until a restart.  A
        temporary file that is gone itself fails: the next store re-creates the root.
        """
        if stop is not None and stop():
            return False
        try:
            with self.stripe(key):
                os.rename(temp_path, final)
            return True
        except FileNotFoundError:
            if not os.path.exists(temp_path):
                raise
        if stop is not None and stop():
            return False
        self._recreate()
        directory = os.path.dirname(final)
        self._ensure(directory)
        log.info("%s: %s vanished while in use; created it again", self.name, printable(directory, 300))
        if stop is not None and stop():
            return False
        with self.stripe(key):
            os.rename(temp_path, final)
        return True

    def _withdraw(self, key: ObjectKey, published: FileIdentity) -> None:
        """Remove the record a failing store published (not one a later store replaced it
        with).  The store's failure is counted and logged by its caller."""
        path = self.layout.path_for(key)
        if self._remove_judged(path, published, self.stripe(key)):
            return
        try:
            left = identity_of(os.lstat(path)) == published
        except FileNotFoundError:
            return
        except OSError as exc:
            # Not "gone": a disk whose directory fsync just failed (EIO) may fail this too,
            # and the record it cannot tell about may well still be there.
            left, why = True, f" (cannot tell: {exc.strerror or exc})"
        else:
            why = ""
        if left:
            self._count("failed_store_records_left", 1)
            log.warning(
                "%s: %s stays on disk although its store failed%s: it is accounted once a lookup "
                "or the next start-up finds it",
                self.name,
                printable(path, 300),
                why,
            )

    def _fsync_directory(self, directory: str) -> None:
        fsync_directory(directory)

    # -- removing -----------------------------------------------------------------------------

    def discard(self, key: ObjectKey, identity: FileIdentity | None, counter: str, reason: str) -> bool:
        """Remove ``key``'s record because it cannot be trusted, if it is still the file
        that was judged (``identity``; None: whatever is there).  Counted, logged, and its
        bytes released (``removals``)."""
        removals = self._removals
        # Read before the removal: a store that publishes the key since (it waits for the
        # stripe) settles a new entry, which stays.
        accounted = removals.accounted_size(key) if removals is not None else None
        if not self._discard_path(self.layout.path_for(key), identity, self.stripe(key), counter, reason):
            return False
        if removals is not None:
            removals.record_removed(key, accounted)
        return True

    def _discard_path(
        self,
        path: str,
        identity: FileIdentity | None,
        lock: AbstractContextManager[Any],
        counter: str,
        reason: str,
    ) -> bool:
        if not self._remove_judged(path, identity, lock, unremovable=reason):
            return False
        self._count(counter, 1)
        log.warning("%s: removed %s: %s", self.name, printable(path, 300), printable(reason, 300))
        return True

    def _remove_judged(
        self,
        path: str,
        identity: FileIdentity | None,
        lock: AbstractContextManager[Any],
        *,
        unremovable: str | None = None,
    ) -> bool:
        """Unlink ``path`` if it is still the file that was judged; whether it was removed.
        ``lock`` keeps stores of its key from publishing between the check and the unlink.

        With ``unremovable`` (why the file was judged bad), a file that cannot be removed
        is counted (``corrupt_remove_failures``): the damage stays on disk, a miss at
        every lookup, and the removal's counter never tells of it."""
        with lock:
            try:
                if identity is not None and identity_of(os.lstat(path)) != identity:
                    return False  # replaced by a store since: that record is not the bad one
                os.unlink(path)
            except FileNotFoundError:
                return False
            except OSError as exc:
                if unremovable is None:
                    log.warning("%s: cannot remove %s: %s", self.name, printable(path, 300), exc)
                else:
                    self._count("corrupt_remove_failures", 1)
                    log.warning(
                        "%s: cannot remove %s (%s): %s; it stays a miss",
                        self.name,
                        printable(path, 300),
                        printable(unremovable, 300),
                        exc,
                    )
                return False
        return True

    def delete(self, key: ObjectKey) -> bool:
        path = self.layout.path_for(key)
        with self.stripe(key):
            try:
                os.unlink(path)
                return True
            except FileNotFoundError:
                return False
            except OSError as exc:  # EIO, EACCES, ENOTDIR: the record may be intact
                self._delete_failures.failed(path, exc)
                return False

    @staticmethod
    def remove_quietly(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    # -- the tree -----------------------------------------------------------------------------

    def directories(self, *, first_level: bool = False, on_unlisted: Unlisted | None = None) -> Iterator[str]:
        """The root, every shard directory of either layout (``ab/cd``), and the temp
        directory: where this store's files may be.  A first-level shard directory
        (``ab``) holds none -- no layout puts a file there, so what lies there belongs to
        another store whose root it is -- and is yielded only with ``first_level``.

        A directory that cannot be read (EACCES, EIO) raises, unless ``on_unlisted`` is
        given: a sweep is told of it and goes on with the other directories."""
        root = self.layout.root
        yield root
        try:
            first_levels = _shard_directories(root)
        except FileNotFoundError:
            return
        except OSError as exc:
            if on_unlisted is None:
                raise
            on_unlisted(root, exc)
            first_levels = []
        for first in first_levels:
            if first_level:
                yield first
            try:
                yield from _shard_directories(first)
            except FileNotFoundError:
                continue
            except OSError as exc:
                if on_unlisted is None:
                    raise
                on_unlisted(first, exc)
        if self.layout.temp_dir:
            yield self.layout.temp_dir

    def _files(
        self, wanted: Callable[[str], bool] | None = None, on_unlisted: Unlisted | None = None
    ) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Regular files of every directory (whose names ``wanted`` accepts), handed out
        as each directory is read: a flat directory of millions of files is never held
        whole.  Removing a file handed out does not hide the others from the reading
        (POSIX: only files removed or added meanwhile may be listed or not).  A directory
        that cannot be read raises, or is told to ``on_unlisted`` and skipped."""
        for directory in self.directories(on_unlisted=on_unlisted):
            try:
                entries = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:
                if on_unlisted is None:
                    raise
                on_unlisted(directory, exc)
                continue
            with entries:
                for entry in entries:
                    if (wanted is None or wanted(entry.name)) and entry.is_file(follow_symlinks=False):
                        yield directory, entry

    def iter_records(self, header_length: Callable[[ObjectKey], int]) -> Iterator[tuple[ObjectKey, int]]:
        """``(key, payload bytes)`` of every record in this layout, from names and one
        ``stat`` each; records shorter than their header (zero-length, torn) are removed
        and counted (``truncated_records_removed``) the first time they are listed.

        Digest-named records are the exception that is opened: only their header names
        their key (:meth:`_digest_record_key`).  Records where this layout does not put
        their key -- left by a run with the other ``shard_dirs`` setting, or moved by hand
        -- are kept, counted and reported (:class:`~.layout.MisplacedRecords`).

        The start-up scan runs this over every file of a cache, so each directory is one
        plain loop: each call or generator level per entry costs about as much as the
        ``stat``.  A
        directory is read as its records are handed out, never gathered first: a flat
        directory of millions of files would hold an entry per file (hundreds of bytes
        each) and account nothing until all were read.  Files removed or added meanwhile
        (a record judged damaged here, a store) are listed or not; every other file once.
        """
        layout = self.layout
        misplaced = layout.misplaced_records(self.name, self._count)
        for directory in self.directories():
            try:
                listing = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            here = directory == layout.root if not layout.shard_dirs else None
            with listing:
                yield from self._records_in(listing, directory, here, header_length, misplaced)
        misplaced.report()

    def _records_in(
        self,
        listing: Iterator[os.DirEntry[str]],
        directory: str,
        here: bool | None,
        header_length: Callable[[ObjectKey], int],
        misplaced: MisplacedRecords,
    ) -> Iterator[tuple[ObjectKey, int]]:
        """:meth:`iter_records` of one directory being read (``here``: whether a flat
        layout's records belong in it; None: sharded, asked per key)."""
        layout = self.layout
        suffix, cut = RECORD_SUFFIX, -len(RECORD_SUFFIX)
        for entry in listing:
            if not (entry.name.endswith(suffix) and entry.is_file(follow_symlinks=False)):
                continue
            stem = entry.name[:cut]
            if stem.startswith("~") and is_digest_name(stem):
                key = self._digest_record_key(entry)
            else:
                key = name_to_key(stem)
            if key is None:
                continue  # a name that is not ours, or a digest record judged above
            if not (here if here is not None else layout.owns(directory, key)):
                misplaced.found(directory, key)
                continue
            try:
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # deleted since the directory was read
            stored = stat.st_size - header_length(key)
            if stored < 0:
                self.discard(
                    key,
                    identity_of(stat),
                    "truncated_records_removed",
                    f"{stat.st_size} bytes, shorter than its record header",
                )
                continue
            yield key, stored

    def _digest_record_key(self, entry: os.DirEntry[str]) -> ObjectKey | None:
        """The key of a digest-named record, from its header; None if it has none (one
        judged damaged is removed and counted, :func:`~.records.judge_digest_record`).  A
        read error says nothing about the file: it is counted and left."""
        header = self._read_header(entry.path)
        if header is None:
            return None
        data, identity, size = header
        judged = judge_digest_record(data, entry.path, size, store=self.name, count=self._count)
        if isinstance(judged, tuple):
            self._discard_unkeyed(entry.path, identity, *judged)
            return None
        return judged

    def _read_header(self, path: str) -> tuple[bytes, FileIdentity, int] | None:
        """(the first bytes, identity, size) of a record file; None if it cannot be read."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None  # deleted since the directory was read
        except OSError as exc:
            self._unreadable(path, exc)
            return None
        try:
            stat = os.fstat(fd)
            return os.pread(fd, MAX_HEADER_LEN, 0), identity_of(stat), stat.st_size
        except OSError as exc:
            self._unreadable(path, exc)
            return None
        finally:
            os.close(fd)

    def _discard_unkeyed(self, path: str, identity: FileIdentity, counter: str, reason: str) -> bool:
        """:meth:`discard` of a file whose key is not known: every stripe is held."""
        return self._discard_path(path, identity, self._stripes.every(), counter, reason)

    def _unreadable(self, path: str, exc: OSError) -> None:
        self._count("listing_read_errors", 1)
        log_unreadable_header(self.name, path, exc)

    def remove_temp_files(self) -> int:
        """Delete temporary files a killed writer left behind; returns how many.

        Run at start-up, before this process writes anything: the directory lock makes it
        the only writer, so every temporary file found is an orphan.  One that cannot be
        removed, or a directory that cannot be listed, fails the start
        (:meth:`_sweep_failed`).
        """
        removed = 0
        unlisted = partial(self._sweep_failed, "directories_not_listed", "list the directory")
        for _directory, entry in self._files(is_temp_name, on_unlisted=unlisted):
            if is_temp_name(entry.name):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    self._sweep_failed(
                        "temp_files_not_removed", "remove the leftover temporary file", entry.path, exc
                    )
        if removed:
            log.info("%s: removed %d temporary files left by an interrupted run", self.name, removed)
        self._count("orphan_temp_files_removed", removed)
        return removed

    def _sweep_failed(self, counter: str, what: str, path: str, exc: OSError) -> NoReturn:
        """The start-up sweep cannot ``what`` ``path``: counted, and the start fails with one
        line naming it.  The directory lock makes this server the tree's only writer; a
        tree it cannot clean up or even read is one it cannot keep its accounts of."""
        self._count(counter, 1)
        reason = printable(exc.strerror or str(exc), 300)
        raise OSError(exc.errno, f"{self.name}: cannot {what} {printable(path, 300)}: {reason}") from exc

    def remove_all_records(self) -> int:
        """Delete every record and temporary file of either layout, then the empty shard
        directories (files that are not ours are left alone).  A file that cannot be
        removed does not stop the others; it is counted, and an OSError says so at the
        end (:class:`~.records.RemovalFailures`)."""
        removed, failures = 0, RemovalFailures(self.name, self._count)
        while True:
            # Files removed while their directory is read may hide others from that reading
            # on some filesystems (POSIX leaves it open; NFS and CIFS do hide them): read
            # again until a pass finds nothing to remove.  A pass in which a file could not
            # be removed, or a directory not read, is the last, so that no failure is counted twice.
            failed_before, removed_before = failures.count, removed
            for _directory, entry in self._files(on_unlisted=failures.unlisted):
                if classify_name(entry.name).kind is not EntryKind.FOREIGN:
                    try:
                        os.unlink(entry.path)
                        removed += 1
                    except FileNotFoundError:
                        pass
                    except OSError as exc:
                        failures.failed(entry.path, exc)
            if removed == removed_before or failures.count > failed_before:
                break
        # a directory that cannot be read was told by the sweep above: not again here
        readable = self.directories(first_level=True, on_unlisted=lambda _directory, _exc: None)
        for directory in sorted(readable, key=len, reverse=True):
            if directory != self.layout.root:
                try:
                    os.rmdir(directory)
                except OSError:  # not empty: holds files that are not ours
                    pass
        self.layout.forget_directories()
        self.layout.remember(self.layout.root)
        failures.report(removed)
        return removed
