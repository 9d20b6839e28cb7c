"""A local root on a filesystem that does not tell letter case apart in names (exFAT, FAT,
an ext4 or tmpfs directory with casefolding): keys whose model name or cache_salt differ
only in case share one record file, so a store of one replaces the other's record.  Names
are not changed for it (that would rename every existing cache); the adapter says so at
start-up instead, in one warning line and a flag in its stats (``case_insensitive_root``),
and the replaced key stays a safe miss.

The case-insensitive filesystem is a real one: an exFAT image on a loop device mounted
with exfat-fuse, or a FAT one mounted by the kernel (root, and the tools, needed; the test
is skipped with the reason otherwise)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fs_helpers import Arena, client, fs_config, load, open_fs, store

from lmcache_tiers.plugin import ObjectKey
from lmcache_tiers.testing.l2 import pattern

SIZE = 8 << 10
FLAG = "case_insensitive_root"


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, check=False)


def _image(path: Path) -> str:
    with open(path, "wb") as handle:
        handle.truncate(64 << 20)
    return str(path)


@dataclass
class Mounted:
    """A mounted case-insensitive filesystem: ``path``, and ``remount()`` for a restart
    that also forgets the names the kernel cached (exfat-fuse answers a name cached before
    a rename with the file it named then)."""

    path: str
    command: list[str]

    def remount(self) -> None:
        _run("umount", self.path)
        mounted = _run(*self.command)
        assert mounted.returncode == 0, mounted.stderr


@contextlib.contextmanager
def _exfat(image: Path, mount_point: Path) -> Iterator[Mounted | str]:
    """exFAT through exfat-fuse, which wants a block device: a loop device over the image.
    Yields the mount, else why there is none."""
    for tool in ("mkfs.exfat", "mount.exfat-fuse", "losetup"):
        if shutil.which(tool) is None:
            yield f"exfat: {tool} not installed"
            return
    made = _run("mkfs.exfat", _image(image))
    if made.returncode != 0:
        yield f"exfat: mkfs.exfat: {made.stderr.strip()}"
        return
    attached = _run("losetup", "--find", "--show", str(image))
    if attached.returncode != 0:
        yield f"exfat: losetup: {attached.stderr.strip()}"
        return
    loop = attached.stdout.strip()
    try:
        command = ["mount.exfat-fuse", loop, str(mount_point)]
        mounted = _run(*command)
        if mounted.returncode != 0:
            yield f"exfat: mount.exfat-fuse: {(mounted.stderr or mounted.stdout).strip()}"
            return
        try:
            yield Mounted(str(mount_point), command)
        finally:
            _run("umount", str(mount_point))
    finally:
        _run("losetup", "-d", loop)


@contextlib.contextmanager
def _vfat(image: Path, mount_point: Path) -> Iterator[Mounted | str]:
    """FAT through the kernel's vfat driver, on a loop device over the image."""
    if shutil.which("mkfs.vfat") is None:
        yield "vfat: mkfs.vfat not installed"
        return
    made = _run("mkfs.vfat", _image(image))
    if made.returncode != 0:
        yield f"vfat: mkfs.vfat: {made.stderr.strip()}"
        return
    command = ["mount", "-o", "loop", "-t", "vfat", str(image), str(mount_point)]
    mounted = _run(*command)
    if mounted.returncode != 0:
        yield f"vfat: mount: {mounted.stderr.strip()}"
        return
    try:
        yield Mounted(str(mount_point), command)
    finally:
        _run("umount", str(mount_point))


@pytest.fixture
def case_insensitive(tmp_path: Path) -> Iterator[Mounted]:
    """A freshly made case-insensitive filesystem, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a case-insensitive filesystem image needs root")
    mount_point = tmp_path / "mnt"
    mount_point.mkdir()
    reasons: list[str] = []
    for kind in (_exfat, _vfat):
        with kind(tmp_path / "ci.img", mount_point) as mounted:
            if isinstance(mounted, Mounted):
                yield mounted
                return
            reasons.append(mounted)
    message = "no case-insensitive filesystem can be mounted here: " + "; ".join(reasons)
    print(message)
    pytest.skip(message)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "letter case" in r.getMessage()
    ]


def test_a_case_insensitive_root_is_told_at_start_and_flagged(
    case_insensitive: Mounted, caplog: pytest.LogCaptureFixture
) -> None:
    root = os.path.join(case_insensitive.path, "kv")
    arena = Arena()
    upper = ObjectKey("Llama", 0, b"\x07" * 32)
    lower = ObjectKey("llama", 0, b"\x07" * 32)
    with caplog.at_level(logging.INFO):
        adapter = open_fs(fs_config(root, max_capacity_gb=1), arena.view)
    try:
        (line,) = _warnings(caplog)
        assert root in line and "cache_salt" in line
        assert adapter.stats()[FLAG] == 1
        assert os.listdir(root) == [], "the probe leaves no file"
        # What the line warns of: the second store replaces the first key's record.
        assert store(adapter, arena, [upper], [pattern(0, SIZE)]) == [True]
        assert store(adapter, arena, [lower], [pattern(1, SIZE)]) == [True]
        assert len(os.listdir(root)) == 1, "both keys' records are one file"
    finally:
        adapter.close()
    case_insensitive.remount()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        adapter = open_fs(fs_config(root, max_capacity_gb=1), arena.view)
    try:
        assert len(_warnings(caplog)) == 1, "told at every start"
        assert adapter.stats()[FLAG] == 1
        # After a restart the replaced key is a miss (never the other key's bytes) ...
        assert client(adapter).lookup_and_lock([upper]).found == [False]
        # ... and the key stored last is served.
        assert client(adapter).lookup_and_lock([lower]).found == [True]
        assert load(adapter, arena, [lower], [SIZE]) == ([True], [pattern(1, SIZE)])
        adapter.unlock([lower])
    finally:
        adapter.close()


def test_a_case_sensitive_root_is_not_flagged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = str(tmp_path / "kv")
    arena = Arena()
    with caplog.at_level(logging.INFO):
        adapter = open_fs(fs_config(root, max_capacity_gb=1), arena.view)
    try:
        assert _warnings(caplog) == []
        assert adapter.stats()[FLAG] == 0
        assert os.listdir(root) == [], "the probe leaves no file"
    finally:
        adapter.close()
