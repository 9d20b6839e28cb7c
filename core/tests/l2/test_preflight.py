"""The pre-flight hook of L2 backends and the path checks it uses: what they refuse, that
they name the field, and that they create nothing."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lmcache_tiers.config import AdapterSpec, FieldError, L2AdapterConfig, ServerConfig
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.files import DirectoryLock
from lmcache_tiers.l2.files.dirlock import LOCK_DIR_ENV
from lmcache_tiers.l2.preflight import (
    check_claimed_once,
    check_directory,
    check_directory_free,
    check_file,
    preflight_adapters,
)
from lmcache_tiers.registry import ComponentRegistry, Kind
from lmcache_tiers.testing.files import held_by_another_process


@pytest.fixture
def a_file(tmp_path: Path) -> Path:
    path = tmp_path / "file"
    path.write_bytes(b"x")
    return path


def test_a_directory_that_exists_or_can_be_created_passes_and_nothing_is_left(tmp_path: Path) -> None:
    check_directory(str(tmp_path), "path")
    check_directory(str(tmp_path / "a" / "b"), "path")  # created later, with its parents
    assert os.listdir(tmp_path) == []  # the probe directory is gone, nothing was created


@pytest.mark.parametrize(
    ("where", "words"),
    [
        ("{file}", "is a file, not a directory"),
        ("{file}/below", "cannot be created: {file} is a file, not a directory"),
        ("/proc/lmcache-tiers", "under /proc, a virtual filesystem"),
        ("/sys/kernel/lmcache-tiers", "under /sys, a virtual filesystem"),
        ("", "must not be empty"),
    ],
)
def test_unusable_directories_are_refused_naming_the_field(a_file: Path, where: str, words: str) -> None:
    with pytest.raises(FieldError) as caught:
        check_directory(where.format(file=a_file), "backend_params.file_path")
    assert caught.value.field == "backend_params.file_path"
    assert words.format(file=a_file) in str(caught.value)


def test_a_read_only_filesystem_is_found_by_trying(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a read-only tmpfs needs root")
    mount = tmp_path / "ro"
    mount.mkdir()
    if os.system(f"mount -t tmpfs -o ro,size=1m tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        with pytest.raises(FieldError, match="is on a read-only filesystem; give a writable path"):
            check_directory(str(mount / "l2"), "path")
        # the directory itself exists: it is not "created", it is written to
        refused = f"^{mount} exists but cannot be written to: {mount} is on a read-only"
        with pytest.raises(FieldError, match=refused):
            check_directory(str(mount), "path")
    finally:
        os.system(f"umount {mount}")


def test_files_and_devices(tmp_path: Path, a_file: Path) -> None:
    check_file(str(a_file), "device_path")
    check_file(str(tmp_path / "new.bin"), "device_path")  # created in an existing directory
    assert not (tmp_path / "new.bin").exists()
    check_file("/dev/null", "device_path", devices="char")
    with pytest.raises(FieldError, match="is a directory; give a regular file or a block device"):
        check_file(str(tmp_path), "device_path", devices="block")
    with pytest.raises(FieldError, match=r"give a regular file$"):
        check_file("/dev/null", "device_path")
    with pytest.raises(FieldError, match=r"directory .*/missing does not exist"):
        check_file(str(tmp_path / "missing" / "x.bin"), "device_path")
    with pytest.raises(FieldError, match=r"does not exist$"):
        check_file(str(tmp_path / "absent.bin"), "device_path", create=False)


class _Config(L2AdapterConfig):
    where: str = ""


class _Checked:
    """A backend class with a pre-flight (never built: the hook runs before anything)."""

    @staticmethod
    def preflight(config: _Config) -> None:
        if config.where == "field":
            raise FieldError("where", "not there; give another")
        if config.where == "config":
            raise ConfigError("refused as a whole")


def _registry(factory: Any) -> ComponentRegistry:
    registry = ComponentRegistry()
    registry.for_plugin(Kind.L2_ADAPTER, "test").add("checked", factory, _Config)
    return registry


def _server(*wheres: str) -> ServerConfig:
    adapters = tuple(AdapterSpec(type="checked", config=_Config(where=w), serde=()) for w in wheres)
    return msgspec.structs.replace(ServerConfig(), l2_adapters=adapters)


def test_the_hook_runs_for_every_adapter_and_names_its_path() -> None:
    registry = _registry(_Checked)
    preflight_adapters(registry, _server("", ""))
    with pytest.raises(
        ConfigError, match=r"^checked: not there; give another - at `\$\.l2_adapters\[1\]\.where`$"
    ):
        preflight_adapters(registry, _server("", "field"))
    with pytest.raises(ConfigError, match=r"^checked: refused as a whole - at `\$\.l2_adapters\[0\]`$"):
        preflight_adapters(registry, _server("config"))


def test_a_backend_without_the_hook_is_not_checked() -> None:
    class Plain:
        pass

    preflight_adapters(_registry(Plain), _server("field"))


# -- directories another server holds: the probe of DirectoryLock -------------------------------


@pytest.fixture
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Lock files of this test only (the children inherit the variable)."""
    locks = tmp_path / "locks"
    monkeypatch.setenv(LOCK_DIR_ENV, str(locks))
    return locks


