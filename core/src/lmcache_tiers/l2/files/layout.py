"""Where a file-per-object store keeps each object: deterministic names, flat or sharded.

A key's record file is ``<name>.bin``, ``<name>`` being :func:`~lmcache_tiers.keycodec.key_to_name`:
only ``[A-Za-z0-9._-]``, ``%`` escapes and ``@`` separators, never a leading dot, so no
key can name a path outside the root and no listing hides a record.  Keys whose readable
name would not fit in a file name get a digest name (``~<32 hex>.bin``) whose key is read
from the record header.  With sharding the file sits in ``<root>/<h0h1>/<h2h3>/``, named
from the first four hex characters of the chunk hash, so no directory grows beyond what
filesystems list quickly.  The path depends only on the key and the layout: after a
restart the same key finds the same file, and a key is never looked up in the other layout.

Objects are written to a temporary file (``.tmp-<pid>-<n>.part``) in the record's
directory, or in ``temp_dir`` when one is configured, and renamed over the final name
once complete, so a reader never sees half an object; temporary names are recognisable so
the start-up sweep removes those a crash left behind.  Paths are POSIX strings, the same
for local directories and fsspec filesystems.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import posixpath
import threading
from collections.abc import Callable
from typing import NamedTuple

from lmcache_tiers.keycodec import NAME_MAX, is_digest_name, key_to_name, name_to_key, printable
from lmcache_tiers.keys import ObjectKey

log = logging.getLogger("lmcache_tiers.l2.files")

__all__ = [
    "RECORD_SUFFIX",
    "TEMP_PREFIX",
    "TEMP_SUFFIX",
    "EntryKind",
    "FileLayout",
    "MisplacedRecords",
    "NamedEntry",
    "check_relative_dir",
    "classify_name",
    "is_shard_name",
    "is_temp_name",
    "record_name",
]

RECORD_SUFFIX = ".bin"
TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".part"
_NAME_BUDGET = NAME_MAX - len(RECORD_SUFFIX)
_HEX = frozenset("0123456789abcdef")
#: numbers temporary names across every layout of this process: an adapter opened again on
#: a directory must not hand out the name of a file a store of the closed one still holds
#: (closed past a stuck write), which that store removes when it gives up
_TEMP_NUMBERS = itertools.count()


class EntryKind(enum.Enum):
    RECORD = "record"  # a readable name: the key is in the name
    DIGEST = "digest"  # a digest name: the key is in the record header
    TEMP = "temp"  # an object being written, or left by a killed writer
    FOREIGN = "foreign"  # not ours: never touched


class NamedEntry(NamedTuple):
    kind: EntryKind
    key: ObjectKey | None  # for RECORD only


def record_name(key: ObjectKey) -> str:
    """File name of ``key``'s record (at most NAME_MAX bytes)."""
    return key_to_name(key, _NAME_BUDGET) + RECORD_SUFFIX


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


def is_shard_name(name: str) -> bool:
    return len(name) == 2 and name[0] in _HEX and name[1] in _HEX


def classify_name(name: str) -> NamedEntry:
    """What a file name in a store's tree is."""
    if name.endswith(RECORD_SUFFIX):
        stem = name[: -len(RECORD_SUFFIX)]
        if stem.startswith("~") and is_digest_name(stem):
            return NamedEntry(EntryKind.DIGEST, None)
        key = name_to_key(stem)
        if key is not None:
            return NamedEntry(EntryKind.RECORD, key)
    elif is_temp_name(name):
        return NamedEntry(EntryKind.TEMP, None)
    return NamedEntry(EntryKind.FOREIGN, None)


def check_relative_dir(value: str) -> str:
    """``value`` as a normalised relative directory inside a store's root; ValueError if it
    could point outside it or collide with the store's own names."""
    if not value or value.startswith("/") or "\\" in value or "\x00" in value:
        raise ValueError(f"{value!r} must be a relative path inside the root (no leading '/')")
    normal = posixpath.normpath(value)
    parts = normal.split("/")
    if normal in (".", "") or ".." in parts:
        raise ValueError(f"{value!r} must name a directory inside the root ('..' is not allowed)")
    if is_shard_name(parts[0]) or parts[0].endswith(RECORD_SUFFIX):
        raise ValueError(f"{value!r} collides with the names of shard directories or records")
    return normal


def _shard(key: ObjectKey) -> str:
    """Relative shard directory of ``key`` in the sharded layout."""
    digest = key.chunk_hash.hex().ljust(4, "0")  # a 1-byte hash still gets two levels
    return f"{digest[0:2]}/{digest[2:4]}"


