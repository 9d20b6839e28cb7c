"""Reaping files a killed server left behind (shm segments, NVMe L1 block files).

A server killed with SIGKILL runs no cleanup.  Files it creates carry its pid in their
name, so the next start-up can tell which ones belong to processes that no longer exist.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_files_of_dead_processes(directory: str, pattern: re.Pattern[str], what: str) -> list[str]:
    """Unlink entries of ``directory`` matching ``pattern`` (group 1 = creator pid) whose
    creator is gone; returns the names removed."""
    removed: list[str] = []
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for entry in entries:
        match = pattern.match(entry)
        if match is None:
            continue
        pid = int(match.group(1))
        if pid == os.getpid() or process_exists(pid):
            continue
        try:
            os.unlink(os.path.join(directory, entry))
        except FileNotFoundError:
            continue
        logger.warning("removed stale %s %s/%s left by dead process %d", what, directory, entry, pid)
        removed.append(entry)
    return removed
