"""A record header read back from L2 tells core the object's L1 size: under a serde chain
that changes sizes nothing else does.  A header claiming more than all of this server's L1
is a miss, counted (``record_l1_size_past_capacity``, apart from damage) and logged --
never a prefetch that evicts L1 to make room for it -- and the record is kept: a server
with a larger L1 sharing the store may have written it, and reads it."""

from __future__ import annotations

import importlib.util
import logging
import time
from pathlib import Path

import pytest
from engine_support import keys_of, spec, store

from lmcache_tiers.l2.record import decode_header, encode_header

if (
    importlib.util.find_spec("lmcache_plugin_fs") is None
    or importlib.util.find_spec("lmcache_plugin_serde_zstd") is None
):
    pytest.skip("lmcache-plugin-fs and lmcache-plugin-serde-zstd are needed", allow_module_level=True)

SIZE = 256 << 10


def fs_with_zstd(path: Path):  # type: ignore[no-untyped-def]
    return spec({"type": "fs", "path": str(path), "serde": [{"type": "zstd"}]})


def stored_by_a_server_now_closed(engine, root: Path, key, size: int = SIZE) -> None:  # type: ignore[no-untyped-def]
    """``key`` stored in the fs store at ``root`` by a server that has closed since."""
    earlier = engine([fs_with_zstd(root)])
    assert store(earlier, [key], size) == [key]
    assert earlier.flush(10)
    earlier.close()


def forge_l1_size(root: Path, l1_size: int) -> Path:
    """Rewrite the one record under ``root`` with ``l1_size`` in its header (crc valid)."""
    (record,) = [path for path in root.rglob("*") if path.is_file() and path.stat().st_size > SIZE // 64]
    data = record.read_bytes()
    header = decode_header(data)
    payload = data[header.header_len :]
    forged = encode_header(
        header.key,
        payload,
        l1_size=l1_size,
        serde=header.serde,
        layout=header.layout,
        align=header.header_len,
    )
    assert len(forged) == header.header_len
    record.write_bytes(forged + payload)
    return record


def test_a_record_claiming_more_than_l1_is_a_kept_miss(engine, tmp_path: Path, caplog) -> None:
    root = tmp_path / "l2"
    (forged_key,) = keys_of(1, 1)
    stored_by_a_server_now_closed(engine, root, forged_key)
    record = forge_l1_size(root, 2**62)

    storage = engine([fs_with_zstd(root)])
    resident = keys_of(2, 8)
    store(storage, resident, SIZE)
    assert storage.flush(10)
    with caplog.at_level(logging.WARNING):
        handle = storage.submit_prefetch([forged_key])
        assert storage.wait_prefetch(handle, 10) == 0
    assert all(storage.l1.contains(key) for key in resident), "L1 was emptied for an impossible object"
    stats = storage.adapters[0].stats()
    assert stats.get("record_l1_size_past_capacity", 0) >= 1
    assert stats.get("record_l1_size_impossible", 0) == 0, "no damage: counted apart from it"
    assert "more than L1's" in caplog.text
    assert record.exists(), "a record too large for this L1 may be another server's: kept"
    assert storage.adapters[0].stats().get("corrupt_records_removed", 0) == 0


def test_a_record_written_by_a_server_with_a_larger_l1_is_kept_for_it(engine, tmp_path: Path) -> None:
    root = tmp_path / "l2"
    (key,) = keys_of(4, 1)
    stored_by_a_server_now_closed(engine, root, key)  # by a server with the larger L1

    smaller = engine([fs_with_zstd(root)], l1_gb=(SIZE // 2) / 2**30)  # L1 of half the object
    handle = smaller.submit_prefetch([key])
    assert smaller.wait_prefetch(handle, 10) == 0, "an object larger than L1 is a miss"
    assert smaller.adapters[0].stats().get("record_l1_size_past_capacity", 0) >= 1
    assert smaller.adapters[0].stats().get("record_l1_size_impossible", 0) == 0
    smaller.close()

    again = engine([fs_with_zstd(root)])
    handle = again.submit_prefetch([key])
    assert again.wait_prefetch(handle, 10) == 1, "the larger server's record is still there"


def test_an_empty_object_under_a_compressing_chain_is_loaded_not_removed(engine, tmp_path: Path) -> None:
    # zstd turns 0 bytes into a frame of a few bytes: an L1 size of 0 with a non-empty
    # payload is what an empty object's record holds, not damage.
    root = tmp_path / "l2"
    (empty_key,) = keys_of(3, 1)
    stored_by_a_server_now_closed(engine, root, empty_key, 0)

    storage = engine([fs_with_zstd(root)])
    handle = storage.submit_prefetch([empty_key])
    assert storage.wait_prefetch(handle, 10) == 1, "an empty object stored in L2 is a hit"
    assert storage.adapters[0].stats().get("record_l1_size_impossible", 0) == 0
    assert [path for path in root.rglob("*") if path.is_file() and empty_key.file_stem() in path.name]


def scanned(storage):  # type: ignore[no-untyped-def]
    """``storage`` once its adapter's start-up scan has finished."""
    deadline = time.monotonic() + 10
    while storage.adapters[0].stats().get("scan_running", 0):
        assert time.monotonic() < deadline, "the start-up scan never finished"
        time.sleep(0.01)
    return storage


def test_a_plain_stored_size_past_l1_is_a_kept_miss(engine, tmp_path: Path, caplog) -> None:
    # Under no serde the fs backend reports a key this server accounts as a plain stored
    # size (no header read): an overwrite by a server with a larger L1 is learnt that way.
    root, elsewhere = tmp_path / "l2", tmp_path / "larger"
    (key,) = keys_of(5, 1)
    plain = spec({"type": "fs", "path": str(root)})
    earlier = engine([plain])
    assert store(earlier, [key], SIZE // 4) == [key]
    assert earlier.flush(10)
    earlier.close()
    smaller = engine([plain], l1_gb=(SIZE // 2) / 2**30)  # L1 of half the larger object
    scanned(smaller)
    assert smaller.adapters[0].l1_size_of(key) == SIZE // 4, "accounted by the start-up scan"
    larger = engine([spec({"type": "fs", "path": str(elsewhere)})])  # another process's L1
    assert store(larger, [key], SIZE) == [key]
    assert larger.flush(10)
    larger.close()
    (written,) = [path for path in elsewhere.rglob("*") if path.is_file() and key.file_stem() in path.name]
    overwritten = root / written.relative_to(elsewhere)
    assert overwritten.is_file()
    overwritten.write_bytes(written.read_bytes())  # the larger server's overwrite, shared store

    with caplog.at_level(logging.WARNING):
        handle = smaller.submit_prefetch([key])
        assert smaller.wait_prefetch(handle, 10) == 0, "an object larger than L1 is a miss"
    assert smaller.adapters[0].stats().get("record_l1_size_past_capacity", 0) >= 1
    assert "more than L1's" in caplog.text
    assert overwritten.read_bytes() == written.read_bytes(), "kept for the larger server"
