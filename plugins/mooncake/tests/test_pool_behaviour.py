"""What the suite cannot show: a pool other parties write to, objects that vanish,
damaged records, and records of another serde chain -- all against a real master."""

from __future__ import annotations

import signal
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
from closing_in_turn import ClosingInTurn, NotedAsOpened
from lmcache_plugin_mooncake.backend import PARALLEL_MIN_BYTES, MooncakeError
from lmcache_plugin_mooncake.cluster import LocalCluster
from lmcache_plugin_mooncake.headers import HEADER_BYTES, KEYS_PER_LANE
from mooncake_helpers import Xor, backend_of, config_for, eventually, open_adapter

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter
from lmcache_tiers.l2.record import encode_header
from lmcache_tiers.serde import SerdeContext
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.l2 import make_keys, pattern

SIZE = 64 << 10


class Trailer:
    """A size-changing serde: 13 bytes appended on the way out, checked and dropped back."""

    name = "test-trailer"
    TAIL = b"\x5a" * 13

    def encode(self, data: memoryview, context: SerdeContext) -> bytes:
        return bytes(data) + self.TAIL

    def decode(self, data: memoryview, context: SerdeContext) -> bytes:
        if bytes(data[-len(self.TAIL) :]) != self.TAIL:
            raise ValueError("trailer missing")
        return bytes(data[: -len(self.TAIL)])


@pytest.fixture
def adapters(closing: ClosingInTurn, request: pytest.FixtureRequest) -> Iterator[list[BackendAdapter]]:
    """The adapters a test opened on ``mooncake_pool``, closed after it with the next few
    tests' ones."""
    opened: NotedAsOpened[BackendAdapter] = NotedAsOpened(closing)
    yield opened
    closing.done(opened, request.node.nodeid)


def store(adapter: BackendAdapter, keys: list[ObjectKey], size: int = SIZE, seed: int = 0) -> list[bytes]:
    data = [pattern(seed * 1000 + i, size) for i in range(len(keys))]
    assert BlockingAdapterClient(adapter).store(keys, [memoryview(d) for d in data]) == [True] * len(keys)
    return data


def load(adapter: BackendAdapter, keys: list[ObjectKey], sizes: list[int]) -> tuple[list[bool], list[bytes]]:
    buffers = [memoryview(bytearray(size)) for size in sizes]
    ok = BlockingAdapterClient(adapter).load(keys, buffers)
    return ok, [bytes(b) for b in buffers]


@contextmanager
def wrapped_client(backend: Any, wrap: Callable[[Any], Any]) -> Iterator[Any]:
    """Inside the block, every call the backend makes goes to ``wrap(client)`` (made for
    each of its calls, as the client is asked for); yields the client itself."""
    real = backend.connection.store()
    backend.connection.store = lambda: wrap(real)
    try:
        yield real
    finally:
        del backend.connection.store  # the class's method again


def name_of(adapter: BackendAdapter, key: ObjectKey) -> str:
    return backend_of(adapter).names.of(key)


#: key "m..." under a key_prefix + "x" is named as key "xm..." under that key_prefix
THEIRS = ObjectKey("xmodel", 0, b"\x07" * 32)
MINE = ObjectKey("model", 0, b"\x07" * 32)


def colliding_servers(
    pool: LocalCluster, adapters: list[BackendAdapter]
) -> tuple[BackendAdapter, BackendAdapter, str]:
    """Two servers on one pool, the second's key_prefix extending the first's: the first,
    the second (its start-up scan done), and the name both give ``THEIRS`` and ``MINE``."""
    config = config_for(pool)
    first = open_adapter(config)
    adapters.append(first)
    second = open_adapter(msgspec.structs.replace(config, key_prefix=config.key_prefix + "x"))
    adapters.append(second)
    eventually(lambda: not second.stats()["scan_running"], what="the start-up scan")
    name = name_of(first, THEIRS)
    assert name_of(second, MINE) == name, "the names collide"
    return first, second, name


# -- objects vanishing ----------------------------------------------------------------------------


