"""raw_block's configuration: LMCache's JSON accepted as is, one-line errors for the rest."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import RawBlockBackend
from lmcache_plugin_raw_block.geometry import plan_geometry
from rb_helpers import config, open_raw
from slot_helpers import plugins_show_rows

from lmcache_tiers.config import FieldError, build_config, decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.l2.preflight import preflight_adapters
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.files import held_by_another_process


def decode(**fields: object) -> RawBlockConfig:
    spec = decode_adapter(load_registry(), {"type": "raw_block", **fields}, 0)
    assert isinstance(spec.config, RawBlockConfig)
    return spec.config


def test_an_lmcache_adapter_json_is_accepted_unchanged() -> None:
    lmcache_json = {
        "device_path": "/dev/nvme1n1",
        "slot_bytes": 2101248,
        "capacity_bytes": 0,
        "use_odirect": True,
        "block_align": 4096,
        "header_bytes": 4096,
        "meta_total_bytes": 268435456,
        "meta_checkpoint_interval_sec": 30,
        "meta_enable_periodic": True,
        "load_checkpoint_on_init": True,
        "meta_verify_on_load": True,
        "num_store_workers": 2,
        "num_lookup_workers": 1,
        "num_load_workers": 4,
    }
    cfg = decode(**lmcache_json)
    assert {name: getattr(cfg, name) for name in lmcache_json} == lmcache_json
    assert cfg.payload_bytes == 2101248 - 4096


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"block_align": 3000}, "block_align must be a power of two"),
        ({"block_align": 256}, "block_align"),
        (
            {"slot_bytes": 1 << 20, "block_align": 8192, "header_bytes": 4096},
            "header_bytes .* multiple of block_align",
        ),
        ({"slot_bytes": 100_000}, "slot_bytes .* multiple of block_align"),
        ({"slot_bytes": 4096}, "slot_bytes .* must exceed header_bytes"),
        ({"meta_total_bytes": 5000}, "meta_total_bytes .* multiple of block_align"),
        ({"meta_total_bytes": 8192}, "at least 5 blocks"),
        ({"meta_total_bytes": 16384}, "at least 5 blocks"),
        ({"meta_total_bytes": 1 << 20, "capacity_bytes": 1 << 20}, "leaves no room for a slot"),
        ({"capacity_bytes": 4096}, "cannot hold a slot"),
        ({"slot_bytes": 0}, "slot_bytes"),
        ({"num_load_workers": 0}, "num_load_workers"),
        # past threading.TIMEOUT_MAX the checkpoint thread's wait raises, ending periodic checkpoints
        ({"meta_checkpoint_interval_sec": 10**10}, "meta_checkpoint_interval_sec"),
        ({"io_engine": "io_uring"}, "unknown field"),
    ],
)
def test_bad_values_get_one_line_naming_the_field(fields: dict[str, object], message: str) -> None:
    raw = {"device_path": "/tmp/x.img", "slot_bytes": 1 << 20, **fields}
    with pytest.raises(ConfigError, match=message) as caught:
        decode(**raw)
    assert "\n" not in str(caught.value)
    assert "l2_adapters[0]" in str(caught.value)


def test_a_missing_file_is_created_only_with_a_capacity(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist; name a block device or a preallocated file"):
        open_raw(RawBlockConfig(device_path=str(tmp_path / "absent.img"), slot_bytes=1 << 20))
    with pytest.raises(ConfigError, match=r"directory .* does not exist"):
        open_raw(config(tmp_path / "no" / "dir.img"))
    cfg = config(tmp_path / "new.img", slots=3)
    adapter = open_raw(cfg)
    try:
        assert os.path.getsize(cfg.device_path) == cfg.capacity_bytes
        assert adapter.stats()["slots_total"] == 3
        # preallocated, not sparse: a store can never run out of space on the filesystem
        assert os.stat(cfg.device_path).st_blocks * 512 >= cfg.capacity_bytes
    finally:
        adapter.close()


def test_a_short_existing_file_is_extended_and_one_without_room_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.img"
    path.write_bytes(b"\0" * 4096)
    cfg = config(path, slots=2)
    adapter = open_raw(cfg)
    adapter.close()
    assert path.stat().st_size == cfg.capacity_bytes
    tiny = tmp_path / "tiny.img"
    tiny.write_bytes(b"\0" * 8192)
    with pytest.raises(ConfigError, match=r"too few for .* metadata and one slot"):
        open_raw(RawBlockConfig(device_path=str(tiny), slot_bytes=1 << 20))


def test_a_capacity_no_file_can_have_is_one_line(tmp_path: Path) -> None:
    """posix_fallocate takes a signed 64-bit length: a larger capacity_bytes must be
    refused as a bad value, not fail the start-up with an OverflowError."""
    path = tmp_path / "huge.img"
    with pytest.raises(ConfigError, match="capacity_bytes") as caught:
        open_raw(decode(device_path=str(path), slot_bytes=1 << 20, capacity_bytes=1 << 63))
    assert "\n" not in str(caught.value)


def test_a_device_that_cannot_be_locked_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # flock failing otherwise than "held" (ENOLCK on a filesystem without locks): without
    # the lock a second server could share the device, so start-up is refused, not a traceback.
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    path = tmp_path / "dev.img"
    with pytest.raises(ConfigError, match="cannot lock") as caught:
        open_raw(RawBlockConfig(device_path=str(path), slot_bytes=1 << 20, capacity_bytes=16 << 20))
    assert "\n" not in str(caught.value)
    assert not path.exists(), "the file this start-up created is removed"
    # A file that was there before is the operator's: refused, and left as it was.
    path.write_bytes(b"kept")
    with pytest.raises(ConfigError, match="cannot lock"):
        open_raw(RawBlockConfig(device_path=str(path), slot_bytes=1 << 20, capacity_bytes=16 << 20))
    assert path.read_bytes() == b"kept"


def test_a_refused_start_up_removes_only_the_file_it_created(tmp_path: Path) -> None:
    # capacity_bytes passes the field checks but leaves no slot next to the metadata the
    # adapter sizes: refused once the file was created and preallocated.
    path = tmp_path / "dev.img"
    cfg = RawBlockConfig(device_path=str(path), slot_bytes=64 << 10, capacity_bytes=(64 << 10) + 3 * 4096)
    with pytest.raises(ConfigError, match="too few for"):
        open_raw(cfg)
    assert not path.exists()
    path.write_bytes(b"\0" * cfg.capacity_bytes)
    with pytest.raises(ConfigError, match="too few for"):
        open_raw(cfg)
    assert path.read_bytes() == b"\0" * cfg.capacity_bytes


def test_a_symlink_to_a_missing_file_is_refused_in_one_line(tmp_path: Path) -> None:
    link = tmp_path / "link.img"
    link.symlink_to(tmp_path / "missing.img")
    with pytest.raises(ConfigError, match=r"is a symbolic link to .*missing\.img, which does not") as caught:
        open_raw(RawBlockConfig(device_path=str(link), slot_bytes=1 << 20, capacity_bytes=16 << 20))
    assert "\n" not in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == ["link.img"]


@pytest.mark.parametrize("path", ["/dev/null", "/tmp"])
def test_neither_a_block_device_nor_a_file_is_refused(path: str) -> None:
    with pytest.raises(ConfigError, match="neither a block device nor a regular file"):
        open_raw(RawBlockConfig(device_path=path, slot_bytes=1 << 20))


def test_no_file_is_created_under_dev() -> None:
    with pytest.raises(ConfigError, match="no file is created under /dev"):
        open_raw(
            RawBlockConfig(
                device_path="/dev/lmcache-no-such-device", slot_bytes=1 << 20, capacity_bytes=1 << 30
            )
        )


def test_the_preflight_refuses_a_device_another_process_holds(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    open_raw(cfg).close()  # the file exists, as a device would
    with held_by_another_process(cfg.device_path, device=True):
        with pytest.raises(FieldError) as caught:
            RawBlockBackend.preflight(cfg)
        assert caught.value.field == "device_path"
        assert str(caught.value) == (
            f"{cfg.device_path} is in use by another raw_block or dax adapter (this server or another one "
            "holds its lock); give each adapter a device of its own"
        )
        with pytest.raises(ConfigError, match=f"raw_block: {cfg.device_path} is in use by another"):
            open_raw(cfg)  # the open words it the same
    before = os.stat(cfg.device_path)
    RawBlockBackend.preflight(cfg)  # nobody holds it: free, and left as it was
    after = os.stat(cfg.device_path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    RawBlockBackend.preflight(config(tmp_path / "new.img"))
    assert not (tmp_path / "new.img").exists()  # created by the open, not the pre-flight


def test_the_preflight_refuses_two_adapters_of_one_config_on_one_device(tmp_path: Path) -> None:
    (tmp_path / "link.img").symlink_to(tmp_path / "dev.img")
    specs = [
        {
            "type": "raw_block",
            "device_path": str(tmp_path / name),
            "slot_bytes": 1 << 20,
            "capacity_bytes": 1 << 26,
        }
        for name in ("dev.img", "other.img", "link.img")
    ]
    registry = load_registry()
    (tmp_path / "dev.img").write_bytes(b"")
    server = build_config(registry, {"l2_adapters": specs})
    with pytest.raises(
        ConfigError,
        match=r"in use by another raw_block or dax adapter .* - at `\$\.l2_adapters\[2\]\.device_path`$",
    ):
        preflight_adapters(registry, server)
    preflight_adapters(registry, build_config(registry, {"l2_adapters": specs[:2]}))


def test_two_adapters_on_one_device_are_refused(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    first = open_raw(cfg)
    try:
        with pytest.raises(ConfigError, match="in use by another raw_block or dax adapter"):
            open_raw(cfg)
        # a symlink leads to the same file, and to the same lock
        link = tmp_path / "link.img"
        link.symlink_to(cfg.device_path)
        with pytest.raises(ConfigError, match="in use"):
            open_raw(config(link))
    finally:
        first.close()
    open_raw(cfg).close()  # the lock went with the first adapter


def test_plugins_show_marks_lmcache_fields() -> None:
    rows = plugins_show_rows("raw-block")
    for name in ("device_path", "slot_bytes", "capacity_bytes", "use_odirect", "block_align", "header_bytes"):
        assert "LMCache field." in rows[name], f"{name} is not marked as LMCache's own field"


def test_the_default_metadata_region_is_sized_as_documented() -> None:
    """Each checkpoint area: a header block and 512 bytes per slot the device could hold, at
    least 64 KiB, rounded up to block_align (docs/adapters/raw_block.md quotes the first)."""
    whole = plan_geometry(RawBlockConfig(device_path="x", slot_bytes=2101248), 256 << 20)
    assert (whole.area_bytes, whole.meta_total_bytes, whole.slot_count) == (68 << 10, 143360, 127)
    small = plan_geometry(RawBlockConfig(device_path="x", slot_bytes=1 << 20), 8 << 20)
    assert (small.area_bytes, small.meta_total_bytes) == (64 << 10, 4096 + 2 * (64 << 10))
