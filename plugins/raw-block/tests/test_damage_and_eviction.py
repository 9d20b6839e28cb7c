"""raw_block under damage and pressure: flipped bytes, oversized objects, eviction with
pinned keys, capacity held across restarts."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import SUPERBLOCK_MAGIC, RawBlockBackend
from lmcache_plugin_raw_block.slots import Claim
from rb_helpers import PAYLOAD, Arena, backend_of, client, config, flip_byte, load, open_raw, store
from slot_helpers import check_an_object_replaced_by_another_size_is_a_counted_miss, lru_controller

from lmcache_tiers.testing.l2 import make_keys, pattern


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_flipped_byte_is_a_miss_and_frees_the_slot(tmp_path: Path, where: str) -> None:
    cfg = config(tmp_path / "dev.img")
    keys = make_keys(2)
    data = [pattern(1, PAYLOAD), pattern(2, 5000)]
    arena = Arena()
    adapter = open_raw(cfg)
    try:
        assert store(adapter, keys, data, arena) == [True, True]
        backend = backend_of(adapter)
        entry = backend.table.lookup(keys[:1])[0]
        assert entry is not None
        offset = backend.geometry.slot_offset(entry.slot) + (
            backend.geometry.header_bytes + 777 if where == "payload" else 60
        )
        flip_byte(cfg.device_path, offset)
        loaded, contents = load(adapter, keys, [len(d) for d in data], arena)
        assert loaded == [False, True] and contents[1] == data[1]
        stats = adapter.stats()
        assert stats["corrupt_records_removed"] == 1
        assert stats["slots_used"] == 1, "the damaged object's slot is free again"
        # Its bytes released as it was removed, not found gone by a later lookup (and
        # taken for a removal behind the adapter's back).
        assert adapter.used_bytes() == len(data[1])
        assert client(adapter).lookup_and_lock(keys[:1]).found == [False]
        assert adapter.used_bytes() == len(data[1])
        assert adapter.stats().get("objects_vanished", 0) == 0
    finally:
        adapter.close()


def test_objects_larger_than_a_slot_are_refused_and_counted(tmp_path: Path) -> None:
    adapter = open_raw(config(tmp_path / "dev.img"))
    try:
        keys = make_keys(3)
        data = [b"a" * PAYLOAD, b"b" * (PAYLOAD + 1), b"c"]
        assert store(adapter, keys, data) == [True, False, True]
        assert adapter.stats()["object_too_large"] == 1
        assert client(adapter).lookup_and_lock(keys).found == [True, False, True]
        adapter.unlock([keys[0], keys[2]])
    finally:
        adapter.close()


def test_eviction_frees_slots_and_skips_pinned_keys(tmp_path: Path) -> None:
    adapter = open_raw(config(tmp_path / "dev.img", slots=4))
    try:
        controller = lru_controller(adapter, watermark=0.75, ratio=0.5)
        keys = make_keys(4)
        assert store(adapter, keys, [pattern(i, 1000) for i in range(4)]) == [True] * 4
        assert adapter.usage() == 1.0
        assert store(adapter, make_keys(1, start=99), [b"x" * 100]) == [False], "full: refused"
        # LRU takes the tail of a prefix first: keys[3] is the first victim, pinned here by
        # a prefetch between its lookup and its load.
        assert client(adapter).lookup_and_lock(keys[3:]).found == [True]
        controller.evict(2 * 1000)
        remaining = set(adapter.iter_keys())
        assert keys[3] in remaining and len(remaining) == 2, "the pinned key skipped, the next victims taken"
        assert adapter.usage() == 0.5 and adapter.stats()["slots_used"] == 2
        adapter.unlock(keys[3:])
        controller.evict(1000)
        assert keys[3] not in set(adapter.iter_keys()), "retried in the next cycle"
        assert store(adapter, make_keys(2, start=50), [b"y" * 100, b"z" * 100]) == [True, True]
    finally:
        adapter.close()


@pytest.mark.parametrize("evict", [False, True])
def test_capacity_is_held_across_three_restarts(tmp_path: Path, evict: bool) -> None:
    cfg = config(tmp_path / "dev.img", slots=8)
    size_on_disk = None
    for run in range(4):
        adapter = open_raw(cfg)
        try:
            if run:
                # Right after the restart, before any store: usage counts what is on the device.
                assert adapter.usage() == 1.0 if not evict else adapter.usage() <= 0.75
                assert adapter.stats()["slots_used"] == len(set(adapter.iter_keys()))
            controller = lru_controller(adapter, watermark=0.75, ratio=0.25) if evict else None
            keys = make_keys(8, start=run * 100)
            for key in keys:
                stored = store(adapter, [key], [pattern(run * 100, 3000)])
                if controller is not None:
                    controller.step(set())  # one cycle of the controller's thread
                assert adapter.usage() <= 1.0
                if not evict and run:
                    assert stored == [False], "a full device refuses new objects after a restart"
            objects = len(set(adapter.iter_keys()))
            assert objects <= 8
            assert adapter.stats()["slots_used"] == objects
        finally:
            adapter.close()
        current = Path(cfg.device_path).stat().st_size
        assert size_on_disk in (None, current), "the device file never grows"
        size_on_disk = current


def test_a_device_holding_a_filesystem_is_refused(tmp_path: Path) -> None:
    from lmcache_tiers.errors import ConfigError

    path = tmp_path / "dev.img"
    cfg = config(path)
    with open(path, "wb") as device:
        device.truncate(cfg.capacity_bytes)
        device.seek(1080)
        device.write(b"\x53\xef")  # the ext2/3/4 superblock magic
    with pytest.raises(ConfigError, match="ext2/3/4 filesystem; refusing to overwrite it"):
        open_raw(cfg)
    assert path.read_bytes()[1080:1082] == b"\x53\xef", "nothing was written"


@pytest.mark.parametrize(
    ("offset", "magic", "what"),
    [(65600, b"_BHRfS_M", "a btrfs filesystem"), (32769, b"CD001", "an ISO 9660 image")],
)
def test_a_filesystem_signature_past_a_small_metadata_region_is_refused(
    tmp_path: Path, offset: int, magic: bytes, what: str
) -> None:
    """A metadata region smaller than the signature probe (here 5 blocks): the probe
    still covers the first 68 KiB, where slots would overwrite the filesystem."""
    from lmcache_tiers.errors import ConfigError

    path = tmp_path / "dev.img"
    cfg = RawBlockConfig(device_path=str(path), slot_bytes=64 << 10, meta_total_bytes=5 * 4096)
    with open(path, "wb") as device:
        device.truncate(2 << 20)
        device.seek(offset)
        device.write(magic)
    with pytest.raises(ConfigError, match=f"holds {what}; refusing to overwrite it"):
        open_raw(cfg)
    assert path.read_bytes()[offset : offset + len(magic)] == magic, "nothing was written"


def test_a_dax_mapping_is_refused_not_reformatted(tmp_path: Path) -> None:
    """A device_path naming a dax adapter's file: another store's superblock is as
    foreign as a filesystem, so nothing of it is overwritten."""
    from lmcache_plugin_raw_block.superblock import encode_superblock, new_identity

    from lmcache_tiers.errors import ConfigError

    path = tmp_path / "dax.img"
    cfg = config(path)
    with open(path, "wb") as device:
        device.truncate(cfg.capacity_bytes)
        device.write(encode_superblock(b"LMTRDAX1", new_identity(), {"slot_bytes": 65536}))
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="holds a dax mapping; refusing to overwrite it") as caught:
        open_raw(cfg)
    assert "\n" not in str(caught.value)
    assert path.read_bytes() == before, "nothing was written"


@pytest.mark.parametrize(
    ("head", "what"),
    [(b"LMTRDAX1", "a dax mapping"), (b"XFSB", "an XFS filesystem")],
    ids=["dax", "xfs"],
)
def test_a_foreign_file_smaller_than_capacity_is_refused_before_it_grows(
    tmp_path: Path, head: bytes, what: str
) -> None:
    """A refused start-up leaves another store's file (or a filesystem image) as it was:
    not even grown to capacity_bytes, which preallocates disk space the file never had
    (and, for a dax file, the room its own adapter would map)."""
    from lmcache_tiers.errors import ConfigError

    path = tmp_path / "foreign.img"
    cfg = config(path)
    path.write_bytes(head + bytes(64 << 10))
    before = path.read_bytes()
    assert len(before) < cfg.capacity_bytes
    with pytest.raises(ConfigError, match=f"holds {what}; refusing to overwrite it") as caught:
        open_raw(cfg)
    assert "\n" not in str(caught.value)
    assert path.stat().st_size == len(before), "the foreign file was grown"
    assert path.read_bytes() == before


@pytest.mark.parametrize(
    ("offset", "magic", "what"),
    [(1080, b"\x53\xef", "an ext2/3/4 filesystem"), (510, b"\x55\xaa", "a partition table or boot sector")],
)
@pytest.mark.parametrize("reformat", [False, True])
def test_a_signature_written_over_our_superblock_block_is_refused(
    tmp_path: Path, offset: int, magic: bytes, what: str, reformat: bool
) -> None:
    """A filesystem or partition table made on the device after raw_block used it, which
    left the superblock's first bytes alone (mke2fs keeps the first KiB, a partition tool
    may write only the table): raw_block wrote zeros there, so the signature is not ours
    and the device is someone else's now, whether ours would be reopened or reformatted."""
    from lmcache_tiers.errors import ConfigError

    cfg = config(tmp_path / "dev.img")
    adapter = open_raw(cfg)
    assert store(adapter, make_keys(1), [b"abc"]) == [True]
    adapter.close()
    with open(cfg.device_path, "r+b") as device:
        device.seek(offset)
        device.write(magic)
    before = Path(cfg.device_path).read_bytes()
    again = config(cfg.device_path, load_checkpoint_on_init=not reformat)
    with pytest.raises(ConfigError, match=f"holds {what}; refusing to overwrite it"):
        open_raw(again)
    assert Path(cfg.device_path).read_bytes() == before, "nothing was written"


