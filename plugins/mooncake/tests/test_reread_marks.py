"""The names whose record a delete kept (another key's, under this key's name) are marked
so that their next lookup reads the record rather than answer from this server's
accounting -- and never more of them than a fixed number: that lookup may never come, and
each such delete would otherwise stay in memory for good.  The oldest marks are
forgotten and counted; a load still reads and verifies every record's header, so a
forgotten mark costs that key's next lookup a hit its load turns into a miss."""

from __future__ import annotations

from typing import Any

import msgspec
from lmcache_plugin_mooncake.cluster import LocalCluster
from mooncake_helpers import backend_of, config_for, open_adapter

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import KEPT_MARKS_LIMIT
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.threads import wait_until

SIZE = 64
COUNT = KEPT_MARKS_LIMIT + 1


def test_names_deletes_kept_are_marked_within_a_bound_the_oldest_forgotten_and_counted(
    mooncake_pool: LocalCluster, raw: Any
) -> None:
    # One key_prefix extends the other: key "xmodel/..." of the writer and key
    # "model/..." here share a name, so the writer's records are kept by deletes here.
    config = config_for(mooncake_pool)
    writer = open_adapter(config)
    evicting = open_adapter(msgspec.structs.replace(config, key_prefix=config.key_prefix + "x"))
    try:
        wait_until(lambda: not evicting.stats()["scan_running"], "the start-up scan")
        hashes = [number.to_bytes(32, "big") for number in range(COUNT)]
        theirs = [ObjectKey("xmodel", 0, chunk) for chunk in hashes]
        mine = [ObjectKey("model", 0, chunk) for chunk in hashes]
        payload = memoryview(bytes(range(SIZE)))
        assert BlockingAdapterClient(writer).store(theirs, [payload] * COUNT) == [True] * COUNT
        backend = backend_of(evicting)
        assert backend.names.of(mine[0]) == backend_of(writer).names.of(theirs[0]), "the names collide"
        # Deletes that no lookup follows (an eviction's keys pinned meanwhile, a close).
        assert backend.delete_many(mine) == [False] * COUNT
        stats = evicting.stats()
        assert stats["foreign_records"] == COUNT, "each kept and counted by its delete"
        assert len(backend._reread) == KEPT_MARKS_LIMIT, "the marks grew past their bound"
        assert stats["reread_marks_forgotten"] == 1
        # The newest mark is still there: its lookup reads the record, a miss.
        assert backend.contains_many([mine[-1]]) == [None]
        assert not backend._reread.take(backend.names.of(mine[-1])), "the lookup took its mark"
        assert raw.is_exist(backend.names.of(mine[0])) == 1, "the other server's record stays"
    finally:
        evicting.close()
        writer.close()
