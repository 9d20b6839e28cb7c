"""dax's configuration: LMCache's JSON accepted as is, one-line errors for the rest."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import pytest
from dax_helpers import SLOT, config, open_dax, shm_dir, size_gb
from lmcache_plugin_dax import DaxConfig, DaxDevice
from lmcache_plugin_dax.backend import DaxBackend
from slot_helpers import plugins_show_rows, small_tmpfs

from lmcache_tiers.config import FieldError, decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.testing.files import held_by_another_process


def decode(**fields: object) -> DaxConfig:
    spec = decode_adapter(load_registry(), {"type": "dax", **fields}, 0)
    assert isinstance(spec.config, DaxConfig)
    return spec.config


def test_unset_worker_counts_follow_the_cpus() -> None:
    unset = decode(device_path="/dev/dax0.0", max_dax_size_gb=4, slot_bytes=2 << 20)
    cpus = os.cpu_count() or 1
    assert (unset.store_workers, unset.load_workers) == (min(2, cpus), min(4, cpus))


def test_both_lmcache_forms_are_accepted_unchanged() -> None:
    single = decode(
        device_path="/dev/dax0.0",
        max_dax_size_gb=4,
        slot_bytes=2 << 20,
        num_store_workers=1,
        num_lookup_workers=1,
        num_load_workers=4,
    )
    assert single.mappings() == (DaxDevice(device_path="/dev/dax0.0", max_dax_size_gb=4.0),)
    assert (single.store_workers, single.load_workers) == (1, 4)
    several = decode(
        slot_bytes=2 << 20,
        devices=[
            {"device_path": "/dev/dax0.0", "max_dax_size_gb": 4},
            {"device_path": "/dev/dax1.0", "max_dax_size_gb": 8.5},
        ],
    )
    assert [d.device_path for d in several.mappings()] == ["/dev/dax0.0", "/dev/dax1.0"]
    assert several.load_workers == min(4, os.cpu_count() or 1)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_dax_size_gb": 1}, "device_path is required"),
        ({"device_path": "/dev/dax0.0"}, "max_dax_size_gb is required"),
        ({"device_path": "", "max_dax_size_gb": 1}, "device_path must not be empty"),
        (
            {
                "device_path": "/dev/dax0.0",
                "max_dax_size_gb": 1,
                "devices": [{"device_path": "/x", "max_dax_size_gb": 1}],
            },
            "either devices or device_path",
        ),
        (
            {"device_path": "/dev/dax0.0", "max_dax_size_gb": 0.0001},
            r"cannot hold its index.*max_dax_size_gb",
        ),
        (
            {
                "devices": [
                    {"device_path": "/a", "max_dax_size_gb": 1},
                    {"device_path": "/a", "max_dax_size_gb": 2},
                ]
            },
            r"listed twice.*devices\[1\].device_path",
        ),
        ({"devices": [{"device_path": "/a"}]}, "max_dax_size_gb"),
        ({"device_path": "/dev/dax0.0", "max_dax_size_gb": 1, "hotplug_enabled": True}, "unknown field"),
    ],
)
def test_bad_values_get_one_line_naming_the_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        decode(slot_bytes=1 << 20, **fields)
    assert "\n" not in str(caught.value)
    assert "l2_adapters[0]" in str(caught.value)


def test_a_missing_file_is_created_and_preallocated() -> None:
    with shm_dir() as directory:
        cfg = config(directory / "new.img", slots=4)
        adapter = open_dax(cfg)
        try:
            size = (directory / "new.img").stat()
            assert size.st_size >= 4 * cfg.slot_bytes
            assert size.st_blocks * 512 >= size.st_size, "no holes: a store into one could SIGBUS"
            assert adapter.stats()["slots_total"] == 4
        finally:
            adapter.close()


def test_paths_that_cannot_be_mapped_are_refused() -> None:
    with pytest.raises(ConfigError, match="cannot map"):
        open_dax(config("/dev/null", slots=64))  # a character device without mmap
    with pytest.raises(ConfigError, match="neither a DAX character device nor a regular file"):
        open_dax(config("/tmp"))
    with pytest.raises(ConfigError, match="cannot open"):
        open_dax(config("/no/such/dir/dax.img"))


def test_two_adapters_on_one_mapping_are_refused() -> None:
    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        first = open_dax(cfg)
        try:
            with pytest.raises(ConfigError, match="in use by another raw_block or dax adapter"):
                open_dax(cfg)
        finally:
            first.close()
        open_dax(cfg).close()


def test_the_preflight_refuses_a_mapping_another_process_holds() -> None:
    with shm_dir() as directory:
        first, second = directory / "a.img", directory / "b.img"
        cfg = DaxConfig(
            devices=[
                DaxDevice(device_path=str(first), max_dax_size_gb=size_gb(16)),
                DaxDevice(device_path=str(second), max_dax_size_gb=size_gb(16)),
            ],
            slot_bytes=SLOT,
        )
        second.write_bytes(b"")
        with held_by_another_process(str(second), device=True):
            with pytest.raises(FieldError) as caught:
                DaxBackend.preflight(cfg)
            assert caught.value.field == "devices[1].device_path"
            assert str(caught.value) == (
                f"{second} is in use by another raw_block or dax adapter (this server or another one "
                "holds its lock); give each adapter a device of its own"
            )
        DaxBackend.preflight(cfg)
        assert sorted(os.listdir(directory)) == ["b.img"]  # nothing created, nothing written
        assert second.stat().st_size == 0


def test_a_file_holding_a_filesystem_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "image"
    cfg = config(path)
    with open(path, "wb") as image:
        image.truncate(1 << 20)
        image.write(b"XFSB")
    with pytest.raises(ConfigError, match="XFS filesystem; refusing to overwrite it"):
        open_dax(cfg)
    assert path.read_bytes()[:4] == b"XFSB"


def test_a_raw_block_device_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    """A device_path naming a raw_block adapter's file: another store's superblock is as
    foreign as a filesystem.  Not even extended to the mapped size: a raw_block using
    the whole file would find another geometry and reformat it."""
    import rb_helpers
    from lmcache_plugin_raw_block import RawBlockConfig

    from lmcache_tiers.testing.l2 import make_keys

    path = tmp_path / "raw.img"
    raw = rb_helpers.open_raw(rb_helpers.config(path, slots=4))
    assert rb_helpers.store(raw, make_keys(1), [b"abc"]) == [True]
    raw.close()
    before = path.read_bytes()
    cfg = config(path)
    assert cfg.max_dax_size_gb is not None and cfg.max_dax_size_gb * (1 << 30) > len(before)
    with pytest.raises(ConfigError, match="holds a raw_block slot store; refusing to overwrite it") as caught:
        open_dax(cfg)
    assert "\n" not in str(caught.value)
    assert path.read_bytes() == before, "nothing was written"
    whole_file = rb_helpers.open_raw(RawBlockConfig(device_path=str(path), slot_bytes=SLOT))
    try:
        assert whole_file.stats().get("device_formats", 0) == 0
        assert rb_helpers.load(whole_file, make_keys(1), [3]) == ([True], [b"abc"])
    finally:
        whole_file.close()


@pytest.mark.parametrize("persist_enabled", [True, False])
def test_a_signature_written_over_our_superblock_page_is_refused(persist_enabled: bool) -> None:
    """A filesystem made on the file after dax used it, leaving its first KiB alone (as
    mke2fs does): dax wrote zeros there, so the file is someone else's now."""
    with shm_dir() as directory:
        cfg = config(directory / "dax.img", persist_enabled=persist_enabled)
        open_dax(cfg).close()
        with open(cfg.device_path or "", "r+b") as image:
            image.seek(1080)
            image.write(b"\x53\xef")
        before = (directory / "dax.img").read_bytes()
        with pytest.raises(ConfigError, match="ext2/3/4 filesystem; refusing to overwrite it"):
            open_dax(cfg)
        assert (directory / "dax.img").read_bytes() == before


