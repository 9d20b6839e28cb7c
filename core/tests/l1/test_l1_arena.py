"""L1Arena: a named shared-memory segment other processes map by name; never leaked."""

from __future__ import annotations

import errno
import fcntl
import gc
import logging
import mmap
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from lmcache_tiers.errors import ConfigError, TiersError
from lmcache_tiers.l1 import L1Arena, default_segment_name, remove_stale_segments
from lmcache_tiers.l1.arena import SEGMENT_PREFIX
from lmcache_tiers.l1.stale import hold_as_creator

MIB = 1 << 20


def _child_reads_and_replies(
    name: str, offset: int, length: int, queue: multiprocessing.Queue[bytes]
) -> None:
    arena = L1Arena.attach(name)
    try:
        queue.put(bytes(arena.buffer[offset : offset + length]))
        arena.buffer[0:5] = b"reply"
    finally:
        arena.close()


def test_another_process_maps_the_arena_by_name_and_shares_bytes() -> None:
    with L1Arena(2 * MIB) as arena:
        arena.buffer[MIB : MIB + 11] = b"hello child"
        context = multiprocessing.get_context("spawn")
        queue: multiprocessing.Queue[bytes] = context.Queue()
        child = context.Process(target=_child_reads_and_replies, args=(arena.name, MIB, 11, queue))
        child.start()
        received = queue.get(timeout=60)
        child.join(timeout=60)
        assert child.exitcode == 0
        assert received == b"hello child"
        assert bytes(arena.buffer[0:5]) == b"reply"
        assert os.path.exists(arena.path)  # a client detaching never unlinks


def test_any_client_can_map_the_segment_with_plain_mmap() -> None:
    with L1Arena(MIB) as arena:
        arena.buffer[100:103] = b"abc"
        script = textwrap.dedent(
            f"""
            import mmap, os
            fd = os.open("/dev/shm/{arena.name}", os.O_RDWR)
            m = mmap.mmap(fd, 0)
            assert m[100:103] == b"abc", m[100:103]
            m[200:203] = b"xyz"
            m.close()
            """
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
        assert bytes(arena.buffer[200:203]) == b"xyz"


def test_default_name_carries_the_pid_and_lives_in_dev_shm() -> None:
    with L1Arena(MIB, prefault=False) as arena:
        assert arena.name.startswith(f"{SEGMENT_PREFIX}{os.getpid()}_")
        assert arena.path == f"/dev/shm/{arena.name}"
        assert arena.size == MIB == len(arena.buffer)
        assert arena.owner
        assert oct(os.stat(arena.path).st_mode & 0o777) == oct(0o600)
    assert default_segment_name() != default_segment_name()


def test_close_unlinks_and_is_idempotent(segment_prefix: str) -> None:
    arena = L1Arena(MIB, name=f"{segment_prefix}close")
    path = Path(arena.path)
    assert path.exists()
    arena.close()
    assert not path.exists()
    assert arena.closed
    arena.close()
    with pytest.raises(ValueError):
        arena.buffer[0]  # the released view is unusable, not a dangling pointer


def test_close_with_live_views_still_unlinks(caplog: pytest.LogCaptureFixture) -> None:
    arena = L1Arena(MIB, prefault=False)
    path = Path(arena.path)
    view = arena.buffer[0:10]
    view[0:3] = b"abc"
    with caplog.at_level(logging.WARNING):
        arena.close()
    assert not path.exists()
    assert "still alive" in caplog.text
    assert "test_close_with_live_views_still_unlinks" in caplog.text  # who holds the view is named
    assert bytes(view[0:3]) == b"abc"  # the mapping outlives the name while views exist
    view.release()


class _Cycle:
    """An object in a reference cycle, as an exception kept with its traceback is."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.me = self


def _fail_holding(view: memoryview) -> None:
    raise ValueError(f"damaged record in {len(view)} bytes")


def test_views_held_only_by_garbage_cycles_do_not_keep_the_arena(caplog: pytest.LogCaptureFixture) -> None:
    arena = L1Arena(MIB, prefault=False)
    was_enabled = gc.isenabled()
    gc.disable()  # nothing collects the cycles but the close itself
    try:
        _Cycle(arena.buffer[0:4096])
        try:
            _fail_holding(arena.buffer[4096:8192])
        except ValueError as exc:
            cycle = _Cycle(arena.buffer[0:1])
            cycle.error = exc  # type: ignore[attr-defined]  # traceback -> frame -> view
            del cycle
        with caplog.at_level(logging.WARNING):
            arena.close()
    finally:
        if was_enabled:
            gc.enable()
    assert "still alive" not in caplog.text
    assert not Path(arena.path).exists()


def test_prefault_backs_every_page() -> None:
    with L1Arena(4 * MIB, prefault=True) as arena:
        assert os.stat(arena.path).st_blocks * 512 >= 4 * MIB
        assert bytes(arena.buffer[-4096:]) == bytes(4096)


def test_name_collision_is_a_clear_error(segment_prefix: str) -> None:
    with L1Arena(MIB, name=f"{segment_prefix}taken", prefault=False) as arena:
        with pytest.raises(ConfigError, match="already exists"):
            L1Arena(MIB, name=arena.name)
        assert Path(arena.path).exists()  # the failed attempt did not remove the owner's segment


@pytest.mark.parametrize("name", ["", "a/b", "..", "x" * 300, "sp ace", "nul\x00"])
def test_unsafe_names_are_rejected(name: str) -> None:
    with pytest.raises(ConfigError, match="not allowed"):
        L1Arena(MIB, name=name)


@pytest.mark.parametrize("size", [0, -1])
def test_size_must_be_positive(size: int) -> None:
    with pytest.raises(ConfigError):
        L1Arena(size)


def test_garbage_collection_unlinks_a_forgotten_arena() -> None:
    arena = L1Arena(MIB, prefault=False)
    path = Path(arena.path)
    del arena
    gc.collect()
    assert not path.exists()


def test_interpreter_exit_without_close_unlinks(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys
        from lmcache_tiers.l1 import L1Arena
        keep = L1Arena(1 << 20, prefault=False)
        print(keep.path, flush=True)
        raise SystemExit("exiting on an error without closing the arena")
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    path = result.stdout.strip()
    assert path.startswith("/dev/shm/")
    assert not os.path.exists(path)


def test_forked_child_exiting_does_not_unlink_the_parents_segment() -> None:
    # In a fresh interpreter, so the child's normal exit (atexit, finalizers) runs for real.
    script = textwrap.dedent(
        """
        import os, sys
        from lmcache_tiers.l1 import L1Arena
        arena = L1Arena(1 << 20, prefault=False)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)
        os.waitpid(pid, 0)
        print(os.path.exists(arena.path), flush=True)
        arena.close()
        print(os.path.exists(arena.path), flush=True)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


