"""close() is bounded: a device whose writes or fsync never finish does not hold up the
server's shutdown.  What is stuck is left behind (its descriptor too), counted and logged.

Two stalls: a sync that blocks, injected in the device object (everywhere), and a real
one (root only): a loop device over a file on an ext4 filesystem frozen with
``fsfreeze``, where the checkpoint's writes land in the page cache and its fsync waits
for the thaw.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lmcache_plugin_raw_block.backend as raw_backend
import pytest
from lmcache_plugin_raw_block import RawBlockConfig
from rb_helpers import HEADER, backend_of, config, flip_byte, load, open_raw, store

from lmcache_tiers.l2.adapter import BackendCloseFailed
from lmcache_tiers.testing.l2 import make_keys, pattern

#: the close budget in these tests (the adapter's is CLOSE_DRAIN_S, 10 s)
BUDGET_S = 1.0


@pytest.fixture(autouse=True)
def _short_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(raw_backend, "CLOSE_DRAIN_S", BUDGET_S)


def _close_within(adapter: object, seconds: float) -> float:
    """Close ``adapter`` on a thread; fails if that takes longer than ``seconds``, or if
    the close does not fail for its checkpoint left unfinished."""
    raised: list[BaseException] = []

    def close() -> None:
        try:
            adapter.close()  # type: ignore[attr-defined]
        except BaseException as exc:
            raised.append(exc)

    closer = threading.Thread(target=close, daemon=True)
    started = time.monotonic()
    closer.start()
    closer.join(seconds)
    assert not closer.is_alive(), f"close did not return within {seconds} s"
    assert len(raised) == 1 and isinstance(raised[0], BackendCloseFailed), raised
    assert "did not finish in time" in str(raised[0])
    return time.monotonic() - started


def _wait_for_calls(adapter: object) -> None:
    """Until the device calls close left behind have finished."""
    in_flight = backend_of(adapter)._device.in_flight  # type: ignore[arg-type]
    deadline = time.monotonic() + 60
    while in_flight._count:
        assert time.monotonic() < deadline, "the stalled device call never finished"
        time.sleep(0.02)


def test_a_close_whose_fsync_never_returns_is_bounded(tmp_path: Path) -> None:
    cfg = config(tmp_path / "device.img", meta_enable_periodic=False)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    keys = make_keys(2)
    assert store(adapter, keys, [pattern(0, 9000), pattern(1, 9000)]) == [True, True]
    release = threading.Event()
    synced = backend._device.sync

    def stalled_sync() -> None:
        release.wait(60)
        synced()

    backend._device.sync = stalled_sync  # type: ignore[method-assign]
    try:
        assert _close_within(adapter, BUDGET_S + 5) >= BUDGET_S
        assert adapter.stats()["close_checkpoint_timeouts"] == 1
    finally:
        release.set()
    _wait_for_calls(adapter)
    # The descriptor was left open for the stuck call (its number is never reused under
    # it); it still holds the device's lock, so give it back by hand to reopen.
    os.close(backend._device.fd)
    reopened = open_raw(cfg)
    try:
        assert load(reopened, keys, [9000, 9000]) == ([True, True], [pattern(0, 9000), pattern(1, 9000)])
    finally:
        reopened.close()
    assert "close_checkpoint_timeouts" not in reopened.stats()  # a close that syncs is not counted


def test_an_error_of_the_checkpoint_at_close_still_closes_the_device(tmp_path: Path) -> None:
    adapter = open_raw(config(tmp_path / "device.img", meta_enable_periodic=False))
    backend = backend_of(adapter)

    def broken(*, force: bool = False) -> bool:
        raise RuntimeError("checkpoint bug")

    backend.checkpoint = broken  # type: ignore[method-assign]
    with pytest.raises(BackendCloseFailed, match="checkpoint bug"):
        adapter.close()  # core counts and logs the backend's error, and fails the close
    with pytest.raises(OSError):
        os.fstat(backend._device.fd)  # closed all the same


def test_a_checkpoint_at_close_that_fails_fails_the_close(tmp_path: Path) -> None:
    """A delete writes nothing to the device: the checkpoint at close is what makes the
    deletes since the last one last.  One that fails (an I/O error) leaves the restart to
    an older checkpoint that still lists the deleted keys, which come back (their own
    verified bytes, but objects the server was told are gone): the close fails, so the
    stop does not pass for a clean one."""
    cfg = config(tmp_path / "device.img", meta_enable_periodic=False)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    kept, deleted = make_keys(2)
    assert store(adapter, [kept, deleted], [pattern(0, 9000), pattern(1, 9000)]) == [True, True]
    backend.checkpoint(force=True)
    assert backend.delete_many([deleted]) == [True]

    def failing_write(*args: object, **kwargs: object) -> int:
        raise OSError(5, "Input/output error")

    backend._areas.write = failing_write  # type: ignore[method-assign]
    with pytest.raises(BackendCloseFailed, match="deletes since it are undone"):
        adapter.close()
    stats = adapter.stats()
    assert stats["checkpoint_failures"] == 1
    assert stats["backend_close_failures"] == 1


def test_a_checkpoint_at_close_that_fails_with_nothing_changed_since_the_last_does_not_fail_the_close(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The checkpoint at close fails (an I/O error) but the index did not change since the
    last checkpoint written: that one already holds every delete, nothing comes back at
    the next start, and the stop must not fail (exit status 1) for it.  The failure is
    still counted (checkpoint_failures) and the close says so in a line."""
    cfg = config(tmp_path / "device.img", meta_enable_periodic=False)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    kept, deleted = make_keys(2)
    assert store(adapter, [kept, deleted], [pattern(0, 9000), pattern(1, 9000)]) == [True, True]
    assert backend.delete_many([deleted]) == [True]
    assert backend.checkpoint(force=True)

    def failing_write(*args: object, **kwargs: object) -> int:
        raise OSError(5, "Input/output error")

    backend._areas.write = failing_write  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        adapter.close()
    stats = adapter.stats()
    assert stats["checkpoint_failures"] == 1
    assert stats.get("backend_close_failures", 0) == 0
    assert "the newest checkpoint written holds the same index" in caplog.text
    reopened = open_raw(cfg)
    try:
        loaded, contents = load(reopened, [kept, deleted], [9000, 9000])
        assert loaded == [True, False]
        assert contents[0] == pattern(0, 9000)
    finally:
        reopened.close()


