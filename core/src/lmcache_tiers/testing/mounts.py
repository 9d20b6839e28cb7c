"""Mounting a private tmpfs (huge pages, a small size, read-only) -- or another in-memory
filesystem such as ramfs -- for tests and benchmarks, and a filesystem that does not tell
letter case apart in names (:func:`case_insensitive_at`: exFAT, else FAT, on a loop
device over an image file).

Mounting needs root (or CAP_SYS_ADMIN); where the system refuses, :func:`mount_tmpfs`
and :func:`case_insensitive_at` say why in one line instead of raising, so a test can
skip with that reason and a benchmark can print it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass


def mount_tmpfs(directory: str, options: str, fstype: str = "tmpfs") -> str | None:
    """Mount a fresh tmpfs (or ``fstype``) on the existing ``directory`` with ``options``
    (``mount -o``); None once mounted, else the reason the system refused."""
    try:
        result = subprocess.run(
            ["mount", "-t", fstype, "-o", options, fstype, directory],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot run mount: {exc}"
    if result.returncode != 0:
        return f"mount -t {fstype} -o {options} refused: {(result.stderr or result.stdout).strip()}"
    return None


def unmount(directory: str) -> None:
    """Unmount ``directory`` (lazily if something still has it open)."""
    result = subprocess.run(["umount", directory], capture_output=True, timeout=30, check=False)
    if result.returncode != 0:
        subprocess.run(["umount", "-l", directory], capture_output=True, timeout=30, check=False)


@contextlib.contextmanager
def tmpfs_at(directory: str, options: str, fstype: str = "tmpfs") -> Iterator[str | None]:
    """Create ``directory``, mount a tmpfs (or ``fstype``) there for the block and remove
    both after; yields None when mounted, else the reason (then nothing is mounted)."""
    os.makedirs(directory, exist_ok=True)
    refused = mount_tmpfs(directory, options, fstype)
    try:
        yield refused
    finally:
        if refused is None:
            unmount(directory)
        with contextlib.suppress(OSError):
            os.rmdir(directory)


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(command), capture_output=True, text=True, timeout=60, check=False)


def _image(path: str) -> str:
    with open(path, "wb") as handle:
        handle.truncate(64 << 20)
    return path


@dataclass
class CaseInsensitiveMount:
    """A mounted case-insensitive filesystem: ``path``, and ``remount()`` for a restart
    that also forgets the names the kernel cached (exfat-fuse answers a name cached before
    a rename with the file it named then)."""

    path: str
    command: list[str]

    def remount(self) -> None:
        _run("umount", self.path)
        mounted = _run(*self.command)
        assert mounted.returncode == 0, mounted.stderr


_Mounting = Callable[[str, str], contextlib.AbstractContextManager["CaseInsensitiveMount | str"]]


@contextlib.contextmanager
def _exfat(image: str, mount_point: str) -> Iterator[CaseInsensitiveMount | str]:
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
    attached = _run("losetup", "--find", "--show", image)
    if attached.returncode != 0:
        yield f"exfat: losetup: {attached.stderr.strip()}"
        return
    loop = attached.stdout.strip()
    try:
        command = ["mount.exfat-fuse", loop, mount_point]
        mounted = _run(*command)
        if mounted.returncode != 0:
            yield f"exfat: mount.exfat-fuse: {(mounted.stderr or mounted.stdout).strip()}"
            return
        try:
            yield CaseInsensitiveMount(mount_point, command)
        finally:
            _run("umount", mount_point)
    finally:
        _run("losetup", "-d", loop)


@contextlib.contextmanager
def _vfat(image: str, mount_point: str) -> Iterator[CaseInsensitiveMount | str]:
    """FAT through the kernel's vfat driver, on a loop device over the image."""
    if shutil.which("mkfs.vfat") is None:
        yield "vfat: mkfs.vfat not installed"
        return
    made = _run("mkfs.vfat", _image(image))
    if made.returncode != 0:
        yield f"vfat: mkfs.vfat: {made.stderr.strip()}"
        return
    command = ["mount", "-o", "loop", "-t", "vfat", image, mount_point]
    mounted = _run(*command)
    if mounted.returncode != 0:
        yield f"vfat: mount: {mounted.stderr.strip()}"
        return
    try:
        yield CaseInsensitiveMount(mount_point, command)
    finally:
        _run("umount", mount_point)


_KINDS: tuple[_Mounting, ...] = (_exfat, _vfat)


@contextlib.contextmanager
def case_insensitive_at(directory: str) -> Iterator[CaseInsensitiveMount | str]:
    """A freshly made case-insensitive filesystem mounted at ``directory``/mnt (its image
    ``directory``/ci.img), unmounted after the block; yields the mount, else one line
    saying why none of the kinds tried could be mounted (then nothing is)."""
    if os.geteuid() != 0:
        yield "mounting a case-insensitive filesystem image needs root"
        return
    mount_point = os.path.join(directory, "mnt")
    os.makedirs(mount_point, exist_ok=True)
    reasons: list[str] = []
    for kind in _KINDS:
        with kind(os.path.join(directory, "ci.img"), mount_point) as mounted:
            if isinstance(mounted, CaseInsensitiveMount):
                yield mounted
                return
            reasons.append(mounted)
    yield "no case-insensitive filesystem can be mounted here: " + "; ".join(reasons)
