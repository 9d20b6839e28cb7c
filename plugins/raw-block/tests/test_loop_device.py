"""raw_block on a real block device: a loop device over a file (root only).

Skipped, with the reason printed, when the tests do not run as root or the kernel gives
no loop device; the same behaviour on a regular file is tested everywhere else.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from lmcache_plugin_raw_block import RawBlockConfig
from lmcache_plugin_raw_block.backend import RawBlockBackend
from rb_helpers import (
    check_a_superseded_record_of_another_chain_does_not_hide_the_newer_write,
    client,
    load,
    open_raw,
    store,
)
from rb_helpers import config as sized_config
from slot_helpers import small_tmpfs

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugin import CAPACITY, EVICTION, PERSISTENCE, FieldError, L2AdapterSuite
from lmcache_tiers.testing.l2 import make_keys, pattern

DEVICE_BYTES = 8 << 20


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "loop devices need root"
    if shutil.which("losetup") is None:
        return "losetup is not installed"
    if not os.path.exists("/dev/loop-control"):
        return "the kernel offers no loop devices (/dev/loop-control is missing)"
    return None


@contextmanager
def loop_device(
    size: int = DEVICE_BYTES,
    sector_size: int | None = None,
    directory: str | None = None,
    read_only: bool = False,
) -> Iterator[str]:
    """A loop device over a fresh sparse file (in ``directory``, default a new temporary
    one; ``read_only``: attached read-only); detached and removed afterwards."""
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    directory = directory or tempfile.mkdtemp(prefix="lmcache-raw-block-loop-")
    backing = Path(directory) / "backing.img"
    with open(backing, "wb") as handle:
        handle.truncate(size)
    command = ["losetup", "--find", "--show"]
    if sector_size is not None:
        command += ["--sector-size", str(sector_size)]
    if read_only:
        command.append("--read-only")
    attached = subprocess.run([*command, str(backing)], capture_output=True, text=True)
    if attached.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        pytest.skip(f"losetup could not attach a loop device: {attached.stderr.strip()}")
    device = attached.stdout.strip()
    try:
        yield device
    finally:
        subprocess.run(["losetup", "--detach", device], check=False)
        backing.unlink(missing_ok=True)
        shutil.rmtree(directory, ignore_errors=True)


class TestRawBlockLoopDevice(L2AdapterSuite):
    component_name = "raw_block"
    capabilities = frozenset({PERSISTENCE, CAPACITY, EVICTION})

    @pytest.fixture(autouse=True)
    def _device(self) -> Iterator[None]:
        with loop_device() as device:
            self.device_path = device
            yield

    def make_config(self) -> RawBlockConfig:
        # 20 KiB slots for the suite's 16 KiB objects; 64 of them after the metadata.
        return RawBlockConfig(
            device_path=self.device_path,
            slot_bytes=20 << 10,
            capacity_bytes=4096 + 2 * (64 << 10) + 64 * (20 << 10),
        )


def test_the_whole_device_is_used_when_capacity_is_zero() -> None:
    with loop_device() as device:
        adapter = open_raw(RawBlockConfig(device_path=device, slot_bytes=1 << 20))
        try:
            assert adapter.stats()["slots_total"] == (DEVICE_BYTES - 4096 - 2 * (64 << 10)) // (1 << 20)
            assert store(adapter, make_keys(2), [b"a" * 5000, b"b" * 300_000]) == [True, True]
        finally:
            adapter.close()


def test_a_device_held_exclusively_by_another_opener_is_refused() -> None:
    with loop_device() as device:
        cfg = RawBlockConfig(device_path=device, slot_bytes=1 << 20)
        holder = os.open(device, os.O_RDONLY | os.O_EXCL)  # as a mounted filesystem holds it
        try:
            # by the pre-flight, before the server builds L1, and by the open itself
            with pytest.raises(FieldError) as caught:
                RawBlockBackend.preflight(cfg)
            assert caught.value.field == "device_path"
            held = "it is in use (mounted, or held by another program)"
            assert str(caught.value) == f"cannot open {device}: {held}"
            with pytest.raises(ConfigError, match=r"in use \(mounted, or held by another program\)"):
                open_raw(cfg)
        finally:
            os.close(holder)
        RawBlockBackend.preflight(cfg)  # free again: the pre-flight let its own claim go
        open_raw(cfg).close()


def test_a_read_only_device_is_refused_before_anything_is_written() -> None:
    """The kernel lets a read-only block device be opened for writing and fails only the
    writes (EPERM): the device is refused by name, by the pre-flight and by the open."""
    with loop_device(read_only=True) as device:
        cfg = RawBlockConfig(device_path=device, slot_bytes=1 << 20)
        refusal = f"{device} is a read-only block device; make it writable (blockdev --setrw) or name another"
        with pytest.raises(FieldError) as caught:
            RawBlockBackend.preflight(cfg)
        assert (caught.value.field, str(caught.value)) == ("device_path", refusal)
        with pytest.raises(ConfigError) as opened:
            open_raw(cfg)
        assert str(opened.value) == f"raw_block: {refusal}"


def test_the_file_behind_a_loop_device_in_use_is_refused_and_the_other_way_round() -> None:
    """An adapter naming a loop device and another naming the file behind it would write
    the same bytes, each taking them for its own device: the second is refused, whichever
    comes first, and the file is free again once the first adapter closed."""
    with loop_device(size=sized_config("x").capacity_bytes, directory=tempfile.mkdtemp()) as device:
        backing = Path(_backing_file_of(device))
        on_device, on_file = sized_config(device), sized_config(backing)
        first = open_raw(on_device)
        try:
            assert store(first, make_keys(1), [b"a" * 1000]) == [True]
            with pytest.raises(ConfigError, match="in use by another raw_block or dax adapter"):
                open_raw(on_file)
            assert load(first, make_keys(1), [1000]) == ([True], [b"a" * 1000])
        finally:
            first.close()
        second = open_raw(on_file)  # the loop device's adapter let the file go
        try:
            held = f"{device} is a loop device over {backing}, which another adapter"
            with pytest.raises(FieldError, match=held):  # by the pre-flight, before L1 is built
                RawBlockBackend.preflight(on_device)
            with pytest.raises(ConfigError, match=held):
                open_raw(on_device)
        finally:
            second.close()


def test_loop_devices_over_parts_of_one_file_run_side_by_side_and_hold_the_file() -> None:
    """Loop devices over two parts of one file (an offset and a size limit each) are two
    devices: each has its adapter, while an adapter naming the whole file is refused."""
    part = sized_config("x").capacity_bytes
    with loop_devices_over_parts(part, [0, part]) as (backing, devices):
        keys, data = make_keys(2), [pattern(1, 3000), pattern(2, 5000)]
        adapters = [open_raw(sized_config(device)) for device in devices]
        try:
            for adapter, key, payload in zip(adapters, keys, data, strict=True):
                assert store(adapter, [key], [payload]) == [True]
            with pytest.raises(ConfigError, match="in use by another raw_block or dax adapter"):
                open_raw(sized_config(backing))
            for adapter, key, payload in zip(adapters, keys, data, strict=True):
                assert load(adapter, [key], [len(payload)]) == ([True], [payload])
        finally:
            for adapter in adapters:
                adapter.close()


@contextmanager
def loop_devices_over_parts(part: int, offsets: list[int]) -> Iterator[tuple[Path, list[str]]]:
    """(a fresh sparse file, loop devices over the ``part`` bytes of it at each of
    ``offsets``); detached and removed afterwards."""
    reason = _unavailable()
    if reason is not None:
        pytest.skip(reason)
    directory = tempfile.mkdtemp(prefix="lmcache-raw-block-loop-")
    backing = Path(directory) / "backing.img"
    with open(backing, "wb") as handle:
        handle.truncate(max(offsets) + part)
    devices: list[str] = []
    try:
        for offset in offsets:
            command = ["losetup", "--find", "--show", "--offset", str(offset), "--sizelimit", str(part)]
            attached = subprocess.run([*command, str(backing)], capture_output=True, text=True)
            if attached.returncode != 0:
                pytest.skip(f"losetup could not attach a loop device: {attached.stderr.strip()}")
            devices.append(attached.stdout.strip())
        yield backing, devices
    finally:
        for device in devices:
            subprocess.run(["losetup", "--detach", device], check=False)
        shutil.rmtree(directory, ignore_errors=True)


def _backing_file_of(device: str) -> str:
    listed = subprocess.run(
        ["losetup", "--noheadings", "--output", "BACK-FILE", device], capture_output=True, text=True
    )
    return listed.stdout.strip()


def test_block_align_below_the_logical_block_size_is_refused() -> None:
    with loop_device(sector_size=4096) as device:
        config = RawBlockConfig(device_path=device, slot_bytes=1 << 20, block_align=512, header_bytes=512)
        with pytest.raises(ConfigError, match=r"not a multiple of the logical block size .* \(4096\)"):
            open_raw(config)
        adapter = open_raw(RawBlockConfig(device_path=device, slot_bytes=1 << 20))
        try:
            assert store(adapter, make_keys(1), [b"x" * 10_000]) == [True]
            assert client(adapter).lookup_and_lock(make_keys(1)).sizes == [10_000]
            adapter.unlock(make_keys(1))
        finally:
            adapter.close()


def test_a_full_backing_store_fails_the_stores_that_do_not_fit_until_space_returns() -> None:
    """A loop device over a sparse file on a 4 MiB tmpfs: writes past 4 MiB get ENOSPC from
    the block device, as from a full thin-provisioned volume."""
    slot = 260 << 10
    with small_tmpfs("4m") as mount, loop_device(16 << 20, directory=mount) as device:
        config = RawBlockConfig(device_path=device, slot_bytes=slot)
        adapter = open_raw(config)
        try:
            outcomes: dict[int, bool] = {}
            for index in range(24):
                (ok,) = store(adapter, make_keys(1, start=index), [pattern(index, 200_000)])
                outcomes[index] = ok
            stored = [i for i, ok in outcomes.items() if ok]
            failed = [i for i, ok in outcomes.items() if not ok]
            assert stored and failed, outcomes
            stats = adapter.stats()
            assert stats["slot_write_errors"] >= len(failed)
            assert stats["slots_used"] == len(stored), "failed writes hold no slot"
            for index in failed:
                assert client(adapter).lookup_and_lock(make_keys(1, start=index)).found == [False]
            # The loop driver acknowledges the write that crosses the limit although its
            # tail never landed (the same happens with the device alone, without this
            # adapter): the checksum turns it into a counted miss, never wrong bytes.
            keys = [make_keys(1, start=i)[0] for i in stored]
            loaded, contents = load(adapter, keys, [200_000] * len(keys))
            for index, ok, data in zip(stored, loaded, contents, strict=True):
                assert not ok or data == pattern(index, 200_000), f"object {index} loaded wrong bytes"
            torn = loaded.count(False)
            assert torn <= 1 and adapter.stats().get("corrupt_records_removed", 0) == torn
            stored = [index for index, ok in zip(stored, loaded, strict=True) if ok]
            subprocess.run(["mount", "-o", "remount,size=64m", mount], check=True)
            assert store(
                adapter, make_keys(2, start=100), [pattern(100, 200_000), pattern(101, 200_000)]
            ) == [True, True]
        finally:
            adapter.close()
        reopened = open_raw(config)
        try:
            keys = [make_keys(1, start=i)[0] for i in stored] + make_keys(2, start=100)
            expected = [pattern(i, 200_000) for i in stored] + [pattern(100, 200_000), pattern(101, 200_000)]
            assert load(reopened, keys, [200_000] * len(keys)) == ([True] * len(keys), expected)
        finally:
            reopened.close()


def test_a_file_that_cannot_be_preallocated_is_refused_at_start() -> None:
    with small_tmpfs("1m") as mount, pytest.raises(ConfigError, match=r"cannot preallocate .* No space left"):
        open_raw(sized_config(Path(mount) / "device.img", slots=64))


def test_a_superseded_record_of_another_chain_does_not_hide_the_newer_write() -> None:
    with loop_device() as device:
        cfg = RawBlockConfig(device_path=device, slot_bytes=64 << 10)
        check_a_superseded_record_of_another_chain_does_not_hide_the_newer_write(cfg)


def test_loop_devices_over_overlapping_parts_of_one_file_are_refused_to_a_second_adapter() -> None:
    """Two loop devices over parts of one file that share bytes would each take those
    bytes for slots of their own: the second adapter is refused (by the pre-flight too),
    and runs once the first closed."""
    part = sized_config("x").capacity_bytes
    with loop_devices_over_parts(part, [0, part // 2]) as (backing, devices):  # the second inside the first
        first = open_raw(sized_config(devices[0]))
        try:
            assert store(first, make_keys(1), [pattern(1, 3000)]) == [True]
            held = f"{devices[1]} is a loop device over {backing}, which another adapter"
            with pytest.raises(FieldError, match=held):
                RawBlockBackend.preflight(sized_config(devices[1]))
            with pytest.raises(ConfigError, match=held):
                open_raw(sized_config(devices[1]))
            assert load(first, make_keys(1), [3000]) == ([True], [pattern(1, 3000)])
        finally:
            first.close()
        open_raw(sized_config(devices[1])).close()  # the first let its bytes go


def test_objects_stored_through_a_loop_device_are_read_through_its_file_and_back() -> None:
    """An operator may name the loop device in one run and the file behind it in the next
    (or the other way round): the same bytes, the same geometry, so every object written
    through one is read through the other with its bytes, and one written through the file
    is read through the device again.  A miss here would be a silent loss of the cache."""
    with loop_device(size=sized_config("x").capacity_bytes, directory=tempfile.mkdtemp()) as device:
        on_device, on_file = sized_config(device), sized_config(_backing_file_of(device))
        keys, payloads = make_keys(4), [b"d" * 3000, b"e" * 40_000, b"f" * 512, b"g" * 7000]
        sizes = [len(data) for data in payloads]
        through_device = open_raw(on_device)
        try:
            assert store(through_device, keys[:3], payloads[:3]) == [True] * 3
        finally:
            through_device.close()
        through_file = open_raw(on_file)
        try:
            assert load(through_file, keys[:3], sizes[:3]) == ([True] * 3, payloads[:3])
            assert through_file.stats().get("device_formats", 0) == 0
            assert store(through_file, keys[3:], payloads[3:]) == [True]
        finally:
            through_file.close()
        again = open_raw(on_device)
        try:
            assert load(again, keys, sizes) == ([True] * 4, payloads)
        finally:
            again.close()
