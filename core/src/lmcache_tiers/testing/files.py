"""Test helpers for file-backed adapters: a page-aligned arena, store/load helpers, a
scratch-directory fixture, a small filesystem and the full-disk check they all pass, the
check of a write error reported only at a file's close, the checks of a root on a
filesystem that does not tell letter case apart (and of one that does), another process
holding a directory's (or device's) lock as a running server does, and a store directory
made to fail (``directory_replaced_by_file``, for ``failing_storage``).

``small_tmpfs`` mounts a tmpfs of a few MiB so tests can fill a filesystem for real
(ENOSPC, not a mock); it needs root and skips, with the reason printed, otherwise.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.l2.files import is_temp_name
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2_support import make_keys, pattern
from lmcache_tiers.testing.mounts import case_insensitive_at

__all__ = [
    "AlignedArena",
    "ScratchDirectory",
    "check_case_insensitive_root_told_and_flagged",
    "check_case_sensitive_root_not_flagged",
    "check_close_error_fails_store",
    "check_full_disk_batch",
    "directory_replaced_by_file",
    "flip_byte",
    "held_by_another_process",
    "load_data",
    "small_tmpfs",
    "store_data",
]


class AlignedArena:
    """Page-aligned stand-in for the L1 arena; ``take`` hands out 4096-aligned slices."""

    def __init__(self, size: int = 64 << 20) -> None:
        self._map = mmap.mmap(-1, size)
        self.view = memoryview(self._map)
        self._offset = 0

    def take(self, size: int) -> memoryview:
        start = -(-self._offset // 4096) * 4096
        if start + size > self.view.nbytes:
            raise MemoryError("test arena exhausted")
        self._offset = start + size
        return self.view[start : start + size]

    def filled(self, data: bytes) -> memoryview:
        view = self.take(len(data))
        view[:] = data
        return view


@contextmanager
def small_tmpfs(size_bytes: int) -> Iterator[str]:
    """A freshly mounted tmpfs of ``size_bytes``, unmounted afterwards (root only)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs to fill it needs root")
    directory = tempfile.mkdtemp(prefix="lmcache-tmpfs-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", directory],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        os.rmdir(directory)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", directory], check=False)
        os.rmdir(directory)


_HOLDER = """
import fcntl, os, sys
path, kind = sys.argv[1:3]
if kind == "directory":
    from lmcache_tiers.l2.files import DirectoryLock
    lock = DirectoryLock(path)
else:
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
sys.stdin.read()
"""


