"""The pieces under the base classes: task board, pins, accounting, copies, context."""

from __future__ import annotations

import gc
import os
import select

import numpy as np
import pytest

from lmcache_tiers.config import L2AdapterConfig
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.accounting import ByteAccounting, ObjectSize
from lmcache_tiers.l2.buffers import GIL_FREE_COPY_BYTES, copy_into
from lmcache_tiers.l2.context import AdapterContext, buffer_address
from lmcache_tiers.l2.interface import L2Op, LookupResult, layouts_of
from lmcache_tiers.l2.ops import LoadOp
from lmcache_tiers.l2.pins import PinTable
from lmcache_tiers.l2.state import AdapterState
from lmcache_tiers.l2.tasks import TaskBoard
from lmcache_tiers.serde import SerdeContext

A = ObjectKey("m", 0, b"a")
B = ObjectKey("m", 0, b"b")
A_SALTED = ObjectKey("m", 0, b"a", 0, "t")


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def test_board_signals_each_op_on_its_own_fd_and_pop_drains() -> None:
    board = TaskBoard()
    store = board.new_task(L2Op.STORE, 2)
    lookup = board.new_task(L2Op.LOOKUP, 1)
    assert store != lookup
    assert not readable(board.event_fd(L2Op.STORE))
    assert board.complete(store, [True, False])
    assert readable(board.event_fd(L2Op.STORE))
    assert not readable(board.event_fd(L2Op.LOOKUP))
    assert board.pop(L2Op.STORE) == {store: [True, False]}
    assert not readable(board.event_fd(L2Op.STORE))
    assert board.pop(L2Op.STORE) == {}
    assert board.pending_count() == 1


def test_board_failures_and_late_completions() -> None:
    board = TaskBoard()
    lookup = board.new_task(L2Op.LOOKUP, 2)
    load = board.new_task(L2Op.LOAD, 1)
    assert board.fail_all_pending() == 2
    assert board.pop(L2Op.LOOKUP) == {lookup: LookupResult([False, False], [0, 0])}
    assert board.pop(L2Op.LOAD) == {load: [False]}
    assert not board.complete(load, [True]), "a result after failure is refused"
    assert not board.fail(load)
    assert board.pop(L2Op.LOAD) == {}


def test_board_fds_live_until_the_board_is_collected() -> None:
    board = TaskBoard()
    fds = [board.event_fd(op) for op in L2Op]
    for fd in fds:
        os.eventfd_write(fd, MARK)
    assert all(eventfd_count(fd) == MARK for fd in fds)
    del board
    gc.collect()
    # Closed: the number names nothing, or (another thread of the test process opened a
    # descriptor meanwhile, which takes the lowest free number) something without the mark.
    assert [fd for fd in fds if eventfd_count(fd) == MARK] == []


#: a count no other eventfd of the test process holds
MARK = 0x5EED1E


def eventfd_count(fd: int) -> int | None:
    """The count of the eventfd open as ``fd`` (None: nothing open there, or no eventfd)."""
    try:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            fields = dict(line.split(":", 1) for line in info if ":" in line)
    except OSError:
        return None
    count = fields.get("eventfd-count")
    return int(count.strip(), 16) if count is not None else None


def test_pins_count_and_block_deletes() -> None:
    pins = PinTable()
    assert pins.pin([A, A, B]) == [True, True, True]
    assert pins.count(A) == 2
    assert pins.begin_delete([A, B]) == [False, False]
    assert pins.unpin([A, B, B]) == 2, "unpinning an unpinned key is ignored"
    assert pins.begin_delete([A, B, B]) == [False, True, False]
    assert pins.pin([B]) == [False], "a key being deleted cannot be pinned"
    pins.end_delete([B])
    assert pins.pin([B]) == [True]
    assert pins.snapshot() == {A: 1, B: 1}


def test_overlapping_stores_of_one_key_keep_each_ones_size_and_layout() -> None:
    state = AdapterState(AdapterContext(index=0, name="0:t", config=L2AdapterConfig()))
    first, second = (A, 100, "first", 40), (A, 200, "second", 80)
    state.storing_begin([first])
    state.storing_begin([second])
    assert state.storing(A, 40) == (100, "first")
    assert state.storing(A, 80) == (200, "second")
    state.storing_end([second])
    assert state.storing(A, 40) == (100, "first"), "the other store of the key is still in its call"
    state.storing_end([first])
    assert state.storing(A) is None