class FileLayout:
    """Maps keys to POSIX paths under ``root``."""

    def __init__(self, root: str, *, shard_dirs: bool, temp_dir: str | None = None) -> None:
        self.root = root.rstrip("/") or "/"
        self.shard_dirs = shard_dirs
        #: where temporary files go (None: next to their record)
        self.temp_dir = posixpath.join(self.root, check_relative_dir(temp_dir)) if temp_dir else None
        self._known_dirs: set[str] = set()
        self._lock = threading.Lock()

    def shard_of(self, key: ObjectKey) -> str:
        """Relative shard directory of ``key`` ("" when flat)."""
        return _shard(key) if self.shard_dirs else ""

    def directory_for(self, key: ObjectKey) -> str:
        shard = self.shard_of(key)
        return posixpath.join(self.root, shard) if shard else self.root

    def path_for(self, key: ObjectKey) -> str:
        return posixpath.join(self.directory_for(key), record_name(key))

    def temp_path(self, key: ObjectKey) -> str:
        """A fresh temporary path for writing ``key``'s record.

        Independent of the key's name so a long name cannot push it past NAME_MAX; the pid
        keeps two processes (one killed, one starting) from ever picking the same name, and
        a number counted per process, not per layout, two adapters of one process.
        """
        directory = self.temp_dir or self.directory_for(key)
        name = f"{TEMP_PREFIX}{os.getpid()}-{next(_TEMP_NUMBERS)}{TEMP_SUFFIX}"
        return posixpath.join(directory, name)

    def owns(self, directory: str, key: ObjectKey) -> bool:
        """Whether a record of ``key`` found in ``directory`` is where this layout puts it
        (a root of ``/`` stays ``/``: stripped to nothing, its flat records were misplaced)."""
        return (directory.rstrip("/") or "/") == self.directory_for(key)

    def is_store_directory(self, directory: str) -> bool:
        """Whether ``directory`` is one a store's files may be in: the root, a shard
        directory of either layout (``ab/cd``), or the temporary directory.  Anything else
        (another store nested under this root) is not this store's, as a local listing
        never takes files from it either -- a first-level shard directory (``ab``)
        included: no layout puts a file there, only shard directories."""
        directory = directory.rstrip("/") or "/"
        if directory == self.root or directory == self.temp_dir:
            return True
        base = self.root.rstrip("/") + "/"
        if not directory.startswith(base):
            return False
        parts = directory[len(base) :].split("/")
        return len(parts) == 2 and all(is_shard_name(part) for part in parts)

    @staticmethod
    def shard_shaped_part(root: str) -> str | None:
        """``"ab/cd"`` if ``root`` (an absolute path or a URL's path) is ``<outer>/ab/cd``,
        two shard names deep, else None.

        Such a root cannot be told from a shard directory of a sharded store at
        ``<outer>``, whose listing would account its records, whose start-up sweep would
        remove its writes in flight and whose removal of every record (persistence off)
        its acknowledged records.  Whether ``<outer>`` is a store is not known when a
        config is read (it may be another server's, or start later): stores refuse it."""
        root = root.rstrip("/") or "/"
        outer = posixpath.dirname(posixpath.dirname(root))
        if outer == root or not FileLayout(outer, shard_dirs=True).is_store_directory(root):
            return None
        return root[len(outer.rstrip("/")) + 1 :]

    @staticmethod
    def shard_shaped_local_root(path: str) -> tuple[str, str] | None:
        """``(directory, "ab/cd")`` if the local ``path`` -- as given, made absolute, or
        resolved through its symlinks -- is ``<outer>/ab/cd`` (``shard_shaped_part``),
        else None.  A link to a shard directory is one all the same: the store's files go
        where the link leads, and a sharded store at ``<outer>`` lists and sweeps them."""
        given = posixpath.abspath(path.rstrip("/") or "/")
        for directory in dict.fromkeys((given, os.path.realpath(given))):
            part = FileLayout.shard_shaped_part(directory)
            if part is not None:
                return directory, part
        return None

    def in_other_layout(self, directory: str, key: ObjectKey) -> bool:
        """Whether ``directory`` is where the other ``shard_dirs`` setting puts ``key``'s
        record (a record left by a run with the other setting)."""
        other = self.root if self.shard_dirs else posixpath.join(self.root, _shard(key))
        return directory.rstrip("/") == other

    def misplaced_records(self, name: str, count: Callable[[str, int], None]) -> MisplacedRecords:
        """A tally for one listing of the records it finds outside this layout."""
        return MisplacedRecords(self, name, count)

    # -- directories a local store has created (a cache, so a store costs no mkdir) -----------

    def is_known(self, directory: str) -> bool:
        return directory in self._known_dirs

    def remember(self, directory: str) -> None:
        with self._lock:
            self._known_dirs.add(directory)

    def forget_directories(self) -> None:
        """Called when a directory vanished (someone removed the tree): create them again."""
        with self._lock:
            self._known_dirs.clear()


class MisplacedRecords:
    """Records a listing found where this layout does not put their key.

    Either in the other ``shard_dirs`` layout's place -- the setting changed between runs
    -- or anywhere else (moved by hand).  Lookups only look where this layout puts a key,
    so such records are never served and their bytes are not counted in the capacity.
    They are left alone (switching ``shard_dirs`` back serves them again), counted as
    they are found (``records_other_layout``, ``records_misplaced``), and one line per
    kind tells the operator at the end of the listing.
    """

    def __init__(self, layout: FileLayout, name: str, count: Callable[[str, int], None]) -> None:
        self._layout = layout
        self._name = name
        self._count = count
        self.other_layout = 0
        self.elsewhere = 0

    def found(self, directory: str, key: ObjectKey) -> None:
        if self._layout.in_other_layout(directory, key):
            self.other_layout += 1
            self._count("records_other_layout", 1)
        else:
            self.elsewhere += 1
            self._count("records_misplaced", 1)

    def report(self) -> None:
        layout = self._layout
        if self.other_layout:
            log.warning(
                "%s: %d records under %s are in the %s layout (left by a run with shard_dirs: %s): "
                "they are not served and not counted in the capacity; set shard_dirs back to %s "
                "to serve them, or remove them",
                self._name,
                self.other_layout,
                printable(layout.root, 300),
                "flat" if layout.shard_dirs else "sharded",
                str(not layout.shard_dirs).lower(),
                str(not layout.shard_dirs).lower(),
            )
        if self.elsewhere:
            log.warning(
                "%s: %d record files under %s are not where either layout puts their key "
                "(moved by hand?): they are not served and not counted in the capacity; "
                "move them back or remove them",
                self._name,
                self.elsewhere,
                printable(layout.root, 300),
            )
