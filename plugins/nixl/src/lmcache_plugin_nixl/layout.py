"""Where nixl_store_dynamic keeps each object: deterministic names, flat or sharded.

A key's file is ``<stem>.bin`` where the stem is :meth:`ObjectKey.file_stem` (it ends in
``@<salt>`` when the key has a cache salt).  With sharding the file sits in
``<root>/<h0h1>/<h2h3>/`` named from the first four hex characters of the chunk hash, so no
directory grows beyond what filesystems list quickly; directories are created on first use
and remembered.  The path depends only on the key and the layout, so after a restart the
same key finds the same file, and a key is never looked up in the other layout.

Objects are written to a temporary file in the destination directory and renamed over the
final name, so a reader never sees half an object.  Temporary names are recognisable
(``.tmp-*.part``) so a start-up sweep can remove those a crash left behind.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Iterator

from lmcache_tiers.plugin import KeyValidationError, ObjectKey

RECORD_SUFFIX = ".bin"
TEMP_PREFIX = ".tmp-"
TEMP_SUFFIX = ".part"
_SHARD_CHARS = frozenset("0123456789abcdef")


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and set(name) <= _SHARD_CHARS


def is_record_name(name: str) -> bool:
    """Whether ``name`` looks like ``model@0xRANK@group@hash[@salt].bin``."""
    if not name.endswith(RECORD_SUFFIX) or name.startswith("."):
        return False
    parts = name[: -len(RECORD_SUFFIX)].split("@")
    return len(parts) in (4, 5) and parts[1].startswith("0x")


def key_from_name(name: str) -> ObjectKey | None:
    """The key a record file name was made from, or None if it is not one."""
    if not is_record_name(name):
        return None
    parts = name[: -len(RECORD_SUFFIX)].split("@")
    try:
        return ObjectKey(
            model_name=parts[0],
            kv_rank=int(parts[1][2:], 16),
            chunk_hash=bytes.fromhex(parts[3]),
            object_group=int(parts[2]),
            cache_salt=parts[4] if len(parts) == 5 else "",
        )
    except (ValueError, KeyValidationError):
        return None


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_PREFIX) and name.endswith(TEMP_SUFFIX)


class FileLayout:
    """Maps keys to paths under ``root`` and sweeps the tree."""

    def __init__(self, root: str, *, shard_dirs: bool) -> None:
        self.root = os.path.abspath(root)
        self.shard_dirs = shard_dirs
        self._known_dirs: set[str] = {self.root}
        self._dirs_lock = threading.Lock()
        self._temp_counter = itertools.count()
        self._temp_tag = f"{os.getpid()}"

    def directory_for(self, key: ObjectKey) -> str:
        if not self.shard_dirs:
            return self.root
        digest = key.chunk_hash.hex()
        return os.path.join(self.root, digest[0:2], digest[2:4])

    def path_for(self, key: ObjectKey) -> str:
        return os.path.join(self.directory_for(key), key.file_stem() + RECORD_SUFFIX)

    def ensure_directory(self, key: ObjectKey) -> str:
        """The key's directory, created on first use; later calls cost a set lookup."""
        directory = self.directory_for(key)
        if directory in self._known_dirs:
            return directory
        os.makedirs(directory, exist_ok=True)
        with self._dirs_lock:
            self._known_dirs.add(directory)
        return directory

    def temp_path(self, directory: str) -> str:
        # Independent of the key so a long stem cannot push the temporary name past NAME_MAX.
        return os.path.join(
            directory, f"{TEMP_PREFIX}{self._temp_tag}-{next(self._temp_counter)}{TEMP_SUFFIX}"
        )

    def _directories(self) -> Iterator[str]:
        """The root and every shard directory, whatever layout wrote them."""
        yield self.root
        try:
            first_level = [e for e in os.scandir(self.root) if e.is_dir(follow_symlinks=False)]
        except FileNotFoundError:
            return
        for first in first_level:
            if not _is_shard_name(first.name):
                continue
            yield first.path
            try:
                for second in os.scandir(first.path):
                    if _is_shard_name(second.name) and second.is_dir(follow_symlinks=False):
                        yield second.path
            except FileNotFoundError:
                continue

    def _files(self) -> Iterator[os.DirEntry[str]]:
        for directory in self._directories():
            try:
                entries = list(os.scandir(directory))
            except FileNotFoundError:
                continue
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    yield entry

    def iter_records(self) -> Iterator[tuple[ObjectKey, int]]:
        """Keys and file sizes of the records in this layout (not the other layout's)."""
        for entry in self._files():
            key = key_from_name(entry.name)
            if key is None or self.path_for(key) != entry.path:
                continue
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # deleted since the directory was read
            yield key, size

    def remove_temp_files(self) -> int:
        """Delete temporary files a crashed writer left behind; returns how many."""
        removed = 0
        for entry in self._files():
            if is_temp_name(entry.name):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    def remove_all_records(self) -> int:
        """Delete every record file in either layout, then empty shard directories."""
        removed = 0
        for entry in self._files():
            if is_record_name(entry.name) or is_temp_name(entry.name):
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        for directory in sorted(self._directories(), key=len, reverse=True):
            if directory != self.root:
                try:
                    os.rmdir(directory)
                except OSError:  # not empty: holds files that are not ours
                    pass
        with self._dirs_lock:
            self._known_dirs = {self.root}
        return removed