def test_a_refused_start_up_removes_only_the_files_it_created(monkeypatch: pytest.MonkeyPatch) -> None:
    with shm_dir() as directory:
        created, foreign = directory / "a.img", directory / "b.img"
        foreign.write_bytes(b"XFSB" + bytes(8188))
        both = DaxConfig(
            devices=(
                DaxDevice(device_path=str(created), max_dax_size_gb=size_gb(4)),
                DaxDevice(device_path=str(foreign), max_dax_size_gb=size_gb(4)),
            ),
            slot_bytes=SLOT,
        )
        with pytest.raises(ConfigError, match="XFS filesystem; refusing to overwrite it"):
            open_dax(both)
        assert sorted(os.listdir(directory)) == ["b.img"]
        assert foreign.read_bytes() == b"XFSB" + bytes(8188)

        def no_locks(fd: int, operation: int) -> None:
            raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

        monkeypatch.setattr(fcntl, "flock", no_locks)
        with pytest.raises(ConfigError, match="cannot lock") as caught:
            open_dax(config(created))
        assert "\n" not in str(caught.value)
        assert sorted(os.listdir(directory)) == ["b.img"]


def test_a_file_created_through_a_symlink_is_removed_by_a_refused_start_up() -> None:
    """A device_path that is a symbolic link to a missing file: the file dax creates is
    the link's target, and a refused start-up removes it as any file it created."""
    with shm_dir() as directory:
        link, foreign = directory / "link.img", directory / "b.img"
        link.symlink_to(directory / "target.img")
        foreign.write_bytes(b"XFSB" + bytes(8188))
        both = DaxConfig(
            devices=(
                DaxDevice(device_path=str(link), max_dax_size_gb=size_gb(4)),
                DaxDevice(device_path=str(foreign), max_dax_size_gb=size_gb(4)),
            ),
            slot_bytes=SLOT,
        )
        with pytest.raises(ConfigError, match="XFS filesystem; refusing to overwrite it"):
            open_dax(both)
        assert sorted(os.listdir(directory)) == ["b.img", "link.img"], "the file it created is left"


