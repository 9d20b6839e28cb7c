"""The pre-flight hook of L2 backends and the path checks it uses: what they refuse, that
they name the field, and that they create nothing."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from lmcache_tiers.config import AdapterSpec, FieldError, L2AdapterConfig, ServerConfig
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.preflight import check_directory, check_file, preflight_adapters
from lmcache_tiers.registry import ComponentRegistry, Kind


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