def test_stale_segments_of_dead_processes_are_removed() -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    stale = Path(f"/dev/shm/{SEGMENT_PREFIX}{dead_pid}_deadbeef")
    custom = Path(f"/dev/shm/{SEGMENT_PREFIX}custom_{os.getpid()}")
    stale.write_bytes(b"x")
    custom.write_bytes(b"x")
    try:
        with L1Arena(MIB, prefault=False) as live:
            removed = remove_stale_segments()
            assert stale.name in removed
            assert not stale.exists()
            assert custom.exists()  # custom names are never guessed at
            assert Path(live.path).exists()  # nor are segments of live processes
    finally:
        stale.unlink(missing_ok=True)
        custom.unlink()


def _dead_pid() -> int:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    return int(dead.stdout)


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False


def test_a_live_segment_whose_pid_another_namespace_cannot_see_is_left_alone(tmp_path: Path) -> None:
    # Two servers in containers sharing /dev/shm but not a pid namespace: the one starting
    # sees a segment whose pid does not exist for it.  Its creator's lock says it is alive.
    if not _unshare_works():
        pytest.skip("needs `unshare --pid` (root) to run the start-up reaping in another pid namespace")
    with L1Arena(MIB, prefault=False, directory=str(tmp_path)) as live:
        code = (
            "import logging, sys; from lmcache_tiers.l1 import remove_stale_segments; "
            "logging.basicConfig(level=logging.INFO); print(remove_stale_segments(sys.argv[1]))"
        )
        result = subprocess.run(
            ["unshare", "--pid", "--fork", sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert result.stdout.strip() == "[]", result.stderr
        assert Path(live.path).exists()
        assert "its creator still holds it" in result.stderr
    assert list(tmp_path.iterdir()) == []  # and its creator still removes it


def test_a_name_of_a_dead_pid_held_by_a_live_creator_is_left_alone(tmp_path: Path) -> None:
    # The same file under a name whose pid is dead here (a hard link shares the lock).
    with L1Arena(MIB, prefault=False, directory=str(tmp_path)) as live:
        other = tmp_path / f"{SEGMENT_PREFIX}{_dead_pid()}_abcdef01"
        os.link(live.path, other)
        assert remove_stale_segments(str(tmp_path)) == []
        assert other.exists()
        other.unlink()


def test_a_fifo_named_like_a_dead_segment_does_not_hang_start_up(tmp_path: Path) -> None:
    fifo = tmp_path / f"{SEGMENT_PREFIX}{_dead_pid()}_abcdef01"
    os.mkfifo(fifo)
    assert remove_stale_segments(str(tmp_path)) == [fifo.name]
    assert not fifo.exists()


def test_a_directory_or_socket_named_like_a_dead_segment_does_not_stop_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Anyone can create these in /dev/shm: unlink(2) of a directory is EISDIR, open(2) of
    # a socket ENXIO.  Neither may end start-up; both stay, with a line saying why.
    directory = tmp_path / f"{SEGMENT_PREFIX}{_dead_pid()}_abcdef01"
    directory.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(tmp_path / f"{SEGMENT_PREFIX}{_dead_pid()}_abcdef02"))
        with caplog.at_level(logging.INFO):
            assert remove_stale_segments(str(tmp_path)) == []
        assert directory.exists()
        assert caplog.text.count("not removable by this process") == 2
    finally:
        sock.close()


def test_a_filesystem_refusing_the_lock_check_does_not_stop_start_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # NFS emulates flock with POSIX locks: an exclusive one on a read-only descriptor is
    # EBADF (ENOLCK without a lock manager).  Without the lock there is no proof either way.
    stale = tmp_path / f"{SEGMENT_PREFIX}{_dead_pid()}_abcdef01"
    stale.write_bytes(b"x")

    def no_flock(fd: int, operation: int) -> None:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with caplog.at_level(logging.INFO):
        assert remove_stale_segments(str(tmp_path)) == []
    assert stale.exists()
    assert "lock cannot be checked" in caplog.text


def _refuse_shared_flock(monkeypatch: pytest.MonkeyPatch) -> None:
    real = fcntl.flock

    def no_flock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_SH:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))
        real(fd, operation)

    monkeypatch.setattr(fcntl, "flock", no_flock)