def test_accounting_total_by_salt_overwrite_and_forget() -> None:
    accounting = ByteAccounting()
    accounting.record(A, ObjectSize(100, 200))
    accounting.record(A_SALTED, ObjectSize(50, 50))
    assert accounting.used_bytes == 150
    assert accounting.by_salt() == {"": 100, "t": 50}
    accounting.record(A, ObjectSize(10, 20))
    assert accounting.used_bytes == 60
    assert not accounting.record_if_absent(A, ObjectSize(999, 999))
    assert accounting.get(A) == ObjectSize(10, 20)
    assert accounting.forget(A_SALTED) == ObjectSize(50, 50)
    assert accounting.forget(A_SALTED) is None
    assert accounting.by_salt() == {"": 10}
    assert len(accounting) == 1


def test_accounting_batches_match_single_calls() -> None:
    accounting = ByteAccounting()
    accounting.record_many(
        [(A, ObjectSize(100, 200)), (A_SALTED, ObjectSize(50, 50)), (A, ObjectSize(10, 20))]
    )
    assert accounting.used_bytes == 60
    assert accounting.by_salt() == {"": 10, "t": 50}
    assert accounting.get_many([A, B, A_SALTED]) == [ObjectSize(10, 20), None, ObjectSize(50, 50)]
    accounting.record_many([])
    assert accounting.get_many([]) == []


@pytest.mark.parametrize(
    "size", [0, 1, GIL_FREE_COPY_BYTES - 1, GIL_FREE_COPY_BYTES, 3 * GIL_FREE_COPY_BYTES + 5]
)
def test_copy_into_copies_every_byte_on_both_paths(size: int) -> None:
    source = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    target = bytearray(size)
    copy_into(memoryview(target), source)
    assert bytes(target) == source


def test_copy_into_ignores_formats_and_refuses_other_lengths() -> None:
    words = memoryview(bytearray(8 * GIL_FREE_COPY_BYTES)).cast("Q")
    source = memoryview(bytes(range(256)) * (GIL_FREE_COPY_BYTES // 32))
    copy_into(words, source)
    assert words.tobytes() == source.tobytes()
    for length in (GIL_FREE_COPY_BYTES - 1, GIL_FREE_COPY_BYTES + 1, 10):
        with pytest.raises(ValueError, match="cannot copy"):
            copy_into(memoryview(bytearray(length)), bytes(length + 1))
    for length in (10, GIL_FREE_COPY_BYTES):
        with pytest.raises(TypeError, match="read-only"):
            copy_into(memoryview(bytes(length)), bytes(length))


def test_context_offsets_inside_the_arena_only() -> None:
    arena = memoryview(bytearray(1 << 16))
    context = AdapterContext(index=0, name="0:x", config=L2AdapterConfig(), l1_buffer=arena)
    assert context.l1_offset(arena[4096:8192]) == 4096
    assert context.l1_offset(arena[0:1]) == 0
    assert context.l1_offset(memoryview(bytearray(10))) is None
    assert context.l1_offset(arena[100:100]) is None
    bare = AdapterContext(index=0, name="0:x", config=L2AdapterConfig())
    assert bare.l1_offset(arena) is None
    readonly = memoryview(bytes(16))
    assert buffer_address(readonly) == np.frombuffer(readonly, dtype=np.uint8).ctypes.data


class _NoteOnDecode:
    """A serde that changes nothing; while decoding, another read of the key's record
    (a lookup of a rewritten one) notes another layout."""

    name = "note-on-decode"

    def __init__(self, state: AdapterState, layout: str) -> None:
        self.state, self.layout = state, layout
        self.seen: list[str] = []

    def encode(self, data: memoryview, context: SerdeContext) -> memoryview:
        return data

    def decode(self, data: memoryview, context: SerdeContext) -> memoryview:
        self.seen.append(context.record_layout)
        self.state.note_layout(context.key, self.layout)
        return data


def test_a_loaded_object_gets_the_layout_its_chain_checked_not_a_later_reads() -> None:
    # An authenticating serde checks the layout the record states; if another read of the
    # key's record noted another one before the load ended, the L1 object must still get
    # the layout checked, not the later one (a record rewritten to another dtype).
    state = AdapterState(AdapterContext(index=0, name="0:t", config=L2AdapterConfig()))
    serde = _NoteOnDecode(state, "float16[4]")
    state.chain.extend([serde])
    state.accounting.add_scanned([(A, ObjectSize(8, 8))])
    target = memoryview(bytearray(8))
    op = LoadOp(state, [A], [target])
    io_keys, buffers = op.prepare()
    assert io_keys == [A]
    buffers[0][:] = b"x" * 8  # the backend reads the record's payload ...
    state.note_layout(A, "bfloat16[4]")  # ... and its header, stating this layout
    result = op.finish([True])
    assert result == [True]
    assert serde.seen == ["bfloat16[4]"]
    assert layouts_of(result) == ["bfloat16[4]"]