def test_signature_bytes_in_our_own_slots_do_not_refuse_the_device(tmp_path: Path) -> None:
    """Past the superblock's block lie checkpoints and slots, whose bytes are anyone's:
    a payload carrying a btrfs magic where btrfs keeps it is still ours."""
    meta = 5 * 4096
    cfg = RawBlockConfig(
        device_path=str(tmp_path / "dev.img"),
        slot_bytes=64 << 10,
        meta_total_bytes=meta,
        capacity_bytes=meta + 4 * (64 << 10),
    )
    payload_start = meta + cfg.header_bytes  # slot 0's payload
    data = bytearray(pattern(0, 60_000))
    data[65600 - payload_start : 65600 - payload_start + 8] = b"_BHRfS_M"
    adapter = open_raw(cfg)
    assert store(adapter, make_keys(1), [bytes(data)]) == [True]
    adapter.close()
    assert Path(cfg.device_path).read_bytes()[65600:65608] == b"_BHRfS_M"
    reopened = open_raw(cfg)
    try:
        assert reopened.stats().get("device_formats", 0) == 0
        assert load(reopened, make_keys(1), [len(data)]) == ([True], [bytes(data)])
    finally:
        reopened.close()


def test_a_damaged_superblock_of_ours_is_reformatted(tmp_path: Path) -> None:
    cfg = config(tmp_path / "dev.img")
    adapter = open_raw(cfg)
    assert store(adapter, make_keys(1), [b"abc"]) == [True]
    adapter.close()
    flip_byte(cfg.device_path, len(SUPERBLOCK_MAGIC) + 20)
    reopened = open_raw(cfg)
    try:
        assert reopened.stats()["device_formats"] == 1
        assert list(reopened.iter_keys()) == []
    finally:
        reopened.close()