def test_a_directory_another_process_holds_is_refused_naming_it_and_its_pid(
    tmp_path: Path, lock_dir: Path
) -> None:
    root = tmp_path / "cache"
    with held_by_another_process(str(root)) as holder:
        with pytest.raises(FieldError) as caught:
            check_directory_free(str(root), "path", what=f"the fs directory {root}")
        assert caught.value.field == "path"
        assert str(caught.value) == (
            f"the fs directory {root} is in use by another lmcache-tiers server (pid {holder.pid}); "
            "give each server its own directory"
        )
        # another path to it leads to the same lock
        link = tmp_path / "link"
        link.symlink_to(root)
        with pytest.raises(FieldError, match="is in use by another lmcache-tiers server"):
            check_directory_free(str(link), "path", what=str(link))
        # removed under the running server: its lock still stands
        shutil.rmtree(root)
        with pytest.raises(FieldError, match=f"pid {holder.pid}"):
            check_directory_free(str(root), "path", what=str(root))
    # the holder is gone: free again, and the probe kept nothing
    check_directory_free(str(root), "path", what=str(root))
    DirectoryLock(str(root)).release()


def test_a_directory_held_only_through_its_inode_is_refused(
    tmp_path: Path, lock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another user's server keeps its lock file in that user's lock directory: only the
    # flock on the directory itself is visible from here.
    root = tmp_path / "cache"
    with contextlib.ExitStack() as stack:
        monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "other-users-locks"))
        stack.enter_context(held_by_another_process(str(root)))
        monkeypatch.setenv(LOCK_DIR_ENV, str(lock_dir))
        with pytest.raises(FieldError) as caught:
            check_directory_free(str(root), "base_path", what=f"the fs directory {root}")
        assert str(caught.value) == (
            f"the fs directory {root} is in use by another lmcache-tiers server (another user's, or "
            "through another path); give each server its own directory"
        )
        assert caught.value.field == "base_path"


def test_a_lock_file_a_killed_server_left_is_free(tmp_path: Path, lock_dir: Path) -> None:
    root = tmp_path / "cache"
    with held_by_another_process(str(root)) as holder:
        holder.kill()  # SIGKILL: the kernel drops the locks, the lock file stays
        holder.wait()
    assert len(os.listdir(lock_dir)) == 1
    before = {path: path.stat().st_mtime_ns for path in [*lock_dir.iterdir(), root]}
    check_directory_free(str(root), "path", what=str(root))
    assert {path: path.stat().st_mtime_ns for path in [*lock_dir.iterdir(), root]} == before


def test_a_missing_directory_is_free_and_nothing_is_created(tmp_path: Path, lock_dir: Path) -> None:
    check_directory_free(str(tmp_path / "a" / "b"), "path", what="the directory")
    assert os.listdir(tmp_path) == []  # neither the directory nor the lock directory


def test_a_directory_an_adapter_of_this_process_holds_is_refused(tmp_path: Path, lock_dir: Path) -> None:
    lock = DirectoryLock(str(tmp_path / "cache"))
    try:
        with pytest.raises(FieldError, match="is already used by another adapter of this server"):
            check_directory_free(str(tmp_path / "cache"), "path", what="the directory")
    finally:
        lock.release()


class _Locking:
    """A backend locking ``where`` as a directory, or as a device."""

    @staticmethod
    def preflight(config: _Config) -> None:
        kind, _, path = config.where.partition(":")
        if kind == "dir":
            check_directory_free(path, "where", what=f"the directory {path}")
        else:
            check_claimed_once(f"device:{path}", "where", f"{path} is in use by another adapter")


def test_two_adapters_of_one_config_on_one_directory_are_refused_at_the_second(
    tmp_path: Path, lock_dir: Path
) -> None:
    registry = _registry(_Locking)
    one, two = tmp_path / "one", tmp_path / "two"
    preflight_adapters(registry, _server(f"dir:{one}", f"dir:{two}", "dev:/a", "dev:/b"))
    with pytest.raises(ConfigError) as caught:
        preflight_adapters(registry, _server(f"dir:{one}", f"dir:{two}", f"dir:{tmp_path}/two/../one"))
    assert str(caught.value) == (
        f"checked: the directory {tmp_path}/two/../one is already used by another adapter of this "
        "server; give each adapter its own directory - at `$.l2_adapters[2].where`"
    )
    with pytest.raises(
        ConfigError, match=r"^checked: /a is in use by another adapter - at `\$\.l2_adapters\[1\]"
    ):
        preflight_adapters(registry, _server("dev:/a", "dev:/a"))
    assert os.listdir(tmp_path) == []
    # each run of the pre-flight is on its own, and outside one nothing is remembered
    preflight_adapters(registry, _server(f"dir:{one}"))
    check_directory_free(str(one), "where", what="the directory")
    check_directory_free(str(one), "where", what="the directory")
