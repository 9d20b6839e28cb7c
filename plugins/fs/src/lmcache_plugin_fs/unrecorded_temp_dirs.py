"""Temporary directories a root's record does not name: reported, never swept.

A ``relative_tmp_dir`` configured before ``.lmcache-tiers-temp-dirs`` existed (an earlier
release), then changed, is named nowhere, and what a killed run left in it stays.  Such a
directory cannot be told from a directory of temporary files no killed run left: a server of
an earlier release locks its root but not its ``relative_tmp_dir``, and one rooted above this
root (or reaching in through a symbolic link) may be writing there now; no lock tells of a
process in another container or on another host sharing the mount either.  Removing its
files on a guess could fail acknowledged stores of a live server, so the start-up only
finds them, counts them (``unrecorded_temp_dirs``) and names them in one line for the
operator to remove by hand.

The search stays off what is not this root's: first-level shard directories, symbolic
links, directories another live server or adapter holds, and directories holding a store's
files (records, shard directories, a record of temporary directories) -- a store nested
here -- are neither reported nor entered.  The root itself and the current temporary
directory are swept at every start and are not reported either.  On an fsspec root the
search reads the listing the start-up sweep made of the whole tree
(:func:`report_unrecorded_in_listing`).
"""

from __future__ import annotations

import logging
import os
import posixpath
from collections.abc import Collection

from lmcache_plugin_fs.remote import shown
from lmcache_plugin_fs.temp_dirs import RECORD_NAME
from lmcache_tiers.plugin import (
    RECORD_SUFFIX,
    BackendContext,
    FieldError,
    check_directory_free,
    is_temp_name,
)

log = logging.getLogger(__name__)

_HEX = frozenset("0123456789abcdef")
#: how many directories the line names (the count covers them all)
_NAMED = 10


def _is_shard_name(name: str) -> bool:
    return len(name) == 2 and set(name) <= _HEX


class _Listing:
    """What one directory holds: its sub-directories (not links) and temporary files,
    and whether anything in it marks a store's root."""

    def __init__(self, directory: str) -> None:
        self.directories: list[str] = []
        self.temp_files = 0
        self.store_file: str | None = None
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    if _is_shard_name(entry.name):
                        self.store_file = self.store_file or entry.name
                    self.directories.append(entry.name)
                elif entry.is_file(follow_symlinks=False):
                    if is_temp_name(entry.name):
                        self.temp_files += 1
                    elif entry.name.endswith(RECORD_SUFFIX) or entry.name == RECORD_NAME:
                        self.store_file = self.store_file or entry.name


def report_unrecorded_temp_dirs(
    root: str, current: str | None, recorded: Collection[str], context: BackendContext
) -> dict[str, int]:
    """Find, count and log the directories under the local ``root`` that hold temporary
    files but are neither the current temporary directory (``current``) nor one the
    record names (``recorded``); returns ``{relative directory: temporary files}``."""
    found: dict[str, int] = {}
    try:
        top = _Listing(root).directories
    except OSError:
        return found  # the start-up sweep, which lists it first, says why
    # a first-level shard directory is this store's, or a store's nested there
    pending = [name for name in top if not _is_shard_name(name)]
    while pending:
        relative = pending.pop()
        directory = posixpath.join(root, relative)
        if relative != current and not _free(directory):
            continue  # a live server's or adapter's: what is in it is its own
        try:
            listing = _Listing(directory)
        except OSError:
            continue  # gone, or unreadable: nothing to report of it
        if listing.store_file is not None:
            continue  # a store's root: its temporary files are its own
        if listing.temp_files and relative != current and relative not in recorded:
            found[relative] = listing.temp_files
        pending.extend(posixpath.join(relative, name) for name in listing.directories)
    if found:
        _report(root, found, context)
    return found


def report_unrecorded_in_listing(
    root: str, paths: Collection[str], current: str | None, recorded: Collection[str], context: BackendContext
) -> dict[str, int]:
    """:func:`report_unrecorded_temp_dirs` of an fsspec root, from the paths of the files
    its start-up sweep listed outside the store's own directories (no second listing).  No
    lock tells of a store there: one is known by its files alone, and what lies in or
    under a directory holding one (or shard directories) is left out."""
    base = root.rstrip("/") + "/"
    temp_files: dict[str, int] = {}
    stores: set[str] = set()
    for path in paths:
        if not path.startswith(base):
            continue
        directory, name = posixpath.split(path[len(base) :])
        parts = directory.split("/")
        if not directory or _is_shard_name(parts[0]):
            continue  # the root's, or under a first-level shard directory
        if is_temp_name(name):
            temp_files[directory] = temp_files.get(directory, 0) + 1
        elif name.endswith(RECORD_SUFFIX) or name == RECORD_NAME:
            stores.add(directory)
        if len(parts) > 2 and _is_shard_name(parts[-1]) and _is_shard_name(parts[-2]):
            stores.add("/".join(parts[:-2]))  # a shard directory's: a store's root above it
    found = {
        directory: count
        for directory, count in temp_files.items()
        if directory != current and directory not in recorded and not _under_a_store(directory, stores)
    }
    if found:
        _report(root, found, context)
    return found


def _under_a_store(directory: str, stores: set[str]) -> bool:
    parts = directory.split("/")
    return any("/".join(parts[:depth]) in stores for depth in range(1, len(parts) + 1))


def _free(directory: str) -> bool:
    """Whether no live server or adapter holds ``directory`` (the lock's own probe)."""
    try:
        check_directory_free(directory, "relative_tmp_dir", what=f"the directory {directory}")
    except FieldError:
        return False
    return True


def _report(root: str, found: dict[str, int], context: BackendContext) -> None:
    context.count("unrecorded_temp_dirs", len(found))
    named = sorted(found)[:_NAMED]
    more = f" and {len(found) - len(named)} more" if len(found) > len(named) else ""
    log.warning(
        "%s: %d directories under %s hold %d temporary files (.tmp-*.part) but are no temporary "
        "directory this root has recorded -- a relative_tmp_dir of a release before %s, or another "
        "program's: %s%s; they are not removed (no lock tells whether a server still writes "
        "there): remove them by hand once no server uses them",
        context.name,
        len(found),
        shown(root),
        sum(found.values()),
        RECORD_NAME,
        ", ".join(shown(name) for name in named),
        more,
    )
