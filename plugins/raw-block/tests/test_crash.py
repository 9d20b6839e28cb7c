"""A process SIGKILLed in the middle of a store storm leaves nothing a restart serves wrong,
and every store it had acknowledged is found again."""

from __future__ import annotations

from pathlib import Path

import pytest
from rb_crash_writer import LARGEST, crash_config
from rb_helpers import Arena, client, open_raw
from storm import acknowledged_live, expected, object_size, run_and_kill

from lmcache_tiers.testing.l2 import make_keys

WRITER = Path(__file__).with_name("rb_crash_writer.py")


@pytest.mark.parametrize("delay_s", [0.0, 1.3, 2.6])
def test_sigkill_during_store_storm_then_reopen(tmp_path: Path, delay_s: float) -> None:
    path = str(tmp_path / "dev.img")
    deleted, stored = run_and_kill(WRITER, path, 160, delay_s)
    adapter = open_raw(crash_config(path))
    try:
        stats = adapter.stats()
        from_checkpoint = stats.get("recovered_from_checkpoint", 0)
        from_headers = stats.get("recovered_from_headers", 0)
        print(
            f"killed after storing {stored} objects and deleting {deleted}; recovered "
            f"{from_checkpoint} from the checkpoint and {from_headers} from slot headers"
        )
        candidates = stored + 8  # a batch in flight may or may not have landed
        hits = 0
        arena = Arena(8 << 20)
        # Deleted objects may come back (a delete is made durable by the next checkpoint),
        # with their own bytes; below that, every object is checked that is found.
        for start in range(max(0, deleted - 64), candidates, 16):
            keys = make_keys(16, start=start)
            result = client(adapter).lookup_and_lock(keys)
            indexes = [start + i for i, hit in enumerate(result.found) if hit]
            found = [key for key, hit in zip(keys, result.found, strict=True) if hit]
            assert [result.sizes[i - start] for i in indexes] == [object_size(i, LARGEST) for i in indexes]
            buffers = [arena.take(object_size(i, LARGEST)) for i in indexes]
            loaded = client(adapter).load(found, buffers)
            adapter.unlock(found)
            for index, ok, buffer in zip(indexes, loaded, buffers, strict=True):
                assert ok, f"object {index} was found but did not load"
                assert bytes(buffer) == expected(index, LARGEST), f"object {index} loaded wrong bytes"
            hits += len(found)
        live = acknowledged_live(deleted, stored)
        survivors = make_keys(len(live), start=live.start)
        assert client(adapter).lookup_and_lock(survivors).found == [True] * len(survivors), (
            "every acknowledged store not deleted since must survive the kill"
        )
        adapter.unlock(survivors)
        assert hits >= len(survivors)
        assert adapter.stats().get("corrupt_records_removed", 0) == 0
    finally:
        adapter.close()