def test_loads_and_stores_still_in_the_backend_once_closing_began_move_nothing(tmp_path: Path) -> None:
    """Core sets its closing flag first, fails the calls still running at its deadline
    (their L1 buffers go to other objects) and only then closes the backend: from the flag
    on, a load reads nothing more into its buffers and judges no record by them, and a
    store writes and publishes nothing more -- each object counted and logged."""
    cfg = config(tmp_path / "device.img", num_load_workers=1, meta_enable_periodic=False)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    keys = make_keys(3)
    data = [pattern(i, 9000) for i in range(3)]
    assert store(adapter, keys[:2], data[:2]) == [True, True]
    damaged = backend.table.lookup(keys[:1])[0]
    assert damaged is not None
    flip_byte(cfg.device_path, backend.geometry.slot_offset(damaged.slot) + HEADER + 100)
    read = backend._io.read

    def read_then_close_begins(slot: int, buffer: memoryview) -> bytes:
        block = read(slot, buffer)
        adapter.state.closing.set()  # while this read was in flight
        return block

    backend._io.read = read_then_close_begins  # type: ignore[method-assign]
    try:
        buffers = [memoryview(bytearray(9000)) for _ in range(2)]
        # The calls core started before its flag, reaching the backend now.
        assert backend.get_many_into(keys[:2], buffers) == [False, False]
        assert not any(buffers[1]), "read into a buffer after closing began"
        assert backend.table.lookup(keys[:1]) == [damaged], "judged by a buffer that proves nothing"
        assert backend.put_many(keys[2:], [memoryview(bytearray(data[2]))]) == [False]
        assert backend.table.lookup(keys[2:]) == [None]
        assert backend.table.used_slots == 2
        stats = adapter.stats()
        assert stats["load_stopped_closing"] == 1
        assert stats["store_stopped_closing"] == 1
        assert stats.get("corrupt_records_removed", 0) == 0
    finally:
        adapter.close()