def test_plugins_show_marks_lmcache_fields() -> None:
    rows = plugins_show_rows("dax")
    for name in ("device_path", "max_dax_size_gb", "devices", "slot_bytes"):
        assert "LMCache field." in rows[name], name
    assert "lmcache-tiers addition" in rows["persist_enabled"]


def test_a_file_that_cannot_be_preallocated_is_refused_at_start() -> None:
    with small_tmpfs("1m") as mount:
        with pytest.raises(ConfigError, match=r"cannot preallocate .* No space left"):
            open_dax(config(Path(mount) / "dax.img", slots=64))
        assert os.listdir(mount) == [], "the file it created is removed"


def test_no_file_is_created_under_dev() -> None:
    # A missing name under /dev is a mistyped device node (/dev/dax0.1 for /dev/dax0.0):
    # a file made there would live in devtmpfs memory, not on the device meant.
    missing = "/dev/lmcache-no-such-dax"
    cfg = config(missing, slots=4)
    with pytest.raises(FieldError, match="no file is created under /dev") as caught:
        DaxBackend.preflight(cfg)
    assert caught.value.field == "device_path"
    with pytest.raises(ConfigError, match="no file is created under /dev"):
        open_dax(cfg)
    assert not os.path.exists(missing)


def test_a_file_a_dax_adapter_holds_is_refused_to_raw_block_without_naming_the_wrong_kind() -> None:
    # flock tells that the file is held, not by which kind of adapter: the line names both,
    # so an operator does not look for a raw_block server that is not there.
    from lmcache_plugin_raw_block import RawBlockConfig
    from lmcache_plugin_raw_block.backend import RawBlockBackend

    with shm_dir() as directory:
        cfg = config(directory / "dax.img")
        adapter = open_dax(cfg)
        try:
            raw = RawBlockConfig(device_path=cfg.device_path or "", slot_bytes=SLOT + 4096)
            with pytest.raises(FieldError) as caught:
                RawBlockBackend.preflight(raw)
            assert str(caught.value) == (
                f"{cfg.device_path} is in use by another raw_block or dax adapter (this server or "
                "another one holds its lock); give each adapter a device of its own"
            )
        finally:
            adapter.close()


def test_a_file_on_a_read_only_filesystem_is_refused_by_the_preflight() -> None:
    import subprocess

    with small_tmpfs("8m") as mount:
        path = Path(mount) / "dax.img"
        path.write_bytes(b"")
        subprocess.run(["mount", "-o", "remount,ro", mount], check=True)
        cfg = config(path)
        with pytest.raises(FieldError) as caught:
            DaxBackend.preflight(cfg)
        assert (caught.value.field, str(caught.value)) == (
            "device_path",
            f"this user may not read and write {path}",
        )
