"""A process SIGKILLed during a store storm on a dax mapping: after reopening, every hit
returns the stored bytes, every acknowledged store is there and no deleted object is back."""

from __future__ import annotations

from pathlib import Path

import pytest
from dax_crash_writer import crash_config
from dax_helpers import SLOT, client, open_dax, shm_dir
from storm import BATCH, acknowledged_live, expected, object_size, run_and_kill

from lmcache_tiers.testing.l2 import make_keys

WRITER = Path(__file__).with_name("dax_crash_writer.py")


@pytest.mark.parametrize("delay_s", [0.0, 0.7, 1.9])
def test_sigkill_during_store_storm_then_reopen(delay_s: float) -> None:
    with shm_dir() as directory:
        path = str(directory / "dax.img")
        deleted, stored = run_and_kill(WRITER, path, 160, delay_s)
        adapter = open_dax(crash_config(path))
        try:
            print(f"killed after storing {stored} and deleting {deleted}; {adapter.stats()}")
            # The delete after the last one reported may have been under way.
            must_be_gone = make_keys(deleted, start=0)[-512:]
            for start in range(0, len(must_be_gone), 64):
                batch = must_be_gone[start : start + 64]
                assert client(adapter).lookup_and_lock(batch).found == [False] * len(batch), (
                    "a deleted object came back"
                )
            keys = make_keys(stored + BATCH - deleted, start=deleted)
            result = client(adapter).lookup_and_lock(keys)
            indexes = [deleted + i for i, hit in enumerate(result.found) if hit]
            found = [key for key, hit in zip(keys, result.found, strict=True) if hit]
            buffers = [memoryview(bytearray(object_size(i, SLOT))) for i in indexes]
            loaded = client(adapter).load(found, buffers)
            adapter.unlock(found)
            for index, ok, buffer in zip(indexes, loaded, buffers, strict=True):
                assert ok and bytes(buffer) == expected(index, SLOT), (
                    f"object {index} loaded wrong or not at all"
                )
            assert set(acknowledged_live(deleted, stored)) <= set(indexes), "an acknowledged store is missing"
            assert adapter.stats().get("corrupt_records_removed", 0) == 0
        finally:
            adapter.close()
