"""A file-per-object store in a local directory: create, publish, discard, list, sweep.

Everything here that changes a key's record file -- publishing a new one, removing a
damaged or truncated one, deleting -- holds that key's stripe lock, and removals check
that the file is still the one that was judged (same device and inode): a record that a
store published meanwhile is never removed by a reader that found the previous one bad.

Fsync policy: with ``fsync=False`` (the default) nothing is fsynced.  A killed process
loses nothing the kernel already has; after a power loss or kernel crash a record may be
lost or torn, and a torn record fails its checksum on load and is a miss, never wrong
bytes.  With ``fsync=True`` each record is fsynced before it is renamed and its directory
after, so a store acknowledged to the controller survives a power loss too.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from typing import NamedTuple

from lmcache_tiers.keycodec import is_digest_name, name_to_key, printable
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.files.layout import (
    RECORD_SUFFIX,
    EntryKind,
    FileLayout,
    classify_name,
    is_shard_name,
    is_temp_name,
)
from lmcache_tiers.l2.files.records import record_key
from lmcache_tiers.l2.record import MAX_HEADER_LEN, RecordError

log = logging.getLogger("lmcache_tiers.l2.files")

__all__ = ["FileIdentity", "LocalFiles", "identity_of"]

#: stripes of the per-key lock (keys are spread by hash; collisions only serialise)
_STRIPES = 64


def _shard_directories(directory: str) -> list[str]:
    with os.scandir(directory) as entries:
        return [e.path for e in entries if is_shard_name(e.name) and e.is_dir(follow_symlinks=False)]


#: the errors that mean a record's file is not there.  Any other error of a stat or open
#: (EIO, EACCES, ELOOP, EMFILE) says nothing about it: a lookup that meets one fails its
#: batch -- every key a miss -- rather than answering "absent", which core takes for a
#: record removed behind its back and forgets while the file may still be on disk.
ABSENT_FILE_ERRORS = (FileNotFoundError, NotADirectoryError)


class FileIdentity(NamedTuple):
    device: int
    inode: int


def identity_of(stat: os.stat_result) -> FileIdentity:
    return FileIdentity(stat.st_dev, stat.st_ino)


class LocalFiles:
    """The files of one store under a local root, in one :class:`FileLayout`."""

    def __init__(
        self,
        layout: FileLayout,
        *,
        name: str,
        count: Callable[[str, int], None],
        fsync: bool = False,
        on_root_recreated: Callable[[], None] | None = None,
    ) -> None:
        self.layout = layout
        self.name = name
        self._count = count
        self.fsync = fsync
        self._on_root_recreated = on_root_recreated
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        os.makedirs(layout.root, exist_ok=True)
        layout.remember(layout.root)
        if layout.temp_dir:
            os.makedirs(layout.temp_dir, exist_ok=True)
            layout.remember(layout.temp_dir)

    def stripe(self, key: ObjectKey) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

    # -- writing ------------------------------------------------------------------------------

    def _ensure(self, directory: str) -> None:
        if not self.layout.is_known(directory):
            os.makedirs(directory, exist_ok=True)
            self.layout.remember(directory)

    def create_temp(self, key: ObjectKey, flags: int = 0) -> tuple[int, str]:
        """Open a new temporary file for ``key``'s record: (fd, path).

        A root (or shard directory) that vanished -- someone removed the tree while the
        server ran -- is created again, once, instead of failing every store from then on.
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
                if attempt:
                    raise
                self._recreate()
        raise AssertionError("unreachable")

    def _recreate(self) -> None:
        root_gone = not os.path.isdir(self.layout.root)
        self.layout.forget_directories()
        os.makedirs(self.layout.root, exist_ok=True)
        self.layout.remember(self.layout.root)
        if root_gone:
            self._count("root_recreated", 1)
            log.warning("%s: %s vanished while in use; created it again", self.name, self.layout.root)
            if self._on_root_recreated is not None:
                self._on_root_recreated()

    def publish(self, key: ObjectKey, temp_path: str, fd: int | None = None) -> None:
        """Rename a complete temporary file over ``key``'s record (fsync first when asked).

        Raises OSError; the caller removes the temporary file then.
        """
        final = self.layout.path_for(key)
        if self.fsync and fd is not None:
            os.fsync(fd)
        with self.stripe(key):
            os.rename(temp_path, final)
        if self.fsync:
            self._fsync_directory(os.path.dirname(final))

    def _fsync_directory(self, directory: str) -> None:
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # -- removing -----------------------------------------------------------------------------

    def discard(self, key: ObjectKey, identity: FileIdentity | None, counter: str, reason: str) -> bool:
        """Remove ``key``'s record because it cannot be trusted, if it is still the file
        that was judged (``identity``; None: whatever is there).  Counted and logged."""
        path = self.layout.path_for(key)
        with self.stripe(key):
            try:
                if identity is not None and identity_of(os.lstat(path)) != identity:
                    return False  # replaced by a store since: that record is not the bad one
                os.unlink(path)
            except FileNotFoundError:
                return False
            except OSError as exc:
                log.warning("%s: cannot remove %s: %s", self.name, printable(path, 300), exc)
                return False
        self._count(counter, 1)
        log.warning("%s: removed %s: %s", self.name, printable(path, 300), printable(reason, 300))
        return True

    def delete(self, key: ObjectKey) -> bool:
        path = self.layout.path_for(key)
        with self.stripe(key):
            try:
                os.unlink(path)
                return True
            except FileNotFoundError:
                return False
            except OSError as exc:
                log.warning("%s: cannot delete %s: %s", self.name, printable(path, 300), exc)
                return False

    @staticmethod
    def remove_quietly(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass

    # -- the tree -----------------------------------------------------------------------------

    def directories(self) -> Iterator[str]:
        """The root, every shard directory of either layout, and the temp directory."""
        root = self.layout.root
        yield root
        try:
            first_level = _shard_directories(root)
        except FileNotFoundError:
            return
        for first in first_level:
            yield first
            try:
                yield from _shard_directories(first)
            except FileNotFoundError:
                continue
        if self.layout.temp_dir:
            yield self.layout.temp_dir

    def _files(self, wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, os.DirEntry[str]]]:
        """Regular files of every directory (whose names ``wanted`` accepts)."""
        for directory in self.directories():
            try:
                with os.scandir(directory) as entries:
                    listed = [
                        entry
                        for entry in entries
                        if (wanted is None or wanted(entry.name)) and entry.is_file(follow_symlinks=False)
                    ]
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in listed:
                yield directory, entry

    def iter_records(self, header_length: Callable[[ObjectKey], int]) -> Iterator[tuple[ObjectKey, int]]:
        """``(key, payload bytes)`` of every record in this layout, from names and one
        ``stat`` each; records shorter than their header (zero-length, torn) are removed
        and counted (``truncated_records_removed``) the first time they are listed.

        The start-up scan runs this over every file of a cache, so it is one plain loop:
        each call or generator level per entry costs about as much as the ``stat``.
        """
        layout = self.layout
        suffix, cut = RECORD_SUFFIX, -len(RECORD_SUFFIX)
        for directory in self.directories():
            try:
                with os.scandir(directory) as listing:
                    entries = [
                        e for e in listing if e.name.endswith(suffix) and e.is_file(follow_symlinks=False)
                    ]
            except (FileNotFoundError, NotADirectoryError):
                continue
            here = directory == layout.root if not layout.shard_dirs else None
            for entry in entries:
                stem = entry.name[:cut]
                if stem.startswith("~") and is_digest_name(stem):
                    key = self._key_from_header(entry.path)
                else:
                    key = name_to_key(stem)
                if key is None or not (here if here is not None else layout.owns(directory, key)):
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

    def _key_from_header(self, path: str) -> ObjectKey | None:
        """The key of a digest-named record, from its header (None if it has none)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            return record_key(os.pread(fd, MAX_HEADER_LEN, 0))
        except (OSError, RecordError):
            return None  # a damaged one is removed by the first load that finds it
        finally:
            os.close(fd)

    def remove_temp_files(self) -> int:
        """Delete temporary files a killed writer left behind; returns how many.

        Run at start-up, before this process writes anything: the directory lock makes it
        the only writer, so every temporary file found is an orphan.
        """
        removed = 0
        for _directory, entry in self._files(is_temp_name):
            if is_temp_name(entry.name):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        if removed:
            log.info("%s: removed %d temporary files left by an interrupted run", self.name, removed)
        self._count("orphan_temp_files_removed", removed)
        return removed

    def remove_all_records(self) -> int:
        """Delete every record and temporary file of either layout, then the empty shard
        directories (files that are not ours are left alone)."""
        removed = 0
        for _directory, entry in self._files():
            if classify_name(entry.name).kind is not EntryKind.FOREIGN:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        for directory in sorted(self.directories(), key=len, reverse=True):
            if directory != self.layout.root:
                try:
                    os.rmdir(directory)
                except OSError:  # not empty: holds files that are not ours
                    pass
        self.layout.forget_directories()
        self.layout.remember(self.layout.root)
        return removed
