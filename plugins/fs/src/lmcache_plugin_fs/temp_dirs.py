"""The temporary directories a root's stores have used, so that a changed ``relative_tmp_dir``
does not strand what a killed run left in the old one.

The start-up sweep removes temporary files from the directories the current layout writes
to.  Once ``relative_tmp_dir`` changes (or is dropped), the old directory is no longer one
of them, and the files a crash left there would stay forever.  Which directory that was
cannot be guessed safely: a temporary name under some other sub-directory of the root may
be another store's write in flight (a store nested under this root).  So the root keeps a
small record, ``.lmcache-tiers-temp-dirs``, of every temporary directory configured on it
(written before the first store); at start-up each recorded directory other than the
current one has the temporary files directly in it removed -- nothing else: not its other
files, not its sub-directories -- and is then forgotten.  A directory that is (or lies
under) a store's root now is left alone and kept in the record (``old_temp_dirs_skipped``):
a local one another server or adapter holds, or one holding a store's files (records,
shard directories, a record of temporary directories) -- the only sign of a remote store,
which no lock tells of.  So is one that cannot be swept
(``temp_files_not_removed``, ``directories_not_listed``); each is logged.  A record that
cannot be read is left as it is and counted (``temp_dir_record_unreadable``): nothing is
removed on its word.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
from typing import Any

from lmcache_plugin_fs.remote import shown
from lmcache_tiers.plugin import (
    RECORD_SUFFIX,
    BackendContext,
    FieldError,
    check_directory_free,
    check_relative_dir,
    fsync_directory,
    is_temp_name,
)

log = logging.getLogger(__name__)

#: the record's name in the root: neither a record (``.bin``) nor a temporary name, so
#: every listing and sweep leaves it alone
RECORD_NAME = ".lmcache-tiers-temp-dirs"
_NEW_SUFFIX = ".new"
#: the characters of a shard directory's name (two of them: ``ab``)
_SHARD_CHARACTERS = frozenset("0123456789abcdef")


class TempDirRecord:
    """Reads, sweeps and rewrites the record of one root.

    ``fs`` is the fsspec filesystem of the root (a local one for a local directory);
    ``local`` says whether an old directory can be checked for another server's lock."""

    def __init__(
        self, fs: Any, root: str, current: str | None, context: BackendContext, *, local: bool
    ) -> None:
        self.fs = fs
        self.root = root.rstrip("/") or "/"
        self.current = check_relative_dir(current) if current else None
        self.context = context
        self.local = local
        self.path = posixpath.join(self.root, RECORD_NAME)
        #: the directories the record named at start-up (empty until it is read, or when
        #: it cannot be)
        self.recorded: list[str] = []

    def sweep_and_record(self) -> int:
        """Sweep every recorded temporary directory but the current one, then record what
        is left to sweep and the current one; returns the temporary files removed."""
        recorded = self._read()
        if recorded is None:
            return 0
        self.recorded = recorded
        removed, kept = 0, []
        for directory in recorded:
            if directory == self.current:
                continue
            swept = self._sweep(directory)
            if swept is None:
                kept.append(directory)
            else:
                removed += swept
        wanted = kept + ([self.current] if self.current else [])
        if wanted != recorded:
            self._write(wanted)
        return removed

    # -- the record -------------------------------------------------------------------------------

    def _read(self) -> list[str] | None:
        """The recorded directories ([] without a record); None when it cannot be read."""
        try:
            text = bytes(self.fs.cat_file(self.path)).decode("utf-8")
        except FileNotFoundError:
            return []
        except (OSError, UnicodeDecodeError) as exc:
            self._unreadable(str(exc))
            return None
        directories: list[str] = []
        for line in text.splitlines():
            if not line:
                continue
            try:
                directory = check_relative_dir(line)
            except ValueError as exc:
                self._unreadable(f"line {line[:100]!r}: {exc}")
                return None
            if directory not in directories:
                directories.append(directory)
        return directories

    def _unreadable(self, reason: str) -> None:
        self.context.count("temp_dir_record_unreadable")
        log.warning(
            "%s: cannot read %s (%s): temporary directories used before are not swept; "
            "remove it once their .tmp-*.part files are removed by hand",
            self.context.name,
            shown(self.path),
            shown(reason),
        )

    def _write(self, directories: list[str]) -> None:
        """Replace the record (or remove it when nothing is left to record).  Written to a
        new name and moved over the record, so a crash leaves the old record or the new one.
        A failure is counted and logged: the start goes on (no stored byte depends on it),
        and a later change of ``relative_tmp_dir`` may strand files again.

        A local record is made durable before the first store writes in the directory it
        names (:func:`_replace_durably`): the kernel may write a temporary file's blocks
        back before it writes the record's, and after a power loss the record would not
        name the directory that file is in -- stranded once ``relative_tmp_dir`` changes."""
        staged = self.path + _NEW_SUFFIX
        text = "".join(f"{d}\n" for d in directories).encode("utf-8")
        try:
            if self.local:
                _replace_durably(self.path, staged, text if directories else None)
                return
            if not directories:
                self.fs.rm_file(self.path)
                return
            self.fs.pipe_file(staged, text)
            self.fs.mv(staged, self.path)
        except FileNotFoundError:
            return  # nothing to remove
        except Exception as exc:  # what the filesystem raises is its own
            # A write that failed part-way (a full root) leaves the staged name, which no
            # sweep removes (it is no temporary name): removed here, or overwritten by
            # the next start's write.
            with contextlib.suppress(Exception):
                self.fs.rm_file(staged)
            self.context.count("temp_dir_record_failures")
            log.warning(
                "%s: cannot write %s: %s (once relative_tmp_dir changes, what a crash left in "
                "the directories it should name is not swept)",
                self.context.name,
                shown(self.path),
                shown(str(exc)),
            )

    # -- one old directory ------------------------------------------------------------------------

    def _sweep(self, relative: str) -> int | None:
        """Remove the temporary files directly in the old directory ``relative``; how many,
        or None when it must stay recorded (held by another store, or not swept whole)."""
        directory = posixpath.join(self.root, relative)
        if self.local and os.path.realpath(directory) == os.path.realpath(self.root):
            return 0  # a link back to the root: swept with it, by the start-up sweep
        if self.local and not self._free(relative):
            return None
        try:
            entries = self.fs.ls(directory, detail=True)
        except FileNotFoundError:
            return 0  # removed since: nothing left to sweep
        except Exception as exc:
            self._failed("directories_not_listed", "list", directory, exc)
            return None
        store_file = _store_file(entries)
        if store_file is not None:
            self._skipped(directory, f"it holds {store_file}")
            return None
        removed = 0
        for entry in entries:
            path = str(entry["name"])
            if (
                entry.get("type") != "file"
                or entry.get("islink")
                or not is_temp_name(posixpath.basename(path))
            ):
                continue
            try:
                self.fs.rm_file(path)
                removed += 1
            except FileNotFoundError:
                continue
            except Exception as exc:
                self.context.count("orphan_temp_files_removed", removed)
                self._failed("temp_files_not_removed", "remove", path, exc)
                return None
        self.context.count("orphan_temp_files_removed", removed)
        if removed and self.local:
            # The removals must be durable before the record forgets the directory: after
            # a power loss the files would be back in a directory nothing sweeps any more.
            try:
                fsync_directory(directory)
            except OSError as exc:
                self._failed("temp_files_not_removed", "make durable the removals", directory, exc)
                return None
        log.info(
            "%s: removed %d temporary files left by an interrupted run in %s, an earlier temporary "
            "directory (relative_tmp_dir is now %s)",
            self.context.name,
            removed,
            shown(directory),
            self.current or "unset",
        )
        return removed

    def _free(self, relative: str) -> bool:
        """Whether no other server or adapter holds as its root the old directory
        ``relative`` or a directory between it and the root (whose own temporary directory
        it may be); one that does is counted and logged, and the files (its writes in
        flight) are left alone."""
        parts = relative.split("/")
        for depth in range(1, len(parts) + 1):
            if "/".join(parts[:depth]) == self.current:
                continue  # this adapter's own temporary directory, which it holds
            directory = posixpath.join(self.root, *parts[:depth])
            try:
                check_directory_free(directory, "relative_tmp_dir", what=f"the directory {directory}")
            except FieldError as exc:  # the lock's refusal, worded as the pre-flight words it
                self._skipped(posixpath.join(self.root, relative), f"in use: {exc}")
                return False
        return True

    def _skipped(self, directory: str, why: str) -> None:
        self.context.count("old_temp_dirs_skipped")
        log.warning(
            "%s: %s, an earlier temporary directory, is another store's now (%s); its "
            "temporary files are left alone and it is swept at a later start",
            self.context.name,
            shown(directory),
            shown(why),
        )

    def _failed(self, counter: str, what: str, path: str, exc: Exception) -> None:
        self.context.count(counter)
        log.warning(
            "%s: cannot %s %s in an earlier temporary directory: %s (retried at the next start)",
            self.context.name,
            what,
            shown(path),
            shown(str(exc)),
        )


def _store_file(entries: list[dict[str, Any]]) -> str | None:
    """The path of the first entry that marks a listing as a store's root -- a record, a
    shard directory, a record of temporary directories -- or None.  A temporary directory
    holds none of them: they mean a store has been rooted there since."""
    for entry in entries:
        path = str(entry["name"])
        name = posixpath.basename(path.rstrip("/"))
        if entry.get("type") == "directory":
            if len(name) == 2 and set(name) <= _SHARD_CHARACTERS:
                return path
        elif name.endswith(RECORD_SUFFIX) or name == RECORD_NAME:
            return path
    return None


def _replace_durably(path: str, staged: str, text: bytes | None) -> None:
    """Put ``text`` at the local ``path`` through ``staged`` (None: remove ``path``),
    durably: the staged file is fsynced before it is renamed over ``path`` -- else a power
    loss may leave the new name on an empty or partly written file -- and the directory
    after, so the rename (or the removal) itself survives one."""
    directory = posixpath.dirname(path)
    if text is None:
        os.unlink(path)
        fsync_directory(directory)
        return
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        view = memoryview(text)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(staged, path)
    fsync_directory(directory)
