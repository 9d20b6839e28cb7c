"""An ``ipc://`` socket file never exists at its path with the umask's mode.

Connecting to a Unix socket takes write permission on its file.  libzmq creates the file
when it binds, under the process umask; a chmod after the bind leaves an instant in which
another local user may connect.  The path must only ever appear already private: inotify
on its directory sees whether the file's mode changed after its name came to exist (a
chmod after the bind) or not (linked there, finished, from where nobody else could reach).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import logging
import os
import re
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from lmcache_tiers.errors import SettingRefused
from lmcache_tiers.frontend import FrontendStats
from lmcache_tiers.router import RouterLoop
from lmcache_tiers.server import preflight

_IN_ATTRIB = 0x4
_IN_CREATE = 0x100
_IN_MOVED_TO = 0x80
_IN_NONBLOCK = os.O_NONBLOCK
_EVENT = struct.Struct("iIII")


def _watch(directory: Path) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(_IN_NONBLOCK)
    assert fd >= 0, os.strerror(ctypes.get_errno())
    assert libc.inotify_add_watch(fd, bytes(directory), _IN_CREATE | _IN_MOVED_TO | _IN_ATTRIB) >= 0
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
    at_path = [mask for mask, name in events if name == path.name]
    # the name came to exist once, and the mode (0600, where the umask gave 0777) was
    # never changed under it: it was private from the start
    assert [mask & (_IN_CREATE | _IN_MOVED_TO) != 0 for mask in at_path] == [True], events
    assert not any(mask & _IN_ATTRIB for mask in at_path), events
    assert not path.exists(), "the socket file outlived the close"
    assert [p.name for p in tmp_path.iterdir()] == [], "the private bind directory was left behind"


def _router(path: Path, name: str) -> RouterLoop:
    return RouterLoop(
        f"ipc://{path}",
        name=name,
        stats=FrontendStats(),
        pool_workers=1,
        max_frame_bytes=1 << 20,
        sweep_interval_s=0.05,
        drain_timeout_s=0.0,
    )


def test_a_second_server_on_a_live_socket_path_is_refused_and_leaves_it_alone(tmp_path: Path) -> None:
    # Two servers started together both pass the start-up pre-flight (the path is free
    # then).  The second's bind must not take the path over: the first would serve on,
    # unreachable, and its stop would remove the second's socket.
    path = tmp_path / "tiers.sock"
    first = _router(path, "first")
    try:
        owned = path.stat().st_ino
        try:
            second = _router(path, "second")
        except OSError as exc:
            assert "already in use" in str(exc), exc
        else:
            second.close()
            raise AssertionError("a second server bound a path a live server listens on")
        assert path.stat().st_ino == owned, "the live server's socket was replaced"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiers.sock"], (
            "a bind directory was left behind"
        )
    finally:
        first.close()
    assert not path.exists()


def test_a_stale_socket_at_the_path_is_replaced(tmp_path: Path) -> None:
    # A server killed with SIGKILL leaves its socket file, which nothing listens on.
    path = tmp_path / "tiers.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    stale_inode = path.stat().st_ino
    loop = _router(path, "restarted")
    try:
        assert stat.S_ISSOCK(path.stat().st_mode) and path.stat().st_ino != stale_inode
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))  # the new server listens there
    finally:
        loop.close()
    assert not path.exists()


def test_a_server_stopping_leaves_a_socket_that_is_not_its_own(tmp_path: Path) -> None:
    # Whatever replaced the socket file meanwhile (another server, after the operator
    # removed this one's) is not this server's to remove at its stop.
    path = tmp_path / "tiers.sock"
    loop = _router(path, "replaced")
    try:
        path.unlink()
        other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        other.bind(str(path))
    finally:
        loop.close()
    try:
        assert path.exists(), "the stop removed another server's socket"
    finally:
        other.close()


def _killed_while_binding(directory: Path) -> None:
    """Run a server that SIGKILLs itself between its bind and placing the socket at its
    path (after the bind, before the link): what it leaves behind is what a server
    killed while binding leaves."""
    script = (
        "import os, signal\n"
        "from lmcache_tiers import router\n"
        "from lmcache_tiers.frontend import FrontendStats\n"
        "router._place_socket = lambda *_: os.kill(os.getpid(), signal.SIGKILL)\n"
        f"router.RouterLoop('ipc://{directory}/tiers.sock', name='killed', stats=FrontendStats(),"
        " pool_workers=1, max_frame_bytes=1 << 20, sweep_interval_s=0.05, drain_timeout_s=0.0)\n"
    )
    child = subprocess.run([sys.executable, "-c", script], env=_child_env(), check=False)
    assert child.returncode == -signal.SIGKILL, child


def _child_env() -> dict[str, str]:
    import lmcache_tiers

    core_src = str(Path(lmcache_tiers.__file__).parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([core_src, os.environ.get("PYTHONPATH", "")])}


def test_a_bind_directory_left_by_a_server_killed_while_binding_is_removed_at_the_next_start(
    tmp_path: Path,
) -> None:
    _killed_while_binding(tmp_path)
    [first] = tmp_path.iterdir()
    assert (first / "s").is_socket(), first
    _killed_while_binding(tmp_path)
    leftovers = list(tmp_path.iterdir())
    assert leftovers != [first] and len(leftovers) == 1, f"the bind directories pile up: {leftovers}"
    loop = _router(tmp_path / "tiers.sock", "restarted")
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiers.sock"], (
            "the directories of the killed servers are still there"
        )
    finally:
        loop.close()


def test_a_racing_servers_bind_directory_is_left_alone(tmp_path: Path) -> None:
    # A server binding now: its directory may be empty (just made), hold a socket that
    # answers (bound), or hold one that refuses (between libzmq's bind and listen) while
    # the server holds the directory's lock.  Anything not a socket is not ours either.
    empty = tmp_path / ".tiers-empty000"
    empty.mkdir(mode=0o700)
    answering = tmp_path / ".tiers-answers0"
    answering.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(answering / "s"))
    listener.listen()
    locked = tmp_path / ".tiers-locked00"
    locked.mkdir(mode=0o700)
    lock = os.open(locked, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    not_yet_listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    not_yet_listening.bind(str(locked / "s"))
    strange = tmp_path / ".tiers-strange0"
    strange.mkdir(mode=0o700)
    (strange / "s").write_bytes(b"not a socket")
    in_use = sorted([empty.name, answering.name, locked.name, strange.name])
    # the lock is another process's in real life: a second open file description is
    # enough for flock to tell them apart
    loop = _router(tmp_path / "tiers.sock", "started")
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*in_use, "tiers.sock"])
        assert (locked / "s").is_socket() and (answering / "s").is_socket()
    finally:
        loop.close()
        listener.close()
        not_yet_listening.close()
        os.close(lock)


def _full_backlog_listener(path: Path) -> tuple[socket.socket, list[socket.socket]]:
    """A live socket at ``path`` that accepts nobody (a server at its open files limit)
    and whose listen backlog is full: a further connect would have to wait for room."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    waiting: list[socket.socket] = []
    for _ in range(1000):
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.setblocking(False)
        try:
            client.connect(str(path))
        except BlockingIOError:
            client.close()
            return listener, waiting
        waiting.append(client)
    raise AssertionError("the backlog never filled")


