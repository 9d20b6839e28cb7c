"""A client write of a key L1 already holds a reservation of: never an acknowledged write
that silently lands in no tier.

A prefetch's load reservation gives way to the writer (its load may fail: L2's copy
damaged), so the writer's bytes are kept.  Another writer's reservation cannot (its client
may be copying into it): the write skipped behind it is counted as lost, and logged, when
that reservation ends without being committed (aborted, or reaped at the write TTL).
"""

from __future__ import annotations

import logging
import time

import pytest

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l1 import L1Manager

ALIGN = 4096
LOST = "l1_skipped_writes_lost"
TAKEN_OVER = "l1_load_taken_over_by_write"


def _key(index: int) -> ObjectKey:
    return ObjectKey("test-model", 0, index.to_bytes(8, "big"))


def _fill(l1: L1Manager, key: ObjectKey, byte: int) -> None:
    obj = l1.get(key)
    assert obj is not None
    l1.write_object(obj, memoryview(bytes([byte]) * obj.size))


def _read(l1: L1Manager, key: ObjectKey) -> bytes:
    obj = l1.reserve_read([key])[key]
    out = bytearray(obj.size)
    l1.read_object(obj, memoryview(out))
    l1.finish_read([key])
    return bytes(out)


def test_a_write_of_a_key_being_loaded_is_kept_when_the_load_fails() -> None:
    with L1Manager(16 * ALIGN, align=ALIGN) as l1:
        (load,) = l1.reserve_load([_key(1)], [ALIGN], temporary=False).values()
        reserved = l1.reserve_write([_key(1)], [ALIGN])
        assert list(reserved) == [_key(1)], "the client's write was skipped behind a load"
        _fill(l1, _key(1), 7)
        assert l1.finish_write([_key(1)]) == [True]
        # L2's copy turned out damaged: the prefetch frees its reservation.
        l1.abort_load([load])
        assert _read(l1, _key(1)) == bytes([7]) * ALIGN
        assert l1.failures().get(TAKEN_OVER) == 1
        assert LOST not in l1.failures()


def test_a_load_taken_over_by_a_write_is_not_handed_to_its_reader() -> None:
    with L1Manager(16 * ALIGN, align=ALIGN) as l1:
        (load,) = l1.reserve_load([_key(2)], [ALIGN], temporary=False).values()
        l1.reserve_write([_key(2)], [ALIGN])
        # The load succeeded, but the key is the writer's now: the prefetch's hand-off is
        # refused (a miss for its reader) and the extent it loaded into goes back.
        assert l1.finish_load([load]) == [False]
        l1.abort_load([load])
        _fill(l1, _key(2), 9)
        assert l1.finish_write([_key(2)]) == [True]
        assert _read(l1, _key(2)) == bytes([9]) * ALIGN
        assert l1.stats().used_bytes == ALIGN


def test_a_write_skipped_behind_an_aborted_writer_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with L1Manager(16 * ALIGN, align=ALIGN) as l1:
        assert list(l1.reserve_write([_key(3)], [ALIGN])) == [_key(3)]
        # A second engine stores the same prefix at once: told the key is there.
        assert l1.reserve_write([_key(3), _key(3)], [ALIGN, ALIGN]) == {}
        with caplog.at_level(logging.WARNING, logger="lmcache_tiers.l1"):
            l1.abort_write([_key(3)])  # the first writer's client crashed mid-copy
        assert not l1.contains(_key(3))
        assert l1.failures().get(LOST) == 1
        assert any(LOST in record.getMessage() for record in caplog.records)


def test_a_write_skipped_behind_a_reservation_reaped_at_its_ttl_is_counted() -> None:
    with L1Manager(16 * ALIGN, align=ALIGN, write_ttl_s=5.0) as l1:
        l1.reserve_write([_key(4)], [ALIGN])
        assert l1.reserve_write([_key(4)], [ALIGN]) == {}
        assert l1.reserve_write([_key(4)], [ALIGN]) == {}
        l1.expire_locks(time.monotonic() + 10.0)
        assert not l1.contains(_key(4))
        assert l1.failures().get(LOST) == 2


def test_a_write_skipped_behind_a_committed_writer_is_not_lost() -> None:
    with L1Manager(16 * ALIGN, align=ALIGN) as l1:
        l1.reserve_write([_key(5)], [ALIGN])
        assert l1.reserve_write([_key(5)], [ALIGN]) == {}
        _fill(l1, _key(5), 3)
        assert l1.finish_write([_key(5)]) == [True]
        l1.delete([_key(5)])
        assert l1.failures() == {}


def test_a_load_skipped_behind_a_writer_is_no_lost_write() -> None:
    with L1Manager(16 * ALIGN, align=ALIGN) as l1:
        l1.reserve_write([_key(6)], [ALIGN])
        assert l1.reserve_load([_key(6)], [ALIGN], temporary=False) == {}
        l1.abort_write([_key(6)])
        assert l1.failures() == {}
