"""Large copies split between the calling thread and a helper: exact, errors reach the
caller, small copies and a stopped copier stay in the calling thread."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.wire import copies
from lmcache_tiers.wire.copies import SPLIT_MIN_BYTES, Piece, SplitCopier

PIECE = 1 << 20


def pieces_of(source: np.ndarray[Any, Any], target: np.ndarray[Any, Any], blocks: bool = True) -> list[Piece]:
    return [
        (target[low : low + PIECE], source[low : low + PIECE], low // PIECE if blocks else -1)
        for low in range(0, source.nbytes, PIECE)
    ]


def copy_on_both_threads(
    copier: SplitCopier, source: np.ndarray[Any, Any], target: np.ndarray[Any, Any]
) -> dict[str, list[int]]:
    """Run one split copy; the blocks each thread prepared, in the order it took them.  The
    calling thread holds back until the helper has taken a piece too."""
    taken: dict[str, list[int]] = {}
    lock = threading.Lock()
    helper_started = threading.Event()

    def prepare(block: int) -> None:
        name = threading.current_thread().name
        with lock:
            taken.setdefault(name, []).append(block)
        if name == "shm-copy":
            helper_started.set()
        else:
            assert helper_started.wait(30)

    copier.run(pieces_of(source, target), prepare)
    return taken


def test_both_threads_copy_and_every_byte_arrives(
    new_threads: Callable[[str], list[threading.Thread]],
) -> None:
    source = np.random.default_rng(3).integers(0, 256, 9 * PIECE + 123, dtype=np.uint8)
    target = np.zeros_like(source)
    copier = SplitCopier()
    taken = copy_on_both_threads(copier, source, target)
    assert np.array_equal(source, target)
    assert sorted(block for blocks in taken.values() for block in blocks) == list(range(10))  # each once
    assert {"shm-copy", threading.current_thread().name} == set(taken)
    copier.stop()
    assert new_threads("shm-copy") == []


def test_the_caller_copies_from_the_front_and_the_helper_from_the_back() -> None:
    # Each thread works through a range of its own: two threads populating neighbouring
    # pieces would share page-table pages (and their lock) all the way through.
    source = np.random.default_rng(5).integers(0, 256, 12 * PIECE, dtype=np.uint8)
    target = np.zeros_like(source)
    copier = SplitCopier()
    taken = copy_on_both_threads(copier, source, target)
    assert np.array_equal(source, target)
    mine, helpers_blocks = taken[threading.current_thread().name], taken["shm-copy"]
    assert mine == list(range(len(mine)))  # a prefix, in order
    assert helpers_blocks == list(range(11, 11 - len(helpers_blocks), -1))  # a suffix, backwards
    assert len(mine) + len(helpers_blocks) == 12
    copier.stop()


def test_start_runs_the_helper_before_the_first_copy_and_not_after_stop(
    new_threads: Callable[[str], list[threading.Thread]],
) -> None:
    copier = SplitCopier()
    copier.start()
    assert len(new_threads("shm-copy")) == 1
    copier.start()  # already running: still one
    assert len(new_threads("shm-copy")) == 1
    copier.stop()
    assert new_threads("shm-copy") == []
    copier.start()
    assert new_threads("shm-copy") == []


def failing_at_block_1(prepared: list[int], lock: threading.Lock) -> Callable[[int], None]:
    """A ``prepare`` noting each block it is asked for in ``prepared``, failing on block 1."""

    def prepare(block: int) -> None:
        with lock:
            prepared.append(block)
        if block == 1:
            raise OSError("population failed")

    return prepare


def test_a_failing_piece_raises_in_the_caller_and_stops_the_rest() -> None:
    source = np.ones(8 * PIECE, dtype=np.uint8)
    target = np.zeros_like(source)
    prepared: list[int] = []
    copier = SplitCopier()
    with pytest.raises(OSError, match="population failed"):
        copier.run(pieces_of(source, target), failing_at_block_1(prepared, threading.Lock()))
    # at most one piece per thread was started after the failing one was taken (before it,
    # the helper may have taken any number from the back while the caller was not running)
    assert 1 in prepared and len(prepared[prepared.index(1) + 1 :]) <= 2
    assert not target[PIECE : 2 * PIECE].any()  # the failed piece was not copied
    # the helper is still there for the next copy
    copier.run(pieces_of(source, target), lambda block: None)
    assert np.array_equal(source, target)
    copier.stop()


def test_a_failing_piece_of_a_small_copy_raises_and_stops_the_rest() -> None:
    source = np.ones(3 * PIECE, dtype=np.uint8)
    target = np.zeros_like(source)
    prepared: list[int] = []
    copier = SplitCopier()
    with pytest.raises(OSError, match="population failed"):
        copier.run(pieces_of(source, target), failing_at_block_1(prepared, threading.Lock()))
    assert prepared == [0, 1]  # in order, and nothing after the failing piece
    assert target[:PIECE].all() and not target[PIECE:].any()
    copier.stop()


def test_small_copies_never_start_the_helper(new_threads: Callable[[str], list[threading.Thread]]) -> None:
    size = SPLIT_MIN_BYTES - PIECE
    source = np.full(size, 5, dtype=np.uint8)
    target = np.zeros_like(source)
    names: set[str] = set()
    copier = SplitCopier()
    copier.run(pieces_of(source, target), lambda block: names.add(threading.current_thread().name))
    assert np.array_equal(source, target)
    assert names == {threading.current_thread().name}
    assert new_threads("shm-copy") == []
    copier.stop()


def test_after_stop_copies_run_in_the_caller(new_threads: Callable[[str], list[threading.Thread]]) -> None:
    source = np.full(SPLIT_MIN_BYTES * 2, 9, dtype=np.uint8)
    target = np.zeros_like(source)
    copier = SplitCopier()
    copier.run(pieces_of(source, target, blocks=False), lambda block: None)
    copier.stop()
    assert new_threads("shm-copy") == []
    target[:] = 0
    names: set[str] = set()
    copier.run(pieces_of(source, target), lambda block: names.add(threading.current_thread().name))
    assert np.array_equal(source, target)
    assert names == {threading.current_thread().name}
    assert new_threads("shm-copy") == []


def test_a_forked_child_copies_with_a_helper_of_its_own() -> None:
    import os

    copier = SplitCopier()
    source = np.full(SPLIT_MIN_BYTES * 2, 3, dtype=np.uint8)
    target = np.zeros_like(source)
    copier.run(pieces_of(source, target, blocks=False), lambda block: None)  # helper started
    child = os.fork()
    if child == 0:  # the helper thread did not survive the fork
        code = 1
        try:
            names: set[str] = set()
            again = np.zeros_like(source)
            copier.run(pieces_of(source, again), lambda block: names.add(threading.current_thread().name))
            code = 0 if np.array_equal(source, again) and not copier._queue.jobs else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert not copier._queue.jobs  # no copy left queued for a helper
    copier.stop()


class _OwnerInACycle:
    """Holds its copier, as a client does, and is reachable only through a cycle once
    dropped: only a collection frees it, in whatever thread that collection runs."""

    def __init__(self) -> None:
        self.copier = SplitCopier(name="collected-copy")
        self.itself = self


def test_a_copier_collected_by_its_own_helper_as_it_goes_to_wait_ends_it() -> None:
    """The copier's finalizer runs in the thread whose allocation started the collection:
    the helper itself, perhaps just as it is about to wait for work.  The stop must reach
    it there too, not be missed and leave it waiting for good."""
    dropped = threading.Event()
    collected_in_helper: list[bool] = []

    def collect_as_the_helper_waits(frame: FrameType, event: str, arg: object) -> None:
        if collected_in_helper or threading.current_thread().name != "collected-copy":
            return
        waits = (event == "call" and frame.f_code.co_name == "wait") or (
            event == "c_call" and getattr(arg, "__name__", "") == "get"
        )
        if waits:
            collected_in_helper.append(True)
            dropped.wait(30)
            gc.collect()

    gc.disable()
    threading.setprofile(collect_as_the_helper_waits)  # type: ignore[arg-type]
    try:
        owner = _OwnerInACycle()
        owner.copier.start()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    try:
        (helper,) = [thread for thread in threading.enumerate() if thread.name == "collected-copy"]
        del owner
        dropped.set()
        helper.join(30)
    finally:
        gc.enable()
    assert collected_in_helper, "the helper never went to wait"
    assert not helper.is_alive(), "the helper missed the stop of its collected copier"


SMALL = 256 << 10  # a store's small chunks: pieces under GROUP_BYTES


class _CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.entered = 0

    def __enter__(self) -> bool:
        self.entered += 1
        return super().__enter__()


def test_small_pieces_are_taken_a_group_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # The job's lock was taken twice per piece: for a store of 256 x 256 KiB, over a
    # thousand lock round trips (contended by the two threads) for 64 MiB.
    conditions: list[_CountingCondition] = []
    real_init = copies._Job.__init__

    def counting_init(job: Any, *args: Any) -> None:
        real_init(job, *args)
        job.settled = _CountingCondition()
        conditions.append(job.settled)

    monkeypatch.setattr(copies._Job, "__init__", counting_init)
    count = 4 * SPLIT_MIN_BYTES // SMALL
    source = np.random.default_rng(7).integers(0, 256, count * SMALL, dtype=np.uint8)
    target = np.zeros_like(source)
    prepared: list[int] = []
    lock = threading.Lock()

    def prepare(block: int) -> None:
        with lock:
            prepared.append(block)

    copier = SplitCopier()
    pieces = [
        (target[low : low + SMALL], source[low : low + SMALL], low // SMALL)
        for low in range(0, source.nbytes, SMALL)
    ]
    copier.run(pieces, prepare)
    copier.stop()
    assert np.array_equal(source, target)
    assert sorted(prepared) == list(range(count))  # each piece once
    (condition,) = conditions
    # Twice per group of 4 pieces (1 MiB) taken, one group more where the threads meet,
    # once per thread finding nothing left and once for the caller's wait: 37 at most for
    # 64 pieces, where a lock per piece taken and per piece done came to over 128.
    assert condition.entered <= 2 * (count // 4 + 1) + 3


def test_a_failing_piece_leaves_the_rest_of_its_group_uncopied() -> None:
    count = 4 * SPLIT_MIN_BYTES // SMALL
    source = np.ones(count * SMALL, dtype=np.uint8)
    target = np.zeros_like(source)
    pieces = [
        (target[low : low + SMALL], source[low : low + SMALL], low // SMALL)
        for low in range(0, source.nbytes, SMALL)
    ]
    copier = SplitCopier()
    with pytest.raises(OSError, match="population failed"):
        copier.run(pieces, failing_at_block_1([], threading.Lock()))
    assert not target[SMALL : 4 * SMALL].any()  # the failed piece and the rest of its group
    copier.stop()
