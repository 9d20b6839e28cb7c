"""An ``ipc://`` socket file never exists at its path with the umask's mode.

Connecting to a Unix socket takes write permission on its file.  libzmq creates the file
when it binds, under the process umask; a chmod after the bind leaves an instant in which
another local user may connect.  The path must only ever appear already private: inotify
on its directory sees how the name comes to exist (created there by the bind, or moved
there, finished, from where nobody else can reach).
"""

from __future__ import annotations

import ctypes
import os
import stat
import struct
from pathlib import Path

from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import RouterLoop

_IN_CREATE = 0x100
_IN_MOVED_TO = 0x80
_IN_NONBLOCK = os.O_NONBLOCK
_EVENT = struct.Struct("iIII")


def _watch(directory: Path) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(_IN_NONBLOCK)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    assert libc.inotify_add_watch(fd, bytes(directory), _IN_CREATE | _IN_MOVED_TO) >= 0
    return fd


def _events(fd: int) -> list[tuple[int, str]]:
    """(mask, name) of every event queued on the inotify descriptor."""
    try:
        data = os.read(fd, 1 << 16)
    except BlockingIOError:
        return []
    events, offset = [], 0
    while offset < len(data):
        _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
        offset += _EVENT.size
        name = data[offset : offset + length].rstrip(b"\0").decode()
        offset += length
        events.append((mask, name))
    return events


def test_an_ipc_socket_is_never_at_its_path_with_the_umasks_mode(tmp_path: Path) -> None:
    path = tmp_path / "tiers.sock"
    fd = _watch(tmp_path)
    previous_umask = os.umask(0o000)  # the widest mode libzmq could create the file with
    try:
        loop = RouterLoop(
            f"ipc://{path}",
            name="mode-test",
            stats=FrontendStats(),
            pool_workers=1,
            max_frame_bytes=1 << 20,
            sweep_interval_s=0.05,
            drain_timeout_s=0.0,
        )
    finally:
        os.umask(previous_umask)
    try:
        events = _events(fd)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert loop.endpoint == f"ipc://{path}"
    finally:
        loop.close()
        os.close(fd)
    arrivals = [mask for mask, name in events if name == path.name]
    # moved into place once private, never created at the path by the bind
    assert arrivals and all(mask & _IN_MOVED_TO and not mask & _IN_CREATE for mask in arrivals), events
    assert not path.exists(), "the socket file outlived the close"
    assert [p.name for p in tmp_path.iterdir()] == [], "the private bind directory was left behind"