def _finishes(work: Callable[[], object], listener: socket.socket) -> object:
    """Run ``work`` in a thread; if it has not ended after a generous while, it is stuck
    on the full backlog: accept the waiting connections so that it ends, and fail."""
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(_outcome(work)), daemon=True)
    thread.start()
    thread.join(30)
    if thread.is_alive():
        listener.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                listener.accept()[0].close()
        thread.join(30)  # the failure below is raised whether or not that let it end
        raise AssertionError("the probe of a live socket with a full backlog blocked")
    return outcome[0]


def _outcome(work: Callable[[], object]) -> object:
    try:
        return work()
    except Exception as exc:
        return exc


def test_a_live_socket_with_a_full_backlog_at_the_path_refuses_the_bind_without_blocking(
    tmp_path: Path,
) -> None:
    path = tmp_path / "tiers.sock"
    listener, waiting = _full_backlog_listener(path)
    try:
        owned = path.stat().st_ino
        result = _finishes(lambda: _router(path, "second"), listener)
        if isinstance(result, RouterLoop):
            result.close()
        assert isinstance(result, OSError) and "already in use" in str(result), result
        assert path.stat().st_ino == owned, "the live server's socket was replaced"
    finally:
        listener.close()
        for client in waiting:
            client.close()


def test_the_preflight_refuses_a_live_socket_with_a_full_backlog_without_blocking(tmp_path: Path) -> None:
    path = tmp_path / "tiers.sock"
    listener, waiting = _full_backlog_listener(path)
    try:
        result = _finishes(
            lambda: preflight._check_ipc_path_free("--host", f"ipc://{path}", str(path)), listener
        )
        assert isinstance(result, SettingRefused) and "already in use" in str(result), result
    finally:
        listener.close()
        for client in waiting:
            client.close()