def test_an_object_removed_by_another_client_is_a_miss_and_its_bytes_are_released(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    keys = make_keys(3)
    data = store(adapter, keys)
    assert adapter.used_bytes() == 3 * SIZE
    client = BlockingAdapterClient(adapter)

    assert raw.remove(name_of(adapter, keys[0]), True) == 0
    result = client.lookup_and_lock(keys)
    assert result.found == [False, True, True]
    assert adapter.used_bytes() == 2 * SIZE, "a lookup that finds an accounted key gone releases it"

    # Gone between the lookup and the load: that key fails, nothing else does.
    assert raw.remove(name_of(adapter, keys[1]), True) == 0
    ok, contents = load(adapter, keys[1:], [SIZE, SIZE])
    assert ok == [False, True]
    assert contents[1] == data[2]
    assert adapter.stats()["load_vanished"] == 1
    adapter.unlock(keys[1:])

    # Not deleted by this call, but found gone by the check that follows: released.
    assert adapter.delete([keys[1]]) == [False]
    assert adapter.stats()["objects_vanished"] == 2  # keys[0] by the lookup, keys[1] here
    assert adapter.used_bytes() == SIZE
    assert adapter.delete([keys[1]]) == [False], "a key nobody accounts is simply absent"
    assert adapter.stats()["objects_vanished"] == 2


class _VanishingAfterExistenceQuery:
    """The adapter's client, except that the first existence query of ``name`` is
    followed by its removal (another client or the pool's eviction, between two RPCs)."""

    def __init__(self, store: Any, remover: Any, name: str) -> None:
        self._store, self._remover, self._name = store, remover, name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def batch_is_exist(self, names: list[str]) -> list[int]:
        codes = self._store.batch_is_exist(names)
        if self._name in names and self._remover is not None:
            assert self._remover.remove(self._name, True) == 0
            self._remover = None
        return list(codes)


def test_an_object_gone_between_the_existence_and_replica_queries_is_a_miss_not_a_failure(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """Mooncake's replica query answers {} when none of its names is there any more, as
    when the master does not answer: the vanished key is a miss, the batch's other keys
    hits, and nothing counts as a failure of the pool (the circuit breaker's input)."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    mine, foreign = make_keys(2)
    store(adapter, [mine])
    foreign_name = name_of(adapter, foreign)
    assert raw.put(foreign_name, _record(foreign, pattern(3, SIZE))) == 0  # unknown to the adapter
    backend = backend_of(adapter)
    real = backend.connection.store()
    backend.connection.store = lambda: _VanishingAfterExistenceQuery(real, raw, foreign_name)  # type: ignore[method-assign]

    result = BlockingAdapterClient(adapter).lookup_and_lock([mine, foreign])
    assert result.found == [True, False]
    assert adapter.stats().get("backend_errors", 0) == 0
    assert adapter.stats()["circuit_consecutive_failures"] == 0
    adapter.unlock([mine])


def test_objects_the_pool_evicts_are_misses_and_the_rest_load_intact(own_cluster: LocalCluster) -> None:
    own_cluster.add_segment_host("48MB")
    adapter = open_adapter(config_for(own_cluster))
    try:
        client = BlockingAdapterClient(adapter)
        keys = make_keys(80)
        data = [pattern(i, 1 << 20) for i in range(80)]
        stored: set[int] = set()
        refused = 0
        for start in range(0, 80, 8):  # 80 MiB into a 48 MiB pool: it evicts, or refuses when full
            ok = client.store(keys[start : start + 8], [memoryview(d) for d in data[start : start + 8]])
            stored |= {start + i for i, done in enumerate(ok) if done}
            refused += ok.count(False)
        assert adapter.stats().get("store_no_room", 0) == refused, "every refusal is counted"
        result = client.lookup_and_lock(keys)
        hits = [i for i, found in enumerate(result.found) if found]
        assert 0 < len(hits) < len(stored) + refused, "the pool should have dropped some objects"
        assert set(hits) <= stored
        ok, contents = load(adapter, [keys[i] for i in hits], [1 << 20] * len(hits))
        assert ok == [True] * len(hits)
        assert all(contents[n] == data[i] for n, i in enumerate(hits)), "what is found is intact"
        adapter.unlock([keys[i] for i in hits])
        assert adapter.used_bytes() == len(hits) << 20, "accounting follows what lookups found"
    finally:
        adapter.close()


# -- other writers of the same names ----------------------------------------------------------


def test_two_adapters_share_objects(mooncake_pool: LocalCluster, adapters: list[BackendAdapter]) -> None:
    config = config_for(mooncake_pool)
    first = open_adapter(config, name="0:first")
    second = open_adapter(config, name="0:second")
    adapters += [first, second]
    keys = make_keys(4, salt="tenant-a")
    data = store(first, keys)
    result = BlockingAdapterClient(second).lookup_and_lock(keys)
    assert result.found == [True] * 4 and result.sizes == [SIZE] * 4
    ok, contents = load(second, keys, result.sizes)
    assert ok == [True] * 4 and contents == data
    second.unlock(keys)
    assert second.delete(keys[:2]) == [True, True]
    assert BlockingAdapterClient(first).lookup_and_lock(keys).found == [False, False, True, True]
    first.unlock(keys[2:])


def test_a_store_replaces_what_another_client_put_under_the_name(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    (key,) = make_keys(1)
    assert raw.put(name_of(adapter, key), b"not a record" * 100) == 0
    data = store(adapter, [key])
    assert adapter.stats()["store_replaced"] == 1
    ok, contents = load(adapter, [key], [SIZE])
    assert ok == [True] and contents == data


def test_a_store_over_an_object_being_written_fails_that_key_only(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """Another client reserved the name and has not finished its put: the store neither
    waits for it nor takes the name from it."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    busy, free = make_keys(2)
    assert raw.batch_put_session_start([name_of(adapter, busy)], [HEADER_BYTES + SIZE]) == [0]
    try:
        data = [pattern(i, SIZE) for i in range(2)]
        ok = BlockingAdapterClient(adapter).store([busy, free], [memoryview(d) for d in data])
        assert ok == [False, True]
        assert adapter.stats()["store_failures"] == 1
        ok, contents = load(adapter, [free], [SIZE])
        assert ok == [True] and contents == [data[1]]
    finally:
        raw.batch_put_session_revoke([name_of(adapter, busy)])


class _FailingPutEnd:
    """The adapter's client, except that publishing a put session fails: ``partial``
    publishes the first half of the names and answers "master RPC timed out" for the rest
    (their sessions left open), ``raise`` publishes nothing and raises."""

    def __init__(self, store: Any, mode: str) -> None:
        self._store, self._mode = store, mode

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def batch_put_session_end(self, names: list[str]) -> list[int]:
        if self._mode == "raise":
            raise RuntimeError("publishing failed")
        half = len(names) // 2
        return [*self._store.batch_put_session_end(names[:half]), *[-901] * (len(names) - half)]


def _stored_again(adapter: BackendAdapter, keys: list[ObjectKey]) -> None:
    """The keys can be stored and loaded: no session of the failed put holds a name."""
    data = store(adapter, keys, seed=7)
    ok, contents = load(adapter, keys, [SIZE] * len(keys))
    assert ok == [True] * len(keys) and contents == data


@pytest.mark.parametrize("mode", ["partial", "raise"])
def test_a_put_whose_publishing_fails_leaves_nothing_behind(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], mode: str
) -> None:
    """Allocated and written, then the publishing step fails: no object of the batch is
    visible, no session holds a name (or its pool memory), nothing is accounted."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    keys = make_keys(4)
    names = [name_of(adapter, key) for key in keys]
    backend = backend_of(adapter)
    with wrapped_client(backend, lambda real: _FailingPutEnd(real, mode)):
        ok = BlockingAdapterClient(adapter).store(keys, [memoryview(pattern(i, SIZE)) for i in range(4)])
    assert ok == [False] * 4
    assert raw.batch_is_exist(names) == [0] * 4
    assert BlockingAdapterClient(adapter).lookup_and_lock(keys).found == [False] * 4
    assert adapter.used_bytes() == 0
    _stored_again(adapter, keys)
    assert adapter.stats()["store_withdrawn"] == 4 and adapter.stats().get("withdraw_failures", 0) == 0


class _FailingWriteAndRevoke:
    """The adapter's client, except that the first record of a put is not written whole
    (-800, as a segment host that stopped answering) and giving up its reservation fails:
    ``raise`` raises, ``unanswered`` answers "master RPC failed" (its session left open)."""

    def __init__(self, store: Any, mode: str) -> None:
        self._store, self._mode = store, mode

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def batch_put_from_multi_buffer_ranges(self, names: list[str], *rest: Any) -> list[int]:
        return [-800, *list(self._store.batch_put_from_multi_buffer_ranges(names, *rest))[1:]]

    def batch_put_session_revoke(self, names: list[str]) -> list[int]:
        if self._mode == "raise":
            raise RuntimeError("revoking failed")
        return [-900] * len(names)


@pytest.mark.parametrize("mode", ["raise", "unanswered"])
def test_a_reservation_a_failed_write_cannot_give_up_is_counted_and_logged(
    mooncake_pool: LocalCluster,
    raw: Any,
    adapters: list[BackendAdapter],
    caplog: pytest.LogCaptureFixture,
    mode: str,
) -> None:
    """A record whose write failed has its session revoked; when that fails, the session
    holds the name (refusing every writer) until the master's own timeout: counted as a
    withdrawal that failed, and logged, as one of a failed batch is."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    keys = make_keys(2)
    names = [name_of(adapter, key) for key in keys]
    backend = backend_of(adapter)
    with wrapped_client(backend, lambda real: _FailingWriteAndRevoke(real, mode)) as real:
        ok = BlockingAdapterClient(adapter).store(keys, [memoryview(pattern(i, SIZE)) for i in range(2)])
    try:
        assert ok == [False, True]
        assert adapter.stats()["withdraw_failures"] == 1
        assert "could not be given up" in caplog.text
    finally:
        # (only the client that opened a session can give it up)
        assert real.batch_put_session_revoke([names[0]]) == [0], "the session was left open"
    assert raw.batch_is_exist(names) == [0, 1]


class _FailingReplace:
    """The adapter's client, except that its first remove (replacing an object another
    client put under a name) fails as if the master had not answered."""

    def __init__(self, store: Any) -> None:
        self._store, self._failed = store, False

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def batch_remove(self, names: list[str], force: bool) -> list[int]:
        if not self._failed:
            self._failed = True
            return [-900] * len(names)
        return list(self._store.batch_remove(names, force))


def test_a_batch_that_fails_while_replacing_withdraws_what_it_published(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    taken, fresh = make_keys(2)
    assert raw.put(name_of(adapter, taken), b"not a record" * 100) == 0
    backend = backend_of(adapter)
    with wrapped_client(backend, _FailingReplace):
        ok = BlockingAdapterClient(adapter).store(
            [taken, fresh], [memoryview(pattern(i, SIZE)) for i in range(2)]
        )
    assert ok == [False, False]
    # the fresh key was published before the replacement failed: withdrawn with the batch
    assert raw.batch_is_exist([name_of(adapter, fresh)]) == [0]
    assert BlockingAdapterClient(adapter).lookup_and_lock([fresh]).found == [False]
    assert adapter.used_bytes() == 0
    _stored_again(adapter, [taken, fresh])
    assert adapter.stats()["store_withdrawn"] == 1


def test_an_object_another_writer_replaced_with_another_size_is_sized_again(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """A lookup of a key core accounts asks the master about existence only and takes
    the size from core; when another writer replaced the object with one of another
    size, the load is a miss (never other bytes) and the next lookup sizes it again."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    (key,) = make_keys(1)
    store(adapter, [key])
    bigger = pattern(9, 2 * SIZE)
    name = name_of(adapter, key)
    assert raw.remove(name, True) == 0 and raw.put(name, _record(key, bigger)) == 0
    client = BlockingAdapterClient(adapter)

    assert client.lookup_and_lock([key]).sizes == [SIZE], "core's size, no replica query"
    ok, _ = load(adapter, [key], [SIZE])
    adapter.unlock([key])
    assert ok == [False] and adapter.stats()["load_failures"] == 1

    assert client.lookup_and_lock([key]).sizes == [2 * SIZE], "sized by the master this time"
    ok, contents = load(adapter, [key], [2 * SIZE])
    adapter.unlock([key])
    assert ok == [True] and contents == [bigger]
    assert adapter.used_bytes() == 2 * SIZE


def test_batches_larger_than_a_lane_round_trip(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    config = config_for(mooncake_pool)
    first = open_adapter(config, serde=(Xor(),))
    keys = make_keys(2 * KEYS_PER_LANE + 7)
    data = store(first, keys, size=4096)
    first.close()
    reopened = open_adapter(config, serde=(Xor(),))
    adapters.append(reopened)
    result = BlockingAdapterClient(reopened).lookup_and_lock(keys)
    assert result.found == [True] * len(keys), "sizes read from the headers, a lane at a time"
    assert result.sizes == [4096] * len(keys)
    ok, contents = load(reopened, keys, result.sizes)
    assert ok == [True] * len(keys) and contents == data
    reopened.unlock(keys)


def test_a_header_read_that_fails_is_a_counted_and_logged_miss(
    own_cluster: LocalCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A key the adapter does not know, with a serde chain configured, is sized from its
    record header; when that read fails (the segment host holding the object hangs), the
    key is a miss, counted and explained in the log."""
    host = own_cluster.add_segment_host("64MB")
    config = config_for(own_cluster, operation_timeout_s=1.0, master_metrics_url=None)
    writer = open_adapter(config, serde=(Xor(),))
    keys = make_keys(1)
    try:
        store(writer, keys)
    finally:
        writer.close()
    reader = open_adapter(config, serde=(Xor(),))
    host.send_signal(signal.SIGSTOP)
    try:
        result = BlockingAdapterClient(reader, timeout=60).lookup_and_lock(keys)
    finally:
        host.send_signal(signal.SIGCONT)
        reader.close()
    assert result.found == [False]
    assert reader.stats()["header_read_failures"] == 1
    assert "reading the record header of" in caplog.text


def test_an_object_replaced_between_its_size_query_and_header_read_is_not_removed(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key sized from its header (a chain configured, the key unknown): when another
    writer replaces the object with one of another size between the replica query and
    the header read, the header disagrees with the size queried -- a replacement, not
    damage: the other writer's valid object must stay in the pool."""
    config = config_for(mooncake_pool)
    writer = open_adapter(config, serde=(Xor(),))
    (key,) = make_keys(1)
    try:
        store(writer, [key])
    finally:
        writer.close()
    reader = open_adapter(config, serde=(Xor(),))
    adapters.append(reader)
    backend = backend_of(reader)
    name = backend.names.of(key)
    bigger = pattern(9, 2 * SIZE)
    sized = backend._record_sizes
    replaced: list[str] = []

    def sized_then_replaced(store: Any, names: list[str]) -> dict[str, int]:
        sizes = sized(store, names)
        if name in names and not replaced:
            replaced.append(name)
            assert raw.remove(name, True) == 0
            assert raw.put(name, _record(key, bigger, serde=("test-xor",))) == 0
        return sizes

    monkeypatch.setattr(backend, "_record_sizes", sized_then_replaced)
    result = BlockingAdapterClient(reader).lookup_and_lock([key])
    if result.found == [True]:
        reader.unlock([key])
    monkeypatch.setattr(backend, "_record_sizes", sized)
    assert raw.is_exist(name) == 1, "the replacing writer's object was removed as damage"
    assert reader.stats().get("corrupt_records_removed", 0) == 0
    result = BlockingAdapterClient(reader).lookup_and_lock([key])
    assert result.sizes == [2 * SIZE]
    ok, contents = load(reader, [key], [2 * SIZE])
    reader.unlock([key])
    assert ok == [True] and contents == [bytes(byte ^ 0x5A for byte in bigger)], "as Xor decodes it"


# -- damaged and foreign records ----------------------------------------------------------------


def _record(key: ObjectKey, payload: bytes, serde: tuple[str, ...] = ()) -> bytes:
    return encode_header(key, payload, serde=serde, align=HEADER_BYTES) + payload


def _make_newer_format(record: bytearray) -> None:
    """Turn ``record`` into an intact one of format version 99 (its header crc taken again,
    as the newer server writing it takes it: without, it is damage)."""
    record[4:6] = (99).to_bytes(2, "little")
    crc_at = HEADER_BYTES - 4
    record[crc_at:HEADER_BYTES] = zlib.crc32(bytes(record[:crc_at])).to_bytes(4, "little")


@pytest.mark.parametrize(
    "damage",
    ["garbage", "flipped_payload_byte", "header_length_not_fixed"],
)
def test_a_record_that_does_not_verify_is_a_miss_and_is_removed(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], damage: str
) -> None:
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    (key,) = make_keys(1)
    name = name_of(adapter, key)
    payload = pattern(7, SIZE)
    record = {
        "garbage": pattern(8, HEADER_BYTES + SIZE),
        "flipped_payload_byte": bytearray(_record(key, payload)),
        "header_length_not_fixed": encode_header(key, payload, align=2 * HEADER_BYTES)[:HEADER_BYTES]
        + payload,
    }[damage]
    if isinstance(record, bytearray):
        record[HEADER_BYTES + 1000] ^= 0x01
    assert raw.put(name, bytes(record)) == 0

    # A lookup of a key the adapter does not know reads its header: a damaged header is
    # found there already, a damaged payload only by the load.
    result = BlockingAdapterClient(adapter).lookup_and_lock([key])
    assert result.found == [damage == "flipped_payload_byte"]
    if damage == "flipped_payload_byte":
        assert result.sizes == [SIZE]
        ok, _ = load(adapter, [key], [SIZE])
        adapter.unlock([key])
        assert ok == [False]
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert raw.is_exist(name) == 0, "the damaged object was removed from the pool"
    # Its bytes released as it was removed, not found gone by the next lookup (and taken
    # for a removal behind the adapter's back).
    assert adapter.used_bytes() == 0
    assert BlockingAdapterClient(adapter).lookup_and_lock([key]).found == [False]
    assert adapter.stats().get("objects_vanished", 0) == 0
    # The load's own checks, without a lookup first.
    assert raw.put(name, bytes(record)) == 0
    assert load(adapter, [key], [SIZE])[0] == [False]
    assert adapter.stats()["corrupt_records_removed"] == 2
    assert raw.is_exist(name) == 0, "the damaged object was removed from the pool"


class _ReplacedAfterRead:
    """The adapter's client, except that right after the first read of ``name`` (``read``:
    a load's scatter read or a lookup's header read) another writer replaces the object
    with ``record`` -- between the read that judges the object and its removal."""

    def __init__(self, store: Any, writer: Any, name: str, record: bytes, read: str) -> None:
        self._store, self._writer, self._name, self._record = store, writer, name, record
        self._read = read

    def __getattr__(self, attribute: str) -> Any:
        real = getattr(self._store, attribute)
        if attribute != self._read:
            return real

        def read_then_replace(*args: Any) -> Any:
            result = real(*args)
            # the names are the first argument of a scatter read, the second of a ranged one
            if self._writer is not None and self._name in str(args[:2]):
                assert self._writer.remove(self._name, True) == 0
                assert self._writer.put(self._name, self._record) == 0
                self._writer = None
            return result

        return read_then_replace


@pytest.mark.parametrize(
    ("read", "damage"),
    [("batch_get_into_multi_buffers", "flipped_payload_byte"), ("get_into_ranges", "garbage")],
)
def test_a_damaged_record_replaced_after_it_was_read_is_not_removed(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], read: str, damage: str
) -> None:
    """Mooncake has no conditional remove: a record judged damaged by a load (its payload)
    or a lookup (its header) may have been replaced by another writer's valid record
    before the removal.  That writer's acknowledged object must stay; the read is a miss,
    counted."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    (key,) = make_keys(1)
    name = name_of(adapter, key)
    payload = pattern(7, SIZE)
    good = _record(key, payload)
    damaged = bytearray(good) if damage == "flipped_payload_byte" else bytearray(pattern(8, len(good)))
    damaged[HEADER_BYTES + 1000] ^= 0x01
    assert raw.put(name, bytes(damaged)) == 0
    backend = backend_of(adapter)
    with wrapped_client(backend, lambda real: _ReplacedAfterRead(real, raw, name, good, read)):
        if read == "get_into_ranges":  # a key the adapter does not know: its header is read
            assert BlockingAdapterClient(adapter).lookup_and_lock([key]).found == [False]
        else:
            assert load(adapter, [key], [SIZE])[0] == [False]
    assert raw.is_exist(name) == 1, "the other writer's record was removed as the damage read before"
    stats = adapter.stats()
    assert stats["corrupt_reads_replaced"] == 1
    assert stats.get("corrupt_records_removed", 0) == 0
    result = BlockingAdapterClient(adapter).lookup_and_lock([key])
    assert result.found == [True]
    assert load(adapter, [key], result.sizes) == ([True], [payload])
    adapter.unlock([key])


class _ReadsCounted:
    """The adapter's client, recording the size of every whole-object read (``get_into``)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.whole_reads: list[int] = []

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def get_into(self, name: str, address: int, size: int) -> int:
        self.whole_reads.append(size)
        return int(self._store.get_into(name, address, size))


@pytest.mark.parametrize("damage", ["garbage", "header_length_not_fixed", "longer_than_its_header_says"])
def test_a_damaged_header_is_judged_again_without_reading_the_payload(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], damage: str
) -> None:
    """A lookup that finds a damaged header (on the request path) makes sure the object
    still holds it before removing it: its size and header tell, and the payload -- of
    any size -- is not transferred again for it."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    (key,) = make_keys(1)
    name = name_of(adapter, key)
    payload = pattern(7, 4 * SIZE)
    record = {
        "garbage": pattern(8, HEADER_BYTES + len(payload)),
        "header_length_not_fixed": encode_header(key, payload, align=2 * HEADER_BYTES)[:HEADER_BYTES]
        + payload,
        # an intact header, judged once the lane it was read into is given back
        "longer_than_its_header_says": _record(key, payload) + pattern(9, SIZE),
    }[damage]
    assert raw.put(name, bytes(record)) == 0
    backend = backend_of(adapter)
    counted = _ReadsCounted(backend.connection.store())
    with wrapped_client(backend, lambda _real: counted):
        assert BlockingAdapterClient(adapter).lookup_and_lock([key]).found == [False]
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert raw.is_exist(name) == 0, "the damaged object was removed from the pool"
    assert all(size <= HEADER_BYTES for size in counted.whole_reads), counted.whole_reads


def test_a_record_of_another_key_under_a_colliding_name_is_a_miss_that_is_kept(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    """Two servers on one pool, one key_prefix extending the other: the name of key
    "m..." under prefix + "x" is the name of key "xm..." under prefix.  The record there
    is the other server's valid object: a miss for this key (never a hit accounted here,
    where eviction would remove it), and never removed as damage."""
    writer, reader, name = colliding_servers(mooncake_pool, adapters)
    data = store(writer, [THEIRS])

    # A load without a lookup reads the header too.
    assert load(reader, [MINE], [SIZE])[0] == [False]
    assert raw.is_exist(name) == 1, "the other server's object was removed by a load"
    assert BlockingAdapterClient(reader).lookup_and_lock([MINE]).found == [False]
    assert raw.is_exist(name) == 1, "the other server's object was removed by a lookup"
    assert reader.used_bytes() == 0, "the other server's object is not accounted here"
    stats = reader.stats()
    assert stats.get("corrupt_records_removed", 0) == 0
    assert stats["foreign_records"] == 2
    assert "a miss, kept" in caplog.text
    result = BlockingAdapterClient(writer).lookup_and_lock([THEIRS])
    assert load(writer, [THEIRS], result.sizes) == ([True], data)
    writer.unlock([THEIRS])


def test_a_record_of_an_unknown_format_version_is_a_miss_that_is_kept(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """A newer server sharing the pool may write a format this one does not read: its
    records are misses here, never removed as damage (the newer server reads them)."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    (key,) = make_keys(1)
    name = name_of(adapter, key)
    record = bytearray(_record(key, pattern(7, SIZE)))
    _make_newer_format(record)  # a format a newer server might write
    assert raw.put(name, bytes(record)) == 0

    assert load(adapter, [key], [SIZE])[0] == [False]
    assert raw.is_exist(name) == 1, "removed by a load"
    result = BlockingAdapterClient(adapter).lookup_and_lock([key])
    if result.found == [True]:
        adapter.unlock([key])
    assert raw.is_exist(name) == 1, "removed by a lookup"
    stats = adapter.stats()
    assert stats.get("corrupt_records_removed", 0) == 0
    assert stats["record_version_unknown"] >= 1


