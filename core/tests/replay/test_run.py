from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lmcache_tiers.client import StaleReadError
from lmcache_tiers.config import ServerConfig, decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.replay import inprocess, run
from lmcache_tiers.replay import server as server_replay
from lmcache_tiers.replay.run import (
    ClientState,
    Payloads,
    ReplayOptions,
    ReplayTotals,
    check_pacing,
    paced,
    percentile,
    status_delta,
)
from lmcache_tiers.replay.trace import Trace, TraceRequest
from lmcache_tiers.storage import StorageManager


def _requests(*stamps: float) -> list[tuple[int, TraceRequest]]:
    return [(index, TraceRequest(stamp, 600, 1, (index,))) for index, stamp in enumerate(stamps)]


def test_time_scale_zero_sends_everything_at_once() -> None:
    requests = _requests(0, 10_000, 20_000)
    assert list(paced(requests, 0.0, origin_ms=0, start=time.monotonic())) == requests


def test_arrivals_are_not_sent_before_they_are_due() -> None:
    requests = _requests(1000, 1060, 1120)
    start = time.monotonic()
    seen = []
    for index, _ in paced(requests, 1.0, origin_ms=1000, start=start):
        seen.append((index, time.monotonic() - start))
    assert [index for index, _ in seen] == [0, 1, 2]
    for (index, elapsed), due in zip(seen, (0.0, 0.06, 0.12), strict=True):
        assert elapsed >= due - 1e-3, f"request {index} sent {due - elapsed:.3f}s early"


def test_payloads_carry_their_block_id() -> None:
    payloads = Payloads(64)
    first, second = payloads.batch([7, 2**63 + 5])
    assert payloads.matches(7, memoryview(first)) and payloads.matches(2**63 + 5, memoryview(second))
    assert not payloads.matches(8, memoryview(first))
    assert not payloads.matches(7, memoryview(np.zeros(32, dtype=np.uint8)))
    with pytest.raises(ValueError):
        Payloads(8)


def test_totals_add_up_across_clients() -> None:
    one, two = ReplayTotals(hit_blocks=3, seconds=2.0), ReplayTotals(hit_blocks=4, seconds=5.0)
    one.lookup_latencies_s.append(0.1)
    two.lookup_latencies_s.append(0.2)
    one.merge(two)
    assert (one.hit_blocks, one.seconds, one.lookup_latencies_s) == (7, 5.0, [0.1, 0.2])


def test_percentiles() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([float(n) for n in range(100)], 0.99) == 98.0  # nearest rank: the 99th of 100


def test_status_delta_counts_only_what_changed() -> None:
    before = {
        "requests": {"l1_hit_chunks": 5, "l2_hit_chunks": 1},
        "eviction": {"l1": {"evicted_keys": 2}},
        "adapters": [{"keys_stored": 10, "keys_loaded": 1, "keys_evicted": 0}],
        "failures": {"l2_store_failed": 3},
    }
    after = {
        "requests": {"l1_hit_chunks": 9, "l2_hit_chunks": 4},
        "eviction": {"l1": {"evicted_keys": 7}},
        "adapters": [{"keys_stored": 15, "keys_loaded": 3, "keys_evicted": 1}],
        "failures": {"l2_store_failed": 3, "l1_write_oom": 2},
    }
    assert status_delta(before, after) == {
        "l1_hit_blocks": 4,
        "l2_hit_blocks": 3,
        "l1_evicted_blocks": 5,
        "l2_stored_blocks": 5,
        "l2_loaded_blocks": 2,
        "l2_evicted_blocks": 1,
        "failures": {"l1_write_oom": 2},
    }


class _FakeClock:
    """time.monotonic/perf_counter/sleep of a clock that moves only when told."""

    def __init__(self, now: float) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