def test_a_superblock_of_a_newer_format_is_reformatted_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A newer server's superblock (a downgrade) is this adapter's device in a format it
    cannot read: formatted, counted, and the warning says why -- not "damaged"."""
    cfg = config(tmp_path / "dev.img")
    adapter = open_raw(cfg)
    assert store(adapter, make_keys(1), [b"abc"]) == [True]
    adapter.close()
    with open(cfg.device_path, "r+b") as device:
        device.seek(len(SUPERBLOCK_MAGIC))
        device.write((2).to_bytes(4, "little"))  # the superblock's format version
    with caplog.at_level("WARNING", logger="lmcache_plugin_raw_block"):
        reopened = open_raw(cfg)
    try:
        assert reopened.stats()["device_formats"] == 1
        assert "superblock is of format version 2, newer than the 1 this code reads" in caplog.text
        assert "damaged" not in caplog.text
    finally:
        reopened.close()


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        ({"slots": 8}, "its geometry changed (slot_count 16 -> 8, used_bytes "),
        ({"load_checkpoint_on_init": False}, "load_checkpoint_on_init is false"),
    ],
)
def test_a_reformat_of_a_cache_says_its_objects_are_dropped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: dict[str, Any], said: str
) -> None:
    """An edited config that empties the device is one warning naming the edit and the
    loss, not only a format of so many slots."""
    adapter = open_raw(config(tmp_path / "dev.img"))
    assert store(adapter, make_keys(1), [b"abc"]) == [True]
    adapter.close()
    with caplog.at_level("WARNING", logger="lmcache_plugin_raw_block"):
        reopened = open_raw(config(tmp_path / "dev.img", **edit))
    try:
        assert reopened.stats()["device_formats"] == 1
        assert list(reopened.iter_keys()) == []
    finally:
        reopened.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert said in warnings[0] and "its objects are dropped" in warnings[0], warnings[0]


def test_slots_quarantined_after_a_media_error_leave_the_capacity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slot whose write failed with EIO is out of use until the next start: counted in
    the capacity, usage would never reach the watermark once the other slots are full,
    eviction would never run and every new object would be refused until a restart."""
    adapter = open_raw(config(tmp_path / "dev.img", slots=4))
    try:
        controller = lru_controller(adapter, watermark=0.9, ratio=0.25)
        write = RawBlockBackend._write_slot
        failed: list[int] = []

        def failing(self: RawBlockBackend, claim: Claim, header: bytes, payload: memoryview) -> None:
            if not failed:
                failed.append(claim.slot)
                raise OSError(errno.EIO, "injected media error")
            write(self, claim, header, payload)

        monkeypatch.setattr(RawBlockBackend, "_write_slot", failing)
        assert store(adapter, make_keys(1, start=90), [b"q" * 100]) == [False]
        assert adapter.stats()["slots_quarantined"] == 1
        keys = make_keys(3)
        assert store(adapter, keys, [pattern(i, 1000) for i in range(3)]) == [True] * 3
        assert adapter.usage() == 1.0, "three objects fill the three usable slots"
        controller.step(set())
        assert store(adapter, make_keys(1, start=99), [b"x" * 100]) == [True], "eviction made room"
        assert adapter.stats().get("no_free_slot", 0) == 0
    finally:
        adapter.close()


def test_an_object_replaced_by_another_size_since_the_lookup_is_a_counted_miss(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = open_raw(config(tmp_path / "dev.img"))
    try:
        check_an_object_replaced_by_another_size_is_a_counted_miss(adapter, caplog)
    finally:
        adapter.close()