def test_a_segment_whose_creators_lock_is_refused_is_not_served(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A tmpfs takes flock (this refusal is a passing ENOLCK): other servers' start-ups can
    # check locks there, and would take a live segment without its lock for a dead one.
    _refuse_shared_flock(monkeypatch)
    with pytest.raises(TiersError, match="the creator's lock cannot be taken"):
        L1Arena(MIB, prefault=False, directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_an_nvme_file_whose_creators_lock_is_refused_goes_on_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Where flock is refused (ENOLCK: NFS without a lock manager) the reaping cannot
    # check any lock either and leaves every file in place: the creator's lock protects
    # nothing there, and refusing it must not end start-up (it did not before the lock).
    from lmcache_tiers.l1 import NvmeL1File

    _refuse_shared_flock(monkeypatch)
    with caplog.at_level(logging.WARNING), NvmeL1File(str(tmp_path), 1 << 20, direct_io=False) as file:
        assert Path(file.path).exists()
    assert "lock cannot be taken" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_a_killed_predecessor_with_this_process_pid_has_its_segment_removed(tmp_path: Path) -> None:
    # A server restarted in a fresh container often gets the pid its killed predecessor
    # had; only the lock tells that segment from one of this process.
    stale = tmp_path / f"{SEGMENT_PREFIX}{os.getpid()}_deadbeef"
    stale.write_bytes(b"x")
    with L1Arena(MIB, prefault=False, directory=str(tmp_path)) as live:
        assert remove_stale_segments(str(tmp_path)) == [stale.name]
        assert Path(live.path).exists()
    assert list(tmp_path.iterdir()) == []


def test_another_users_stale_segment_is_left_with_a_line_not_a_crash() -> None:
    # In the sticky /dev/shm a segment of another user can neither be opened nor unlinked:
    # start-up goes on and says why the file stays.
    if os.geteuid() != 0:
        pytest.skip("needs root to run the start-up reaping as another user")
    shared = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        shared.chmod(0o1777)
        stale = shared / f"{SEGMENT_PREFIX}{_dead_pid()}_abcdef01"
        stale.write_bytes(b"x")
        stale.chmod(0o600)
        code = (
            "import logging, os, sys; from lmcache_tiers.l1 import remove_stale_segments; "
            "logging.basicConfig(level=logging.INFO); os.setgid(65534); os.setuid(65534); "
            "print(remove_stale_segments(sys.argv[1]))"
        )
        result = subprocess.run([sys.executable, "-c", code, str(shared)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == "[]"
        assert "not removable by this process" in result.stderr
        assert stale.exists()
    finally:
        shutil.rmtree(shared)


def test_a_new_segment_taken_for_stale_before_its_lock_is_an_error(tmp_path: Path) -> None:
    # The moment between the O_EXCL create and the creator's lock: a reaper holding the
    # file's lock (or having unlinked it) makes the creation fail, never a segment no
    # client can open by name.
    path = tmp_path / "fresh"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    reaper = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(reaper, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(TiersError, match="removed as stale"):
            hold_as_creator(fd, str(path), required=True)
        path.unlink()
        os.close(reaper)
        with pytest.raises(TiersError, match="removed as stale"):
            hold_as_creator(fd, str(path), required=True)
    finally:
        os.close(fd)


def test_names_whose_pid_no_process_can_have_are_left_alone(tmp_path: Path) -> None:
    # Anyone may create files in /dev/shm: a name whose "pid" overflows kill(2)'s pid_t, or
    # is written in other digits, must neither stop start-up nor be taken for ours.
    names = [
        f"{SEGMENT_PREFIX}{10**12}_deadbeef",
        f"{SEGMENT_PREFIX}{2**31}_deadbeef",
        f"{SEGMENT_PREFIX}\u0661_ab",
        f"{SEGMENT_PREFIX}999999999_ab\n",  # a dead pid (above any pid_max), but not our name
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    assert remove_stale_segments(str(tmp_path)) == []
    assert all((tmp_path / name).exists() for name in names)


def test_a_segment_name_ending_in_a_newline_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not allowed"):
        L1Arena(MIB, name="segment\n", prefault=False, directory=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_pinning_without_torch_logs_and_continues(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with (
        caplog.at_level(logging.INFO, logger="lmcache_tiers.l1.arena"),
        L1Arena(MIB, prefault=False, pin=True) as arena,
    ):
        assert not arena.pinned
        arena.buffer[0:2] = b"ok"
    assert "pinning unavailable" in caplog.text


def test_pinning_without_a_cuda_device_logs_and_continues(caplog: pytest.LogCaptureFixture) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if torch.cuda.is_available():
        with L1Arena(MIB, prefault=False, pin=True) as arena:
            assert arena.pinned
        return
    with (
        caplog.at_level(logging.INFO, logger="lmcache_tiers.l1.arena"),
        L1Arena(MIB, prefault=False, pin=True) as arena,
    ):
        assert not arena.pinned
    assert "no CUDA device" in caplog.text


def test_attach_to_a_missing_segment_fails() -> None:
    with pytest.raises(FileNotFoundError):
        L1Arena.attach(f"{SEGMENT_PREFIX}does_not_exist")


def test_attached_view_sees_owner_writes_without_copies() -> None:
    with L1Arena(MIB, prefault=False) as owner, L1Arena.attach(owner.name) as client:
        assert not client.owner
        assert client.size == owner.size
        owner.buffer[7] = 42
        assert client.buffer[7] == 42
        client.buffer[8] = 43
        assert owner.buffer[8] == 43
    assert not os.path.exists(owner.path)


def test_a_full_dev_shm_is_a_clear_error_and_leaves_no_file(
    monkeypatch: pytest.MonkeyPatch, segment_prefix: str
) -> None:
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(TiersError, match="lower --l1-size-gb"):
        L1Arena(MIB, name=f"{segment_prefix}full")
    assert not Path(f"/dev/shm/{segment_prefix}full").exists()


def test_filesystems_without_fallocate_fall_back_to_truncate(monkeypatch: pytest.MonkeyPatch) -> None:
    def unsupported(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with L1Arena(MIB) as arena:
        assert os.stat(arena.path).st_size == MIB
        arena.buffer[-1] = 1


def test_prefault_falls_back_to_touching_pages_on_old_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    advised: list[int] = []

    class OldKernelMmap(mmap.mmap):
        def madvise(self, option: int, start: int = 0, length: int = sys.maxsize) -> None:
            advised.append(option)
            raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(mmap, "mmap", OldKernelMmap)
    with L1Arena(MIB, prefault=True) as arena:
        assert os.stat(arena.path).st_blocks * 512 >= MIB
    assert advised
