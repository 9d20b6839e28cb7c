"""Slot files nixl_store cannot remove at close: one warning for all of them, not a line a slot."""

from __future__ import annotations

import logging
import os

import pytest
from lmcache_plugin_nixl.pool import slot_file_name
from nixl_helpers import Arena, open_pool, pool_config, scratch_dir

POOL = 16


def test_slot_files_that_cannot_be_removed_are_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    with scratch_dir() as directory:
        adapter = open_pool(pool_config(directory, pool_size=POOL), Arena().view)
        # A directory at each slot file's name: its unlink fails (EISDIR), as every unlink
        # does in a directory gone read-only.
        for slot in range(POOL):
            path = os.path.join(directory, slot_file_name(slot))
            os.unlink(path)
            os.mkdir(path)
        with caplog.at_level(logging.WARNING):
            adapter.close()
    messages = [record.getMessage() for record in caplog.records]
    lines = [message for message in messages if "could not be removed" in message]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"{POOL} of {POOL} slot files of ")