@contextmanager
def held_by_another_process(path: str, *, device: bool = False) -> Iterator[subprocess.Popen[str]]:
    """A child process holding ``path`` as a running server does -- ``DirectoryLock(path)``
    (which creates the directory), or with ``device`` the ``flock`` a slot store takes on
    its device or file -- until the block ends; yields the child (``.pid``, and
    ``.kill()`` to leave a killed server's lock file behind).  The lock directory is the
    environment's (``LMCACHE_TIERS_LOCK_DIR``) at the time of the call."""
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, path, "device" if device else "directory"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        if line.strip() != "held":
            child.kill()
            _out, err = child.communicate(timeout=30)
            raise AssertionError(f"the holder of {path} did not take its lock: {err}")
        yield child
    finally:
        for stream in (child.stdin, child.stdout, child.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


@contextmanager
def directory_replaced_by_file(directory: str) -> Iterator[None]:
    """A store directory that fails for real while the block runs: it is renamed aside
    and a regular file stands at its path, so every path below it meets ENOTDIR -- not
    ENOENT, which an empty directory (or one mounted over) would give for keys that are
    truly absent.  The directory is put back, as it was, when the block ends."""
    aside = f"{directory.rstrip(os.sep)}.aside"
    os.rename(directory, aside)
    try:
        with open(directory, "xb"):
            pass
        try:
            yield
        finally:
            os.unlink(directory)
    finally:
        os.rename(aside, directory)


def flip_byte(path: str, offset: int) -> None:
    """Damage one byte of a file in place (a bit rot stand-in)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0xFF]))


def _client(adapter: L2Adapter) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=60.0)


def store_data(
    adapter: L2Adapter, arena: AlignedArena, keys: Sequence[ObjectKey], data: Sequence[bytes]
) -> list[bool]:
    return _client(adapter).store(keys, [arena.filled(d) for d in data])


def load_data(
    adapter: L2Adapter, arena: AlignedArena, keys: Sequence[ObjectKey], sizes: Sequence[int]
) -> tuple[list[bool], list[bytes]]:
    buffers = [arena.take(size) for size in sizes]
    ok = _client(adapter).load(keys, buffers)
    return ok, [bytes(b) for b in buffers]


class ScratchDirectory:
    """Mixin for suites: ``self.storage_dir``, a fresh directory per test, removed after."""

    storage_dir: str

    @pytest.fixture(autouse=True)
    def _storage_dir(self) -> Iterator[None]:
        # Autouse, so it runs before the suite's adapter fixture, which calls make_config.
        self.storage_dir = tempfile.mkdtemp(prefix="lmcache-suite-")
        yield
        shutil.rmtree(self.storage_dir, ignore_errors=True)


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def check_full_disk_batch(
    open_adapter: Callable[[str, memoryview], L2Adapter], record_suffix: str = ".bin"
) -> None:
    """On a 1 MiB tmpfs: of a batch of 5 x 300 KiB and a small record, the records that
    fit are stored and the rest fail, counted (``store_no_space``) and logged once; no
    half-written file is left; every stored record loads; stores work once space returns."""
    with small_tmpfs(1 << 20) as root:
        arena = AlignedArena()
        keys = make_keys(6)
        data = [pattern(i, 300 << 10) for i in range(5)] + [pattern(5, 1000)]
        adapter = open_adapter(root, arena.view)
        lines = _Lines()
        logging.getLogger().addHandler(lines)
        try:
            ok = store_data(adapter, arena, keys, data)
            logging.getLogger().removeHandler(lines)
            # Three large records fit with their 4 KiB headers, two do not, the small one does
            # (which three depends on the order an adapter writes them in, e.g. in parallel).
            assert sum(ok[:5]) == 3 and ok[5], ok
            assert adapter.stats()["store_no_space"] == 2
            assert len([line for line in lines.lines if "no space left" in line]) == 1, (
                "logged once per burst"
            )
            names = [name for _dir, _sub, files in os.walk(root) for name in files]
            assert not any(is_temp_name(name) for name in names), "no half-written file left"
            assert sorted(n for n in names if n.endswith(record_suffix)) == sorted(
                f"{key.file_stem()}{record_suffix}" for key, hit in zip(keys, ok, strict=True) if hit
            )
            hits = [key for key, hit in zip(keys, ok, strict=True) if hit]
            assert _client(adapter).lookup_and_lock(keys).found == ok
            stored = [d for d, hit in zip(data, ok, strict=True) if hit]
            assert load_data(adapter, arena, hits, [len(d) for d in stored]) == ([True] * 4, stored)
            adapter.unlock(hits)
            assert adapter.delete(hits[:2]) == [True, True]
            refused = [index for index, hit in enumerate(ok) if not hit]
            again = store_data(adapter, arena, [keys[i] for i in refused], [data[i] for i in refused])
            assert again == [True, True], "space returned"
        finally:
            logging.getLogger().removeHandler(lines)
            adapter.close()


@contextmanager
def _file_closes_fail(root: str, error: int) -> Iterator[list[str]]:
    """Every close of a file under ``root`` fails with ``error`` once the descriptor is
    gone, as NFS reports a write-back error (ENOSPC, EIO) at the close; yields the names
    whose close failed.  (No network filesystem runs here: ``os.close`` is wrapped.)"""
    failed: list[str] = []
    real_close = os.close

    def close(fd: int) -> None:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        real_close(fd)
        if target.startswith(root + "/") and not os.path.isdir(target):
            failed.append(os.path.basename(target))
            raise OSError(error, os.strerror(error))

    os.close = close
    try:
        yield failed
    finally:
        os.close = real_close


def check_close_error_fails_store(
    open_adapter: Callable[[str, memoryview], L2Adapter], record_suffix: str = ".bin"
) -> None:
    """A write error that only the close of a record's temporary file reports fails the
    store before the record is published: the stores report failure, counted
    (``store_io_errors``); no record and no temporary file is left; the keys are misses;
    the next stores of the same keys work and load."""
    with tempfile.TemporaryDirectory(prefix="lmcache-close-") as root:
        arena = AlignedArena()
        keys = make_keys(3)
        data = [pattern(i, 64 << 10) for i in range(3)]
        adapter = open_adapter(root, arena.view)
        try:
            with _file_closes_fail(os.path.realpath(root), errno.EIO) as failed:
                ok = store_data(adapter, arena, keys, data)
            assert failed, "the stores closed no file"
            assert ok == [False] * 3, "a store whose close failed is not acknowledged"
            assert adapter.stats()["store_io_errors"] == 3
            names = [name for _dir, _sub, files in os.walk(root) for name in files]
            assert not [name for name in names if is_temp_name(name) or name.endswith(record_suffix)], names
            assert _client(adapter).lookup_and_lock(keys).found == [False] * 3
            assert store_data(adapter, arena, keys, data) == [True] * 3
            assert _client(adapter).lookup_and_lock(keys).found == [True] * 3
            assert load_data(adapter, arena, keys, [len(d) for d in data]) == ([True] * 3, data)
            adapter.unlock(keys)
        finally:
            adapter.close()


#: the stats flag of an adapter whose root does not tell letter case apart in names
CASE_INSENSITIVE_FLAG = "case_insensitive_root"


def _letter_case_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "letter case" in r.getMessage()
    ]


def check_case_insensitive_root_told_and_flagged(
    directory: str,
    open_adapter: Callable[[str, memoryview], L2Adapter],
    caplog: pytest.LogCaptureFixture,
    size: int,
) -> None:
    """On a real case-insensitive filesystem made under ``directory`` (skipped, the reason
    printed, where none can be mounted): an adapter opened on a root there says so in one
    warning line naming the root and cache_salt, at every start, and flags it in its stats;
    its probe leaves no file; of two keys differing only in letter case, the one stored
    last replaced the other's record, which is a miss after a restart, never its bytes."""
    with case_insensitive_at(directory) as mounted:
        if isinstance(mounted, str):
            print(mounted)
            pytest.skip(mounted)
        root = os.path.join(mounted.path, "kv")
        arena = AlignedArena()
        upper = ObjectKey("Llama", 0, b"\x07" * 32)
        lower = ObjectKey("llama", 0, b"\x07" * 32)
        with caplog.at_level(logging.INFO):
            adapter = open_adapter(root, arena.view)
        try:
            (line,) = _letter_case_warnings(caplog)
            assert root in line and "cache_salt" in line
            assert adapter.stats()[CASE_INSENSITIVE_FLAG] == 1
            assert os.listdir(root) == [], "the probe leaves no file"
            # What the line warns of: the second store replaces the first key's record.
            assert store_data(adapter, arena, [upper], [pattern(0, size)]) == [True]
            assert store_data(adapter, arena, [lower], [pattern(1, size)]) == [True]
            assert len(os.listdir(root)) == 1, "both keys' records are one file"
        finally:
            adapter.close()
        mounted.remount()
        caplog.clear()
        with caplog.at_level(logging.INFO):
            adapter = open_adapter(root, arena.view)
        try:
            assert len(_letter_case_warnings(caplog)) == 1, "told at every start"
            assert adapter.stats()[CASE_INSENSITIVE_FLAG] == 1
            # After a restart the replaced key is a miss (never the other key's bytes) ...
            assert _client(adapter).lookup_and_lock([upper]).found == [False]
            # ... and the key stored last is served.
            assert _client(adapter).lookup_and_lock([lower]).found == [True]
            assert load_data(adapter, arena, [lower], [size]) == ([True], [pattern(1, size)])
            adapter.unlock([lower])
        finally:
            adapter.close()


def check_case_sensitive_root_not_flagged(
    root: str, open_adapter: Callable[[str, memoryview], L2Adapter], caplog: pytest.LogCaptureFixture
) -> None:
    """An adapter opened on ``root``, on a filesystem telling letter case apart, warns of
    nothing, leaves its flag down and its probe no file."""
    arena = AlignedArena()
    with caplog.at_level(logging.INFO):
        adapter = open_adapter(root, arena.view)
    try:
        assert _letter_case_warnings(caplog) == []
        assert adapter.stats()[CASE_INSENSITIVE_FLAG] == 0
        assert os.listdir(root) == [], "the probe leaves no file"
    finally:
        adapter.close()
