"""A password in an fsspec URL (``ftp://user:password@host/...``) is the user's secret:
the lines the ``fs`` adapter logs about its store name the store without it."""

from __future__ import annotations

import errno
import functools
import logging
import threading
import uuid
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fs_helpers import Arena, fs_config, load, open_fs, store

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


@pytest.fixture
def read_only_http_store(tmp_path: Path) -> Iterator[str]:
    """A real HTTP server on loopback serving ``tmp_path``: fsspec lists and reads it but
    cannot write or remove objects there.  Its paths are whole URLs, password and all."""
    (tmp_path / "kv").mkdir()
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://reader:{SECRET}@127.0.0.1:{server.server_address[1]}/kv"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_failed_stores_on_a_read_only_store_say_so_without_its_password(
    read_only_http_store: str, caplog: pytest.LogCaptureFixture
) -> None:
    arena = Arena()
    adapter = open_fs(fs_config(read_only_http_store), arena.view)
    keys = make_keys(3)
    try:
        with caplog.at_level(logging.INFO):
            assert store(adapter, arena, keys, [pattern(i, SIZE) for i in range(3)]) == [False] * 3
        counters = adapter.stats()
    finally:
        adapter.close()
    assert counters.get("store_io_errors") == 3
    told = [record.getMessage() for record in caplog.records]
    assert not [line for line in told if SECRET in line], told
    # No temporary object was ever created there: none is said to stay, none counted.
    assert "store_temp_objects_left" not in counters, counters
    assert not [line for line in told if "temporary object" in line], told


def test_temporary_objects_a_failed_store_leaves_are_counted_and_told_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    memory = fsspec.filesystem("memory")
    root = f"memory://cache-{uuid.uuid4().hex}/kv"
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)

    def gone(*_args: Any, **_options: Any) -> None:  # the store went away mid-store
        raise OSError(errno.EIO, "Input/output error")

    try:
        monkeypatch.setattr(memory, "mv", gone)
        monkeypatch.setattr(memory, "rm_file", gone)
        with caplog.at_level(logging.INFO):
            assert store(adapter, arena, make_keys(3), [pattern(i, SIZE) for i in range(3)]) == [False] * 3
        assert adapter.stats().get("store_temp_objects_left") == 3
        told = [record.getMessage() for record in caplog.records if "temporary object" in record.getMessage()]
        assert len(told) == 1, told  # one line a burst, not one a store
    finally:
        monkeypatch.undo()
        adapter.close()
        memory.rm(fsspec.core.url_to_fs(root)[1], recursive=True)


def test_a_store_refused_with_a_value_error_is_told_without_the_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An fsspec store may refuse a write with a ValueError that quotes its URL: the line
    telling the failed store leaves the password out, as every other line does."""
    memory = fsspec.filesystem("memory")
    root = f"memory://writer:{SECRET}@cache-{uuid.uuid4().hex}/kv"
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    real_open = memory.open

    def refusing_store(path: str, mode: str = "rb", **options: Any) -> Any:
        if "w" in mode:
            raise ValueError(f"invalid object name under {root}")
        return real_open(path, mode, **options)

    try:
        monkeypatch.setattr(memory, "open", refusing_store)
        with caplog.at_level(logging.INFO):
            assert store(adapter, arena, make_keys(1), [pattern(0, SIZE)]) == [False]
        told = [record.getMessage() for record in caplog.records]
        assert any("cannot store" in line for line in told), told
        assert not [line for line in told if SECRET in line]
    finally:
        monkeypatch.undo()
        adapter.close()
        memory.rm(fsspec.core.url_to_fs(root)[1], recursive=True)


@pytest.mark.parametrize(
    ("text", "hidden"),
    [
        # a generated (base64) password often holds "/": the URL's authority seems to end
        # there, but the user information runs to the "@" before the host
        (
            "cannot open ftp://reader:ab/cd+ef@host/kv: refused",
            "cannot open ftp://reader:***@host/kv: refused",
        ),
        ("ftp://reader:ab cd@host/kv", "ftp://reader:***@host/kv"),
        ("ftp://reader:a/b@c/d@host/kv", "ftp://reader:***@host/kv"),
        # a port and a path holding "@" are no user information
        ("http://host:8080/kv/a@b", "http://host:8080/kv/a@b"),
        ("http://[::1]:8080/kv/a@b", "http://[::1]:8080/kv/a@b"),
        # a passphrase of several words is hidden whole, its end an "@" before a host
        ("memory://u:correct horse staple@host/kv", "memory://u:***@host/kv"),
        # a quoted or bracketed URL: its closing mark may follow the host
        ("cannot open 'redis://u:a b@host'", "cannot open 'redis://u:***@host'"),
        ("cannot open (redis://u:two words more@host)", "cannot open (redis://u:***@host)"),
        ('url="redis://u:a b c@host:6379"', 'url="redis://u:***@host:6379"'),
        ("connect to redis://u:a b@host; retrying", "connect to redis://u:***@host; retrying"),
        # a password holds no line break: a later line's address ends none (the line
        # break is then shown escaped)
        (
            "redis://u:pass word refused\nmail admin@example.com",
            "redis://u:pass word refused\\nmail admin@example.com",
        ),
        # a line's later "@" before no host name is no password's end
        (
            "nodes are given as redis://host:port, not as 'user@node' (got x@y)",
            "nodes are given as redis://host:port, not as 'user@node' (got x@y)",
        ),
    ],
)
def test_a_url_password_holding_a_slash_or_a_blank_is_hidden(text: str, hidden: str) -> None:
    from lmcache_plugin_fs.remote import shown

    assert shown(text) == hidden


def test_read_errors_are_counted_and_told_once_a_burst(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A store that cannot be read (a network error, EIO) fails each load: each is counted
    (``load_read_errors``), and a burst of them is one line, not one line each."""
    memory = fsspec.filesystem("memory")
    root = f"memory://cache-{uuid.uuid4().hex}/kv"
    arena = Arena()
    adapter = open_fs(fs_config(root), arena.view)
    keys = make_keys(3)
    real_open = memory.open

    def unreadable_store(path: str, mode: str = "rb", **options: Any) -> Any:
        if "r" in mode:
            raise OSError(errno.EIO, "Input/output error")
        return real_open(path, mode, **options)

    try:
        assert store(adapter, arena, keys, [pattern(index, SIZE) for index in range(3)]) == [True] * 3
        monkeypatch.setattr(memory, "open", unreadable_store)
        with caplog.at_level(logging.INFO):
            for key in keys:
                assert load(adapter, arena, [key], [SIZE])[0] == [False]
        assert adapter.stats().get("load_read_errors") == 3
        told = [record.getMessage() for record in caplog.records if "cannot read" in record.getMessage()]
        assert len(told) == 1, told
    finally:
        monkeypatch.undo()
        adapter.close()
        memory.rm(fsspec.core.url_to_fs(root)[1], recursive=True)