class _HeaderReadsNoted:
    """The adapter's client, noting in ``read`` the names whose record header (a ranged
    read) it reads."""

    def __init__(self, store: Any, read: list[str]) -> None:
        self._store, self._read = store, read

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def get_into_ranges(self, *args: Any) -> Any:
        self._read.extend(args[1][0])  # the names read into the first (only) buffer
        return self._store.get_into_ranges(*args)


@pytest.mark.parametrize("serde", [(), (Xor(),)], ids=["no_chain", "chain"])
def test_an_accounted_key_whose_record_a_load_found_not_its_own_is_a_miss_next(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], serde: tuple[Any, ...]
) -> None:
    """A key this server stored is answered from core's accounting by a lookup (no header
    read).  When another writer replaced its object with a record this server keeps but
    cannot read (a newer format here; another key's is the same), the load that finds it
    is a miss -- and the next lookup must be one too, releasing the accounted bytes,
    instead of a hit that every load then fails."""
    adapter = open_adapter(config_for(mooncake_pool), serde=serde)
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    (key,) = make_keys(1)
    store(adapter, [key])
    name = name_of(adapter, key)
    record = bytearray(_record(key, pattern(7, SIZE), serde=tuple(s.name for s in serde)))
    _make_newer_format(record)
    assert raw.remove(name, True) == 0 and raw.put(name, bytes(record)) == 0

    result = BlockingAdapterClient(adapter).lookup_and_lock([key])
    assert result.found == [True], "answered from core's accounting"
    ok, _ = load(adapter, [key], result.sizes)
    adapter.unlock([key])
    assert ok == [False]
    result = BlockingAdapterClient(adapter).lookup_and_lock([key])
    if result.found == [True]:
        adapter.unlock([key])
    assert result.found == [False], "a hit no load can serve"
    assert adapter.used_bytes() == 0, "the bytes of a record not this server's stay accounted"
    assert raw.is_exist(name) == 1, "the newer server's record was removed"
    assert adapter.stats().get("corrupt_records_removed", 0) == 0
    # Stored again through this server, the key is its own once more: a lookup answers it
    # as it answers every key it stored, reading no header.
    store(adapter, [key])
    backend = backend_of(adapter)
    read: list[str] = []
    with wrapped_client(backend, lambda real: _HeaderReadsNoted(real, read)):
        result = BlockingAdapterClient(adapter).lookup_and_lock([key])
    adapter.unlock([key])
    assert result.found == [True]
    assert read == [], "the header of a key this server stored was read to look it up"