def _dead_socket(path: Path) -> None:
    """A socket file nothing listens on (its server gone), as a user's program may leave."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
        bound.bind(str(path))


def test_directories_that_only_look_like_bind_directories_are_left_alone(tmp_path: Path) -> None:
    # Only a directory the bind itself makes -- the prefix and mkdtemp's 8 characters,
    # mode 0700, holding at most the bind's own two names -- is the start's to remove: a
    # user's directory whose name happens to start the same, or one holding sockets of
    # other names, keeps its dead sockets.
    users = tmp_path / ".tiers-cache"
    users.mkdir(mode=0o700)
    _dead_socket(users / "s")
    other_names = tmp_path / ".tiers-ab12cd34"
    other_names.mkdir(mode=0o700)
    _dead_socket(other_names / "app.sock")
    shared = tmp_path / ".tiers-ef56gh78"
    shared.mkdir()
    shared.chmod(0o755)
    _dead_socket(shared / "s")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    _dead_socket(elsewhere / "s")
    (tmp_path / ".tiers-ij90kl12").symlink_to(elsewhere)
    loop = _router(tmp_path / "tiers.sock", "started")
    try:
        for kept in (users / "s", other_names / "app.sock", shared / "s", elsewhere / "s"):
            assert kept.is_socket(), f"the start removed {kept}, not a bind directory's"
    finally:
        loop.close()


def _no_file_locks(monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    """flock fails as on a filesystem without file locks (NFS without a lock manager)."""

    def refuse(fd: int, operation: int) -> None:
        raise OSError(error, os.strerror(error))

    monkeypatch.setattr(fcntl, "flock", refuse)


@pytest.mark.parametrize("error", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_directory_without_file_locks_binds_without_the_lock_and_keeps_leftovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: int
) -> None:
    # The lock only keeps a start-up clean-up off a directory a server is binding in, and
    # a clean-up that cannot lock takes no directory: binding without it is as safe, the
    # leftovers of killed servers just stay (said at each start).
    leftover = tmp_path / ".tiers-abcd1234"
    leftover.mkdir(mode=0o700)
    _dead_socket(leftover / "s")
    _no_file_locks(monkeypatch, error)
    path = tmp_path / "tiers.sock"
    with caplog.at_level(logging.INFO, logger="lmcache_tiers.router"):
        loop = _router(path, "nfs")
    try:
        assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))
        assert (leftover / "s").is_socket(), "a directory whose lock cannot be asked was removed"
        assert sorted(p.name for p in tmp_path.iterdir()) == [leftover.name, "tiers.sock"]
    finally:
        loop.close()
    said = [r.getMessage() for r in caplog.records]
    assert any("without the bind directory's lock" in line for line in said), said
    assert any(f"cannot tell whether {leftover} is in use" in line for line in said), said


def test_another_flock_error_refuses_the_bind_in_one_line_and_releases_the_sockets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _no_file_locks(monkeypatch, errno.EIO)
    path = tmp_path / "tiers.sock"
    gc.collect()  # earlier tests' garbage collected meanwhile would close its descriptors
    descriptors = len(os.listdir("/proc/self/fd"))
    with pytest.raises(
        OSError, match=re.escape(f"cannot listen on ipc://{path}: Input/output error")
    ) as refused:
        _router(path, "refused")
    assert refused.value.errno == errno.EIO
    assert len(os.listdir("/proc/self/fd")) == descriptors, "the refused bind kept its sockets open"
    assert list(tmp_path.iterdir()) == [], "the bind left its directory or a socket file"
