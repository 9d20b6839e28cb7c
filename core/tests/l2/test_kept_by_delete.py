"""KeptByDelete: the kept records deletes counted are remembered for the lookup core makes
next, so it does not count them twice -- and never more of them than a fixed number, as
that lookup may never come (the absence check is skipped for a pinned key, an open
circuit, a close)."""

from __future__ import annotations

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.context import KEPT_MARKS_LIMIT, AdapterContext, BackendContext, KeptByDelete
from lmcache_tiers.l2.record import RecordError, decode_header, encode_header
from lmcache_tiers.l2.state import AdapterState


def key_of(number: int) -> ObjectKey:
    return ObjectKey("llama", 0, number.to_bytes(32, "big"))


def foreign_header(key: ObjectKey) -> bytes:
    """An intact record of another key, found under ``key``'s name."""
    other = ObjectKey("llama", 1, key.chunk_hash)
    return encode_header(other, memoryview(b"payload"))


def header_error(key: ObjectKey, header: bytes) -> RecordError:
    try:
        decode_header(header, expected_key=key)
    except RecordError as exc:
        return exc
    raise AssertionError("the header was read as the key's own")


class Deletes:
    def __init__(self) -> None:
        self.state = AdapterState(AdapterContext(index=0, name="0:test", config=L2AdapterConfig()))
        self.deletes = KeptByDelete(BackendContext(self.state))

    def counter(self, name: str) -> int:
        return self.state.counters.snapshot().get(name, 0)

    def delete_then_lookup(self, key: ObjectKey) -> None:
        header = foreign_header(key)
        assert self.deletes.keeps(key, header)
        assert self.deletes.kept_record(key, header_error(key, header))


def test_the_lookup_after_a_delete_that_kept_a_record_does_not_count_it_again() -> None:
    deletes = Deletes()
    deletes.delete_then_lookup(key_of(1))
    assert deletes.counter("foreign_records") == 1
    assert deletes.counter("kept_delete_marks_forgotten") == 0


def test_marks_no_lookup_asked_for_are_bounded_the_oldest_forgotten_and_counted() -> None:
    deletes = Deletes()
    keys = [key_of(number) for number in range(KEPT_MARKS_LIMIT + 1)]
    for key in keys:
        assert deletes.deletes.keeps(key, foreign_header(key))
    assert deletes.counter("foreign_records") == KEPT_MARKS_LIMIT + 1
    assert deletes.counter("kept_delete_marks_forgotten") == 1
    # The forgotten key's lookup counts its record again (counted twice, never served);
    # the newest key's lookup still does not.
    first, last = keys[0], keys[-1]
    assert deletes.deletes.kept_record(first, header_error(first, foreign_header(first)))
    assert deletes.counter("foreign_records") == KEPT_MARKS_LIMIT + 2
    assert deletes.deletes.kept_record(last, header_error(last, foreign_header(last)))
    assert deletes.counter("foreign_records") == KEPT_MARKS_LIMIT + 2