def test_damage_in_a_batch_verified_on_several_threads_is_a_miss_and_is_removed(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """A batch large enough has its headers computed and its records verified on the
    calling thread and helper threads, each taking every other key: records damaged in
    either part are misses and removed, every other key loads its own bytes."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    size = PARALLEL_MIN_BYTES // 4
    keys = make_keys(8)  # twice PARALLEL_MIN_BYTES: split whatever the number of cores
    data = store(adapter, keys, size=size)
    damaged = [2, 5]
    for index in damaged:
        name = name_of(adapter, keys[index])
        record = bytearray(_record(keys[index], data[index]))
        record[HEADER_BYTES + size // 2] ^= 0x10
        assert raw.remove(name, True) == 0 and raw.put(name, bytes(record)) == 0

    result = BlockingAdapterClient(adapter).lookup_and_lock(keys)
    assert result.found == [True] * len(keys)
    ok, contents = load(adapter, keys, result.sizes)
    adapter.unlock(keys)
    assert ok == [index not in damaged for index in range(len(keys))]
    assert [contents[i] for i in range(len(keys)) if ok[i]] == [data[i] for i in range(len(keys)) if ok[i]]
    assert adapter.stats()["corrupt_records_removed"] == len(damaged)
    assert [raw.is_exist(name_of(adapter, keys[i])) for i in damaged] == [0] * len(damaged)


def test_an_object_shorter_than_a_header_is_a_miss_and_is_removed(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    (key,) = make_keys(1)
    assert raw.put(name_of(adapter, key), b"short") == 0
    assert BlockingAdapterClient(adapter).lookup_and_lock([key]).found == [False]
    assert adapter.stats()["corrupt_records_removed"] == 1
    assert raw.is_exist(name_of(adapter, key)) == 0


def test_a_record_of_another_serde_chain_is_a_miss_and_is_kept(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    config = config_for(mooncake_pool)
    writer = open_adapter(config, serde=(Xor(),))
    adapters.append(writer)
    keys = make_keys(2)
    store(writer, keys)
    for reader_serde in [(), (Trailer(),)]:
        reader = open_adapter(config, serde=reader_serde)
        adapters.append(reader)
        result = BlockingAdapterClient(reader).lookup_and_lock(keys)
        if any(result.found):  # no chain: found by size, refused when its header is read
            ok, _ = load(reader, keys, result.sizes)
            reader.unlock(keys)
            assert ok == [False, False]
        assert reader.stats()["serde_chain_mismatch"] >= 1
        assert reader.stats().get("corrupt_records_removed", 0) == 0
    assert [raw.is_exist(name_of(writer, key)) for key in keys] == [1, 1], "records of another chain are kept"


def test_a_size_changing_chain_recovers_l1_sizes_from_the_headers(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    config = config_for(mooncake_pool)
    first = open_adapter(config, serde=(Trailer(),))
    keys = make_keys(3)
    data = store(first, keys)
    assert first.used_bytes() == 3 * (SIZE + 13)
    first.close()
    second = open_adapter(config, serde=(Trailer(),))
    adapters.append(second)
    eventually(lambda: not second.stats()["scan_running"], what="the start-up scan")
    assert second.used_bytes() == 3 * (SIZE + 13), "the listing accounts stored bytes"
    assert second.l1_size_of(keys[0]) is None
    result = BlockingAdapterClient(second).lookup_and_lock(keys)
    assert result.sizes == [SIZE] * 3, "L1 sizes come from the record headers"
    ok, contents = load(second, keys, result.sizes)
    assert ok == [True] * 3 and contents == data
    second.unlock(keys)


def test_keys_with_digest_names_are_skipped_by_the_listing_and_found_by_lookups(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    config = config_for(mooncake_pool)
    first = open_adapter(config)
    long_model = "m" * 250  # its readable name does not fit: the object gets a digest name
    keys = [ObjectKey(long_model, 0, b"\x01" * 32), ObjectKey("short", 0, b"\x02" * 32)]
    data = store(first, keys)
    assert name_of(first, keys[0]).startswith(config.key_prefix + "~")
    first.close()
    second = open_adapter(config)
    adapters.append(second)
    eventually(lambda: not second.stats()["scan_running"], what="the start-up scan")
    assert second.stats()["listing_names_skipped"] == 1
    assert second.used_bytes() == SIZE
    result = BlockingAdapterClient(second).lookup_and_lock(keys)
    assert result.found == [True, True]
    assert second.used_bytes() == 2 * SIZE, "accounted when a lookup found it"
    ok, contents = load(second, keys, result.sizes)
    assert ok == [True, True] and contents == data
    second.unlock(keys)


def test_the_listing_leaves_out_the_objects_of_a_server_with_a_longer_prefix(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    """Another server's key_prefix may extend this one's ("cache" and "cache2"): its
    names are this server's names of other keys.  Their records hold the other server's
    keys: not this cache's objects, never accounted here (nor evicted from here)."""
    config = config_for(mooncake_pool)
    other = open_adapter(msgspec.structs.replace(config, key_prefix=config.key_prefix + "team."))
    adapters.append(other)
    keys = make_keys(2)
    store(other, keys)
    adapter = open_adapter(config)
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    assert adapter.used_bytes() == 0
    assert list(backend_of(adapter).list_keys()) == []


def test_the_listing_leaves_out_and_keeps_records_of_a_newer_format(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """A newer server sharing the pool writes records this one cannot read.  Accounted
    here, they would be evicted from here -- deleting that server's acknowledged objects:
    the listing leaves them out, counts them and keeps them."""
    config = config_for(mooncake_pool)
    first = open_adapter(config)
    mine, theirs = make_keys(2)
    store(first, [mine])
    first.close()
    name = name_of(first, theirs)
    record = bytearray(_record(theirs, pattern(7, SIZE)))
    _make_newer_format(record)  # a format a newer server might write
    assert raw.put(name, bytes(record)) == 0
    adapter = open_adapter(config)
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    assert adapter.used_bytes() == SIZE, "a record this server cannot read is accounted"
    assert [key for key, _size in backend_of(adapter).list_keys()] == [mine]
    stats = adapter.stats()
    assert stats["record_version_unknown"] >= 1
    assert stats.get("corrupt_records_removed", 0) == 0
    assert raw.is_exist(name) == 1, "a newer server's acknowledged write was removed"


class _FailingHeaderReads:
    """The adapter's client, except that every ranged read of record headers fails as a
    transfer from a segment host that stopped answering does (-800)."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self._store, attribute)

    def get_into_ranges(self, buffers: Any, names: list[list[str]], *rest: Any) -> list[list[list[int]]]:
        return [[[-800] for _ in group] for group in names]


def test_a_failed_header_read_of_an_accounted_key_releases_nothing(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    """Listed at start under a serde chain, a key's L1 size is read from its header by its
    first lookup.  When that read fails (the object is still there), the key must not read
    as absent: core would release its accounted bytes as an object removed behind its back."""
    config = config_for(mooncake_pool)
    first = open_adapter(config, serde=(Xor(),))
    keys = make_keys(2)
    store(first, keys)
    first.close()
    second = open_adapter(config, serde=(Xor(),))
    adapters.append(second)
    eventually(lambda: not second.stats()["scan_running"], what="the start-up scan")
    assert second.used_bytes() == 2 * SIZE and second.l1_size_of(keys[0]) is None
    backend = backend_of(second)
    with wrapped_client(backend, _FailingHeaderReads):
        result = BlockingAdapterClient(second).lookup_and_lock(keys)
    if any(result.found):
        second.unlock([key for key, hit in zip(keys, result.found, strict=True) if hit])
    assert result.found == [False, False]
    assert second.stats()["header_read_failures"] == 2
    assert second.stats().get("objects_vanished", 0) == 0, "a failed read taken for a removal"
    assert second.used_bytes() == 2 * SIZE, "the bytes of objects still in the pool were released"
    result = BlockingAdapterClient(second).lookup_and_lock(keys)
    assert result.found == [True, True] and result.sizes == [SIZE, SIZE]
    second.unlock(keys)


class _OneFailingHeaderRead(_FailingHeaderReads):
    """The adapter's client, except that the ranged read of one object's record header
    fails (-800) as a transfer from a segment host that stopped answering does."""

    def __init__(self, store: Any, failing: str) -> None:
        super().__init__(store)
        self._failing = failing

    def get_into_ranges(self, buffers: Any, names: list[list[str]], *rest: Any) -> list[list[list[int]]]:
        codes = self._store.get_into_ranges(buffers, names, *rest)
        return [
            [[-800] if name == self._failing else code for name, code in zip(group, group_codes, strict=True)]
            for group, group_codes in zip(names, codes, strict=True)
        ]


def _lookup_with_one_header_unreadable(
    adapter: BackendAdapter, keys: list[ObjectKey], data: list[bytes]
) -> None:
    """Look ``keys`` up with the record header of the second unreadable (its segment not
    answering), then load the hits: the others are hits with their own bytes."""
    failing = name_of(adapter, keys[1])
    with wrapped_client(backend_of(adapter), lambda real: _OneFailingHeaderRead(real, failing)):
        result = BlockingAdapterClient(adapter).lookup_and_lock(keys)
    hits = [key for key, hit in zip(keys, result.found, strict=True) if hit]
    ok: list[bool] = []
    contents: list[bytes] = []
    if hits:
        ok, contents = load(adapter, hits, [SIZE] * len(hits))
        adapter.unlock(hits)
    assert result.found == [True, False, True], "one unreadable header failed the whole lookup"
    assert ok == [True, True] and contents == [data[0], data[2]]


def test_a_failed_header_read_misses_only_its_key(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    """Under a serde chain, a header read that fails (one object on a segment host that
    stopped answering) is a miss of that key alone: the other keys of the lookup are
    hits, and the failing key's accounted bytes stay."""
    config = config_for(mooncake_pool)
    first = open_adapter(config, serde=(Xor(),))
    keys = make_keys(3)
    data = store(first, keys)
    first.close()
    second = open_adapter(config, serde=(Xor(),))
    adapters.append(second)
    eventually(lambda: not second.stats()["scan_running"], what="the start-up scan")
    assert second.used_bytes() == 3 * SIZE
    _lookup_with_one_header_unreadable(second, keys, data)
    assert second.stats()["header_read_failures"] == 1
    assert second.stats()["lookup_size_unknown"] == 1, "core's miss of a size-only answer"
    assert second.stats().get("objects_vanished", 0) == 0, "a failed read taken for a removal"
    assert second.used_bytes() == 3 * SIZE, "the bytes of an object still in the pool were released"
    result = BlockingAdapterClient(second).lookup_and_lock(keys)
    assert result.found == [True, True, True]
    second.unlock(keys)


def test_an_unreadable_header_of_a_key_another_server_stored_misses_only_that_key(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    """Without a serde chain, a key this server does not account (another server stored it
    after this one listed the pool) is sized from its record header.  When that read fails
    -- the object sits in the segment of a server that was killed, until the master drops
    the segment -- the key is a miss of its own: the lookup's other keys are hits, and no
    failed call is counted against the pool (repeated, such failures opened the circuit,
    every lookup a miss, while the master answered throughout)."""
    config = config_for(mooncake_pool, master_metrics_url=None)
    first = open_adapter(config)
    keys = make_keys(3)
    data = store(first, keys)
    first.close()
    second = open_adapter(config)
    adapters.append(second)
    assert second.used_bytes() == 0 and second.l1_size_of(keys[1]) is None
    _lookup_with_one_header_unreadable(second, keys, data)
    stats = second.stats()
    assert stats["header_read_failures"] == 1
    assert stats.get("backend_errors", 0) == 0, "a segment's failed read counted against the pool"
    assert stats.get("objects_vanished", 0) == 0
    assert second.used_bytes() == 2 * SIZE, "only the two hits are accounted"
    result = BlockingAdapterClient(second).lookup_and_lock(keys)
    assert result.found == [True, True, True], "the object whose header failed was left alone"
    second.unlock(keys)


def test_the_listing_logs_the_names_it_cannot_read_as_keys(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    # key_prefix changed to a parent of the one the objects were stored under: their names
    # read "x/<name>" under it, no key's.  Skipped and left alone, and the log says so.
    config = config_for(mooncake_pool)
    first = open_adapter(msgspec.structs.replace(config, key_prefix=config.key_prefix + "x/"))
    store(first, make_keys(2))
    first.close()
    adapter = open_adapter(config)
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    assert adapter.used_bytes() == 0
    assert adapter.stats().get("listing_names_skipped", 0) == 2
    assert f"2 names under {config.key_prefix!r} are not readable names of this cache's keys" in caplog.text


def test_the_listing_counts_and_logs_objects_too_short_for_a_record(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter], caplog: pytest.LogCaptureFixture
) -> None:
    config = config_for(mooncake_pool)
    first = open_adapter(config)
    keys = make_keys(2)
    store(first, keys)
    first.close()
    (short,) = make_keys(1, start=50)
    assert raw.put(name_of(first, short), b"short") == 0
    adapter = open_adapter(config)
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    assert adapter.used_bytes() == 2 * SIZE
    assert adapter.stats().get("listing_names_skipped", 0) == 1, "a skipped object nobody counted"
    assert "shorter than a record" in caplog.text


def test_a_delete_leaves_the_record_of_another_key_that_replaced_its_object(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """One key_prefix extends the other, so key "m..." here and key "xm..." of the other
    server share a name.  Once the other server replaced this server's object there, an
    eviction here must not remove that server's acknowledged object."""
    writer, evicting, name = colliding_servers(mooncake_pool, adapters)
    store(evicting, [MINE])
    data = store(writer, [THEIRS], seed=5)
    assert evicting.delete([MINE]) == [False]
    assert raw.is_exist(name) == 1, "the other server's object was deleted"
    assert evicting.used_bytes() == 0, "the key is gone from here: its bytes are released"
    assert evicting.stats()["foreign_records"] == 1, "counted once, by the delete"
    result = BlockingAdapterClient(writer).lookup_and_lock([THEIRS])
    assert load(writer, [THEIRS], result.sizes) == ([True], data)
    writer.unlock([THEIRS])


def test_a_delete_leaves_a_record_of_a_newer_format_and_removes_the_others(
    mooncake_pool: LocalCluster, raw: Any, adapters: list[BackendAdapter]
) -> None:
    """A newer server sharing the pool replaced one object with its own format: it reads
    it, so a delete here keeps it; this server's own record of the other key goes."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    keys = make_keys(2)
    store(adapter, keys)
    names = [name_of(adapter, key) for key in keys]
    record = bytearray(_record(keys[0], pattern(7, SIZE)))
    _make_newer_format(record)  # a format a newer server might write
    assert raw.remove(names[0], True) == 0 and raw.put(names[0], bytes(record)) == 0
    assert adapter.delete(keys) == [False, True]
    assert raw.is_exist(names[0]) == 1 and raw.is_exist(names[1]) == 0
    stats = adapter.stats()
    assert stats["record_version_unknown"] == 1 and stats.get("corrupt_records_removed", 0) == 0
    assert adapter.used_bytes() == 0


class _RaisingHeaderReads(_FailingHeaderReads):
    """The adapter's client, except that every ranged read of record headers raises."""

    def get_into_ranges(self, buffers: Any, names: list[list[str]], *rest: Any) -> list[list[list[int]]]:
        raise RuntimeError("the segment host holding the headers did not answer")


@pytest.mark.parametrize("failing", [_FailingHeaderReads, _RaisingHeaderReads], ids=["per_key", "call"])
def test_the_listing_leaves_out_objects_whose_headers_it_could_not_read(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter], failing: type[_FailingHeaderReads]
) -> None:
    """Only a record's header tells this server's objects from those of a server whose
    key_prefix extends its own.  Unread, an object must not be accounted here (eviction
    would act on it, lookups would report it found): left out, counted and logged; a
    lookup reads its header and accounts it when it is this server's."""
    config = config_for(mooncake_pool)
    other = open_adapter(msgspec.structs.replace(config, key_prefix=config.key_prefix + "team."))
    adapters.append(other)
    store(other, make_keys(2))
    adapter = open_adapter(config)
    adapters.append(adapter)
    eventually(lambda: not adapter.stats()["scan_running"], what="the start-up scan")
    backend = backend_of(adapter)
    with wrapped_client(backend, failing):
        assert list(backend.list_keys()) == []
    assert adapter.stats()["listing_header_read_failures"] == 2


def test_a_load_stops_between_its_calls_once_the_adapter_closes(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    """A load of several lanes' worth of keys is several Mooncake calls: once the adapter
    starts closing, the calls left are not made -- their keys fail, counted -- so a close
    waits for one call at most, not for the whole batch."""
    adapter = open_adapter(config_for(mooncake_pool))
    adapters.append(adapter)
    keys = make_keys(KEYS_PER_LANE + 2)
    data = store(adapter, keys, size=1024)
    backend = backend_of(adapter)
    real, calls = backend._load_chunk, []

    def closing_after_the_first(*args: Any) -> Any:
        calls.append(args)
        backend.context._state.closing.set()  # what the adapter's close sets first
        return real(*args)

    backend._load_chunk = closing_after_the_first  # type: ignore[method-assign]
    buffers = [memoryview(bytearray(1024)) for _ in keys]
    loaded = backend.get_many_into(keys, buffers)
    assert len(calls) == 1, "calls were made after closing began"
    assert loaded == [True] * KEYS_PER_LANE + [False, False]
    assert [bytes(b) for b in buffers[:KEYS_PER_LANE]] == data[:KEYS_PER_LANE]
    assert adapter.stats()["load_skipped_closing"] == 2


def test_a_record_a_delete_kept_is_read_again_after_a_lookup_of_it_failed(
    mooncake_pool: LocalCluster, adapters: list[BackendAdapter]
) -> None:
    """A delete kept another server's record under this key's name, so the key's next
    lookup must read that header (a miss) rather than answer from this server's
    accounting.  When that lookup fails before reading it, the one after must still read
    it: a hit there would serve the other server's object as this key's."""
    writer, evicting, _ = colliding_servers(mooncake_pool, adapters)
    store(evicting, [MINE])
    store(writer, [THEIRS], seed=5)
    backend = backend_of(evicting)
    # The backend alone: core's lookup right after a delete is the one that fails here.
    assert backend.delete_many([MINE]) == [False]
    with wrapped_client(backend, _FailingHeaderReads), pytest.raises(MooncakeError):
        backend.contains_many([MINE])
    assert backend.contains_many([MINE]) == [None], "another server's record was answered as this key's"
