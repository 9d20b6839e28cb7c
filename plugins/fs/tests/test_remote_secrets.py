"""A password in an fsspec URL (``ftp://user:password@host/...``) is the user's secret:
the lines the ``fs`` adapter logs about its store name the store without it."""

from __future__ import annotations

import errno
import logging
import uuid
from typing import Any

import fsspec
import pytest
from fs_helpers import Arena, fs_config, open_fs, store

from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 8 << 10
SECRET = "s3cr3t-pw"


def test_a_full_store_is_told_without_the_password_of_its_url(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    memory = fsspec.filesystem("memory")
    root = f"memory://reader:{SECRET}@cache-{uuid.uuid4().hex}/kv"
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    real_open = memory.open

    def full_store(path: str, mode: str = "rb", **options: Any) -> Any:
        if "w" in mode:  # the store refuses new objects: its quota is used up
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        return real_open(path, mode, **options)

    try:
        monkeypatch.setattr(memory, "open", full_store)
        with caplog.at_level(logging.INFO):
            assert store(adapter, arena, make_keys(1), [pattern(0, SIZE)]) == [False]
        assert adapter.stats().get("store_no_space") == 1
        told = [record.getMessage() for record in caplog.records]
        assert any("no space left" in line for line in told), told
        assert not [line for line in told if SECRET in line]
    finally:
        monkeypatch.undo()
        adapter.close()
        memory.rm(fsspec.core.url_to_fs(root)[1], recursive=True)
