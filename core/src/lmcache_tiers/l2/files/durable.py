"""Directories whose entries survive a power loss.

A file's fsync makes its bytes durable, and its directory's fsync the entry that names
it; neither commits the entry that names a directory made for it.  With ``fsync`` on, a
store publishes only into directories whose own entries were fsynced into their parents.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["fsync_directory", "make_directories"]


def fsync_directory(directory: str) -> None:
    """fsync a directory: the entries in it become durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directories(
    directory: str, sync: Callable[[str], None] | None = None, *, below: str | None = None
) -> None:
    """Create ``directory`` and its missing parents, as ``os.makedirs`` does.

    With ``sync`` (``fsync_directory`` or a stand-in), every directory created is synced
    into its parent, and so is every directory between ``below`` (exclusive) and
    ``directory`` (inclusive) that already existed: one made by an earlier call whose
    sync failed, or by code that synced nothing, must not hold acknowledged records while
    its entry is not durable.  Raises OSError (a failed sync included).
    """
    inside = os.path.join(os.path.abspath(below), "") if below is not None else None
    chain: list[str] = []  # deepest first
    path = os.path.abspath(directory)
    while os.path.dirname(path) != path:
        if not (inside is not None and path.startswith(inside)) and os.path.isdir(path):
            break
        chain.append(path)
        path = os.path.dirname(path)
    for path in reversed(chain):
        try:
            os.mkdir(path)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
    if sync is not None:
        for path in chain:
            sync(os.path.dirname(path))