def test_a_delete_reaching_the_backend_after_the_checkpoint_at_close_is_refused(tmp_path: Path) -> None:
    """Core runs a delete on its caller's thread and does not wait for it at close: one
    that reaches the backend once the last checkpoint was taken would be answered True
    and undone by the restart (a delete writes nothing to the device).  It is refused,
    counted and logged, and the key stays, as the answer says."""
    cfg = config(tmp_path / "device.img", meta_enable_periodic=False)
    adapter = open_raw(cfg)
    backend = backend_of(adapter)
    kept, late = make_keys(2)
    assert store(adapter, [kept, late], [pattern(0, 9000), pattern(1, 9000)]) == [True, True]
    adapter.close()
    assert backend.delete_many([late]) == [False]
    assert adapter.stats()["delete_stopped_closing"] == 1
    reopened = open_raw(cfg)
    try:
        assert load(reopened, [kept, late], [9000, 9000]) == (
            [True, True],
            [pattern(0, 9000), pattern(1, 9000)],
        )
    finally:
        reopened.close()


def _root_tools() -> str | None:
    if os.geteuid() != 0:
        return "freezing a filesystem needs root"
    for tool in ("mkfs.ext4", "fsfreeze", "losetup", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    return None


@contextmanager
def _freezable_loop_device() -> Iterator[tuple[str, str]]:
    """(loop device, mount point of the ext4 filesystem holding its backing file)."""
    reason = _root_tools()
    if reason is not None:
        pytest.skip(reason)
    directory = Path(tempfile.mkdtemp(prefix="lmcache-raw-block-freeze-"))
    image, mount = directory / "fs.img", directory / "mnt"
    mount.mkdir()
    with open(image, "wb") as handle:
        handle.truncate(64 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    mounted = made.returncode == 0 and (
        subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True).returncode == 0
    )
    if not mounted:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip("cannot mount an ext4 image through a loop device here")
    device = ""
    try:
        with open(mount / "backing.img", "wb") as handle:
            handle.truncate(8 << 20)
        attached = subprocess.run(
            ["losetup", "--find", "--show", str(mount / "backing.img")], capture_output=True, text=True
        )
        if attached.returncode != 0:
            pytest.skip(f"losetup could not attach a loop device: {attached.stderr.strip()}")
        device = attached.stdout.strip()
        yield device, str(mount)
    finally:
        subprocess.run(["fsfreeze", "--unfreeze", str(mount)], capture_output=True, check=False)
        if device:
            subprocess.run(["losetup", "--detach", device], check=False)
        subprocess.run(["umount", str(mount)], check=False)
        shutil.rmtree(directory, ignore_errors=True)


def test_a_close_whose_fsync_stalls_on_a_frozen_filesystem_is_bounded() -> None:
    with _freezable_loop_device() as (device, mount):
        # Buffered: the checkpoint's writes go to the page cache, its fsync to the frozen file.
        cfg = RawBlockConfig(device_path=device, slot_bytes=64 << 10, use_odirect=False)
        adapter = open_raw(cfg)
        backend = backend_of(adapter)
        keys = make_keys(2)
        assert store(adapter, keys, [pattern(0, 9000), pattern(1, 9000)]) == [True, True]
        subprocess.run(["fsfreeze", "--freeze", mount], check=True)
        try:
            assert _close_within(adapter, BUDGET_S + 5) >= BUDGET_S
            assert adapter.stats()["close_checkpoint_timeouts"] == 1
        finally:
            subprocess.run(["fsfreeze", "--unfreeze", mount], check=True)
        _wait_for_calls(adapter)  # the fsync returns once the filesystem thaws
        os.close(backend._device.fd)  # left open for it: give the device back by hand,
        os.close(backend._device.backing_lock_fd)  # and the lock of the file behind it
        reopened = open_raw(cfg)
        try:
            assert load(reopened, keys, [9000, 9000]) == ([True, True], [pattern(0, 9000), pattern(1, 9000)])
        finally:
            reopened.close()