class _FakeClient:
    """Enough of a Client for replay_share: every LOOKUP misses and takes one second."""

    def __init__(self, clock: _FakeClock) -> None:
        self.clock = clock

    def __enter__(self) -> _FakeClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        pass

    def lookup(self, keys: list[ObjectKey]) -> int:
        self.clock.sleep(1.0)
        return 0

    def store(self, keys: list[ObjectKey], buffers: list[Any]) -> int:
        return len(keys)


def test_time_scale_zero_still_starts_at_the_shared_start(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock(100.0)
    monkeypatch.setattr(run, "time", clock)
    requests = _requests(0, 10_000)
    assert list(paced(requests, 0.0, origin_ms=0, start=105.0)) == requests
    assert clock.now == 105.0  # clients spawned one after the other begin together


def test_a_request_stamped_before_the_one_ahead_is_sent_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock(100.0)
    monkeypatch.setattr(run, "time", clock)
    sent = []
    for index, _ in paced(_requests(0, 5000, 1000, -7000, 6000), 1.0, origin_ms=0, start=100.0):
        sent.append((index, clock.now))
    # in the trace's order; the early-stamped ones go right after the one ahead of them
    assert sent == [(0, 100.0), (1, 105.0), (2, 105.0), (3, 105.0), (4, 106.0)]


def _trace(*stamps: float) -> Trace:
    return Trace("t.jsonl", tuple(request for _, request in _requests(*stamps)))


@pytest.mark.parametrize("time_scale", [1e300, 1e10, float("inf"), float("nan")])
def test_a_schedule_no_clock_can_wait_for_is_refused(time_scale: float) -> None:
    with pytest.raises(ConfigError, match="a paced replay must fit in 365 days"):
        check_pacing(_trace(0, 1000), time_scale)


def test_schedules_that_fit_are_accepted() -> None:
    check_pacing(_trace(0, 1000), 1e6)  # a million seconds: long, but a plan
    check_pacing(_trace(0, 2**53), 1e-6)  # the widest timestamps, squeezed
    check_pacing(_trace(5000, 0, -(2**53)), 1e300)  # every later request is already due
    check_pacing(_trace(0, 2**53), 0.0)  # as fast as possible: no schedule at all


def test_an_in_process_replay_refuses_an_absurd_time_scale_before_it_starts() -> None:
    with pytest.raises(ConfigError, match="time scale"):
        inprocess.replay_in_process(
            ServerConfig(l1_size_gb=1 / 64), _trace(0, 1000), ReplayOptions(time_scale=1e300)
        )


def test_an_in_process_block_too_large_for_memory_is_one_clear_error() -> None:
    # an L1 of a few such blocks passes the size checks; the one-block buffer cannot be had
    with pytest.raises(ConfigError, match=r"--block-bytes .*does not fit in memory"):
        inprocess.replay_in_process(
            ServerConfig(l1_size_gb=1 / 64), _trace(0, 1000), ReplayOptions(block_bytes=1 << 50)
        )


def test_a_clients_seconds_run_from_the_shared_start(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _FakeClock(100.0)
    monkeypatch.setattr(run, "time", clock)
    monkeypatch.setattr(server_replay, "time", clock)
    monkeypatch.setattr(server_replay, "Client", lambda *args, **kwargs: _FakeClient(clock))
    # started 5 s ahead of the shared start (as a spawned client is): the wait is not replay time
    totals = server_replay.replay_share(
        "tcp://127.0.0.1:1",
        _requests(0, 0, 0),
        ReplayOptions(block_bytes=64, time_scale=1.0),
        origin_ms=0,
        start=105.0,
    )
    assert (totals.requests, totals.seconds) == (3, 3.0)


class _StaleClient:
    """Looks every block up as a hit, hands out bytes that are not the blocks', and says on
    leaving the retrieve that they changed under the reader (as Client does)."""

    def __init__(self, stale: bool) -> None:
        self.stale = stale

    def lookup(self, keys: list[ObjectKey]) -> int:
        return len(keys)

    @contextlib.contextmanager
    def retrieve(self, keys: list[ObjectKey]) -> Iterator[list[memoryview]]:
        yield [memoryview(bytes(64)) for _ in keys]
        if self.stale:
            raise StaleReadError(keys)


def test_a_stale_retrieve_is_a_failed_request_not_corruption() -> None:
    request = TraceRequest(0, 1500, 1, (1, 2, 3))
    state = ClientState.for_options(ReplayOptions(block_bytes=64))
    with pytest.raises(StaleReadError):
        server_replay._replay_one(_StaleClient(stale=True), request, state)  # type: ignore[arg-type]
    assert (state.totals.corrupt_blocks, state.totals.retrieved_blocks) == (0, 0)
    server_replay._replay_one(_StaleClient(stale=False), request, state)  # type: ignore[arg-type]
    assert (state.totals.corrupt_blocks, state.totals.retrieved_blocks) == (3, 3)


class _OtherSizeClient:
    """Holds every block as a replay with another ``--block-bytes`` stored it: the block's
    own id at both ends, in a block of another size (replay keys do not name the size)."""

    def __init__(self, block_bytes: int) -> None:
        self.payloads = Payloads(block_bytes)

    def lookup(self, keys: list[ObjectKey]) -> int:
        return len(keys)

    @contextlib.contextmanager
    def retrieve(self, keys: list[ObjectKey]) -> Iterator[list[memoryview]]:
        blocks = [int.from_bytes(key.chunk_hash, "big") for key in keys]
        yield [memoryview(row.copy()) for row in self.payloads.batch(blocks)]


def test_a_block_stored_with_another_block_size_is_not_corruption() -> None:
    request = TraceRequest(0, 1500, 1, (1, 2, 3))
    state = ClientState.for_options(ReplayOptions(block_bytes=8192))
    server_replay._replay_one(_OtherSizeClient(4096), request, state)  # type: ignore[arg-type]
    assert (state.totals.corrupt_blocks, state.totals.retrieved_blocks) == (0, 3)
    assert state.totals.retrieved_bytes == 3 * 4096  # what came back, not 3 of our blocks
    # another block's bytes, whatever their size, still are corruption
    assert not state.payloads.matches(4, Payloads(4096).batch([5])[0].data)
    assert not state.payloads.matches(4, bytes(8))  # too short to carry an id at both ends


def test_an_in_process_replay_reads_blocks_larger_than_its_own() -> None:
    # A persistent L2 (an fs directory given again) holds the blocks of an earlier replay
    # with a larger --block-bytes: once a ValueError (traceback) copying one into the
    # scratch buffer of one block of this replay.
    options = ReplayOptions(block_bytes=4096)
    state = ClientState.for_options(options)
    request = TraceRequest(0, 1500, 1, (1, 2, 3))
    scratch = np.zeros(options.block_bytes, dtype=np.uint8).data
    earlier = ClientState.for_options(ReplayOptions(block_bytes=8192))
    with StorageManager(ServerConfig(l1_size_gb=1 / 64), load_registry()) as storage:
        keys = earlier.keyspace.keys(request.hash_ids)
        reserved = storage.reserve_write(keys, [8192] * len(keys))
        for key, data in zip(keys, earlier.payloads.batch(request.hash_ids), strict=True):
            storage.write_object(reserved[key], data.data)
        storage.commit_write(keys)
        inprocess._replay_one(storage, request, state, scratch, 30.0)
        assert storage.l1.stats().read_locks == 0
    assert (state.totals.hit_blocks, state.totals.corrupt_blocks, state.totals.retrieved_bytes) == (
        3,
        0,
        3 * 8192,
    )


def test_an_in_process_lookup_given_up_on_leaves_no_locks_behind() -> None:
    registry = load_registry()
    slow = decode_adapter(registry, {"type": "mock", "max_size_gb": 0.01, "latency_s": 0.3}, 0)
    options = ReplayOptions(block_bytes=4096)
    state = ClientState.for_options(options)
    request = TraceRequest(0, 1500, 1, (1, 2, 3))
    scratch = np.zeros(options.block_bytes, dtype=np.uint8).data
    with StorageManager(ServerConfig(l1_size_gb=1 / 64, l2_adapters=(slow,)), registry) as storage:
        inprocess._replay_one(storage, request, state, scratch, 30.0)  # stores the three blocks
        assert state.totals.stored_blocks == 3
        assert storage.flush(timeout=30)
        assert storage.clear() == 3
        inprocess._replay_one(storage, request, state, scratch, 0.001)  # L2 is slower than that
        assert state.totals.failed_requests == 1
        deadline = time.monotonic() + 30
        # one snapshot: a request moving from the queue into a slot between two reads would
        # be seen in neither
        while (prefetch := storage.status()["prefetch"])["in_flight"] or prefetch["queued"]:
            assert time.monotonic() < deadline, "the prefetch never finished"
            time.sleep(0.02)
        assert storage.l1.stats().read_locks == 0


def test_an_in_process_retrieve_never_drops_a_lock_another_holder_forgot() -> None:
    # A lock TTL of 2 s puts read-lock deadlines on a grid of 31 ms: a lock taken more than
    # a step after another expires at a later deadline.
    lock_ttl_s = 2.0
    step = 3 * lock_ttl_s / 64
    options = ReplayOptions(block_bytes=4096)
    state = ClientState.for_options(options)
    request = TraceRequest(0, 1500, 1, (1, 2, 3))
    scratch = np.zeros(options.block_bytes, dtype=np.uint8).data
    config = ServerConfig(l1_size_gb=1 / 64, l1_lock_ttl_s=lock_ttl_s)
    with StorageManager(config, load_registry()) as storage:
        inprocess._replay_one(storage, request, state, scratch, 30.0)  # stores the three blocks
        keys = state.keyspace.keys(request.hash_ids)
        forgotten = storage.read(keys)  # their holder forgets them (never releases them)
        assert len(forgotten) == 3
        forgotten_deadline = forgotten[0].lock_deadline
        time.sleep(step)
        inprocess._replay_one(storage, request, state, scratch, 30.0)  # hits: locks and releases
        assert state.totals.hit_blocks == 3
        storage.l1.expire_locks(forgotten_deadline)  # the forgotten locks expire
        assert storage.l1.stats().read_locks == 0, "a replay lock lives on in place of a forgotten one"


@pytest.mark.parametrize("lost", ["before_the_copy", "before_the_commit"])
def test_an_in_process_store_that_lost_its_reservation_leaves_the_next_writers_alone(lost: str) -> None:
    # L1 reaps a reservation at its write TTL (a stalled copy); the key may be another
    # writer's by then, whose bytes are not there yet.  The replay must neither commit that
    # reservation (readable garbage) nor abort it, nor end with a traceback.
    options = ReplayOptions(block_bytes=4096)
    state = ClientState.for_options(options)
    request = TraceRequest(0, 1500, 1, (1, 2, 3))
    scratch = np.zeros(options.block_bytes, dtype=np.uint8).data
    key = state.keyspace.keys(request.hash_ids)[1]
    with StorageManager(ServerConfig(l1_size_gb=1 / 64), load_registry()) as storage:
        theirs: dict[ObjectKey, Any] = {}
        write_object = storage.write_object

        def reaped_and_taken(obj: Any) -> None:
            storage.abort_write([obj.key])  # what L1's write TTL does to it
            theirs.update(storage.reserve_write([obj.key], [obj.size]))

        def copy(obj: Any, data: memoryview) -> None:
            if obj.key == key and lost == "before_the_copy":
                reaped_and_taken(obj)
            write_object(obj, data)
            if obj.key == key and lost == "before_the_commit":
                reaped_and_taken(obj)

        storage.write_object = copy  # type: ignore[method-assign]
        inprocess._replay_one(storage, request, state, scratch, 30.0)
        assert state.totals.stored_blocks == 2
        assert storage.l1.get(key) is theirs[key], "the next writer's reservation was taken"
        assert storage.read([key]) == [], "the next writer's reservation is readable before its bytes"
        storage.abort_reserved(theirs)


def test_signals_after_the_first_are_ignored_by_a_python_handler() -> None:
    """Ctrl-C on ``replay --clients N`` printed "OSError: Signal 15 ignored due to race
    condition" tracebacks: a client's SIGTERM from the replay, arriving just as the first
    signal's handler switched both to SIG_IGN, found no Python handler when Python ran it.
    A Python handler that ignores them leaves no such race."""
    seen: dict[int, Any] = {}
    with pytest.raises(KeyboardInterrupt), server_replay.signals_unwind():
        try:
            signal.raise_signal(signal.SIGINT)
        finally:
            seen = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
            signal.raise_signal(signal.SIGTERM)  # ignored: the unwinding goes on
            signal.raise_signal(signal.SIGINT)
    for sig, handler in seen.items():
        assert callable(handler), f"{signal.Signals(sig).name} is left to {handler!r}, not a Python handler"


def test_a_signal_during_a_deferred_step_is_raised_once_the_step_is_whole() -> None:
    steps: list[str] = []
    with pytest.raises(SystemExit) as stopped, server_replay.signals_unwind():
        with server_replay.signals_deferred():
            signal.raise_signal(signal.SIGTERM)
            steps.append("the step ended")
        steps.append("the replay went on")
    assert steps == ["the step ended"] and stopped.value.code == 128 + signal.SIGTERM


def test_a_second_signal_during_a_step_that_may_not_end_stops_it_at_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The start of the client processes, deferring signals, ignored every one after the
    first: a client that never read its share (hung as it started) left a replay neither
    Ctrl-C nor SIGTERM could stop."""
    steps: list[str] = []
    stopped: BaseException | None = None
    try:
        with server_replay.signals_unwind(), server_replay.signals_deferred(second_cuts=True):
            signal.raise_signal(signal.SIGTERM)  # deferred: the step goes on
            steps.append("the step went on")
            signal.raise_signal(signal.SIGINT)  # the user gives up waiting for it
            steps.append("the step went on after the second signal")
    except BaseException as exc:  # SystemExit too: which one came is the point
        stopped = exc
    assert steps == ["the step went on"], "the second signal did not stop the step"
    # as the first signal asked: exit 143, not Ctrl-C's 130
    assert isinstance(stopped, SystemExit) and stopped.code == 128 + signal.SIGTERM, repr(stopped)
    assert "SIGINT came again" in caplog.text, caplog.text


def test_a_second_signal_does_not_cut_a_short_deferred_step() -> None:
    """Reading a client's answer: a second Ctrl-C (an impatient user) would leave half an
    answer on the queue, which the clean-up then reads."""
    steps: list[str] = []
    with pytest.raises(KeyboardInterrupt), server_replay.signals_unwind(), server_replay.signals_deferred():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # ignored
        steps.append("the step ended")
    assert steps == ["the step ended"]


def test_a_client_process_sends_its_answer_whatever_signal_follows_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C reaches the client processes, then the replay stops them with SIGTERM: one
    that had unwound already was back at the default action, which ended it as its answer
    was written -- its figures lost, half a message left for the replay to read."""
    monkeypatch.setattr(server_replay, "replay_share", lambda *args, **kwargs: None)  # share done
    acted_on: list[int] = []

    class Results:
        answers: list[Any] = []

        def put(self, answer: Any) -> None:
            signal.raise_signal(signal.SIGTERM)  # the replay stops its clients just now
            self.answers.append(answer)

    results = Results()
    # stands in for the default action, which would end this process
    previous = {
        sig: signal.signal(sig, lambda signum, frame: acted_on.append(signum))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        server_replay._worker("tcp://127.0.0.1:1", [], ReplayOptions(), 0.0, 0.0, None, None, results)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert acted_on == [], "a signal after the share was acted on before the answer was sent"
    assert [status for status, _ in results.answers] == ["ok"]
