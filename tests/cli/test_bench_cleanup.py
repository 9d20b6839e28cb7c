"""``lmcache-tiers bench`` leaves a production server as it found it.

Its stores are L1-only under a salt of its own and are deleted (EVICT) at the end; the
protocol pieces that make this possible (``l1_only`` on stores, EVICT, HELLO features) are
checked here for their meaning and for compatibility with version-1 peers that predate them.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import msgspec
import numpy as np
import pytest
from thirdparty import run_cli, serve_cli, wait_for

from lmcache_tiers.client import Client, ClientError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.server.app import TiersServer
from lmcache_tiers.server.benchmark import run_bench
from lmcache_tiers.testing.server import ServerHarness
from lmcache_tiers.wire import protocol as p


def _production_data(count: int) -> tuple[list[ObjectKey], list[np.ndarray]]:  # type: ignore[type-arg]
    keys = [ObjectKey("prod-model", 0, bytes([index + 1]) * 32) for index in range(count)]
    rng = np.random.default_rng(11)
    return keys, [rng.integers(0, 256, 32768, dtype=np.uint8) for _ in keys]


def test_bench_against_a_server_with_persistent_l2_leaves_nothing(tmp_path: Path) -> None:
    l2_dir = tmp_path / "l2"
    adapter = {
        "type": "nixl_store_dynamic",
        "backend": "POSIX",
        "backend_params": {"file_path": str(l2_dir), "use_direct_io": "false", "max_capacity_gb": "1"},
    }
    server = serve_cli(["--l1-size-gb", "0.25", "--l2-adapter", json.dumps(adapter)], None, tmp_path / "log")
    keys, chunks = _production_data(6)
    try:
        with Client(server.url, timeout=30) as client:
            assert client.store(keys, chunks) == len(keys)
            wait_for(server, lambda: client.status()["adapters"][0]["keys_stored"] == len(keys), "L2 stores")
            files_before = sorted(path.name for path in l2_dir.rglob("*") if path.is_file())

            bench = run_cli(
                [
                    "bench",
                    "--url",
                    server.url,
                    "--chunks",
                    "8",
                    "--chunk-mib",
                    "0.25",
                    "--repeats",
                    "2",
                    "--lookup-requests",
                    "200",
                    "--json",
                ]
            )
            assert bench.returncode == 0, bench.stderr
            figures = json.loads(bench.stdout)
            assert figures["cache_salt"].startswith("bench-")
            assert figures["objects_removed"] == 2 * 2 * 8 + 16  # shm and inline batches, lookup keys
            assert figures["notes"] == []

            status = client.status()
            assert status["adapters"][0]["keys_stored"] == len(keys)  # no bench store reached L2
            assert status["l1"]["objects"] == len(keys)  # the engine's objects are still in L1
            assert sorted(path.name for path in l2_dir.rglob("*") if path.is_file()) == files_before
            assert client.lookup(keys, timeout=30) == len(keys)
            targets = [np.zeros_like(chunk) for chunk in chunks]
            assert client.retrieve_into(keys, targets) == len(keys)
            assert all(np.array_equal(a, b) for a, b in zip(chunks, targets, strict=True))
    finally:
        code = server.stop(signal.SIGINT)
    assert code == 0, server.output()


@pytest.fixture
def in_process_server() -> Iterator[TiersServer]:
    harness = ServerHarness()
    try:
        yield harness.make(adapters=['{"type": "mock", "max_size_gb": 0.0625}'])
    finally:
        harness.close()


def test_l1_only_stores_never_reach_l2_and_evict_leaves_l2_copies(in_process_server: TiersServer) -> None:
    storage = in_process_server.storage
    keys, chunks = _production_data(4)
    scratch = [ObjectKey("scratch", 0, bytes([index + 1]) * 32, 0, "s1") for index in range(3)]
    with (
        Client(in_process_server.endpoint) as client,
        Client(in_process_server.endpoint, shm=False) as inline,
    ):
        assert client.server_features == frozenset(p.FEATURES)
        assert client.store(keys, chunks) == len(keys)
        assert client.store(scratch[:2], chunks[:2], l1_only=True) == 2
        assert inline.store(scratch[2:], chunks[2:3], l1_only=True) == 1
        assert storage.flush(timeout=30)
        assert storage.status()["adapters"][0]["keys_stored"] == len(keys)

        assert client.lookup(scratch[:1]) == 1  # read-locked for this client: EVICT skips it
        assert client.evict(scratch) == 2
        client.release(scratch[:1])
        assert client.evict(scratch) == 1
        assert client.lookup(scratch) == 0  # gone from the server: it was never in L2

        assert client.evict(keys) == len(keys)
        assert client.lookup(keys, timeout=30) == len(keys)  # loaded back from L2
        assert storage.status()["requests"]["l2_hit_chunks"] == len(keys)
        client.release(keys)


def test_bench_refuses_a_server_without_the_features(
    in_process_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(p, "FEATURES", ())  # what a server from before the features answers
    with pytest.raises(RuntimeError, match="the server lacks l1_only_store, evict"):
        run_bench(in_process_server.endpoint, chunks=2, chunk_bytes=4096, repeats=1, lookup_requests=10)
    with Client(in_process_server.endpoint) as client:
        with pytest.raises(ClientError, match="cannot keep stores out of L2"):
            client.store([ObjectKey("m", 0, b"k")], [b"x"], l1_only=True)
        with pytest.raises(ClientError, match="has no EVICT request"):
            client.evict([ObjectKey("m", 0, b"k")])
    assert in_process_server.storage.status()["l1"]["objects"] == 0


def test_new_fields_and_ops_are_compatible_with_older_version_1_peers() -> None:
    key = ObjectKey("m", 0, b"k")
    # A request from an older client (no trailing l1_only) means what it always meant.
    old_commit = msgspec.msgpack.encode([p.Op.STORE_COMMIT, 1, "", [key]])
    assert p.request_decoder.decode(old_commit) == p.StoreCommit(1, "", [key], False)
    old_inline = msgspec.msgpack.encode([p.Op.STORE_INLINE, 1, "", [key]])
    assert p.request_decoder.decode(old_inline) == p.StoreInline(1, "", [key], [], False)
    # A HELLO reply from an older server has no feature list (nor what came after it), and
    # one from a server without shm_dir means the segment is in /dev/shm.
    new_hello = msgspec.msgpack.decode(
        p.encode(p.HelloReply(1, features=list(p.FEATURES), shm_dir="/mnt/huge"))
    )
    fields = ("op", *p.HelloReply.__struct_fields__)
    before_features = msgspec.msgpack.encode(new_hello[: fields.index("features")])
    assert p.reply_decoder.decode(before_features).features == []
    before_shm_dir = p.reply_decoder.decode(msgspec.msgpack.encode(new_hello[: fields.index("shm_dir")]))
    assert isinstance(before_shm_dir, p.HelloReply)
    assert before_shm_dir.features == list(p.FEATURES) and before_shm_dir.shm_dir == ""

    # An older server reading a new request ignores the trailing field (hence the features)...
    class OlderStoreCommit(msgspec.Struct, array_like=True, tag_field="op", tag=p.Op.STORE_COMMIT.value):
        req_id: int
        token: str
        keys: list[ObjectKey]

    older = msgspec.msgpack.decode(p.encode(p.StoreCommit(1, "", [key], True)), type=OlderStoreCommit)
    assert older == OlderStoreCommit(1, "", [key])
    # ...and answers EVICT, an op it does not know, with UNKNOWN_OP.
    assert p.diagnose_undecodable(msgspec.msgpack.encode([99, 5, "", []])) == (5, p.ErrorCode.UNKNOWN_OP)


def test_a_batch_larger_than_the_servers_l1_is_refused_before_anything_is_allocated(
    in_process_server: TiersServer,
) -> None:
    # 64 x 2 MiB = 0.125 GiB against an L1 of 0.0625 GiB
    result = run_cli(["bench", "--url", in_process_server.endpoint, "--chunks", "64", "--chunk-mib", "2"])
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == (
        "error: --chunks 64 x --chunk-mib 2: one batch of 64 chunks of 2 MiB (0.12 GiB) does not fit "
        "the server's L1 (0.06 GiB); lower --chunks or --chunk-mib"
    )
    assert in_process_server.storage.status()["l1"]["objects"] == 0


def test_a_batch_this_machine_cannot_hold_twice_is_refused(
    in_process_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lmcache_tiers.server import benchmark

    monkeypatch.setattr(benchmark, "mem_available", lambda: 12 << 10)  # one batch of 8 KiB fits, two do not
    with pytest.raises(
        benchmark.BenchSizeError, match=r"is held twice in this process, and this machine has"
    ):
        run_bench(in_process_server.endpoint, chunks=2, chunk_bytes=4096, repeats=1, lookup_requests=10)
    assert in_process_server.storage.status()["l1"]["objects"] == 0


def test_every_timed_retrieve_is_checked_against_the_stored_bytes(
    in_process_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An inline RETRIEVE that reports every chunk yet writes none: the buffers still hold
    # the bytes the shared-memory run put there, which must not pass for its own.
    honest_retrieve_into = Client.retrieve_into

    def inline_writes_nothing(self: Client, keys: list[ObjectKey], buffers: list[np.ndarray]) -> int:  # type: ignore[type-arg]
        if self.uses_shm:
            return honest_retrieve_into(self, keys, buffers)
        return len(keys)

    monkeypatch.setattr(Client, "retrieve_into", inline_writes_nothing)
    # One repeat: no earlier store is read back, only the timed retrieve can catch it.
    with pytest.raises(RuntimeError, match="inline RETRIEVE returned different bytes than were stored"):
        run_bench(in_process_server.endpoint, chunks=2, chunk_bytes=4096, repeats=1, lookup_requests=10)
    assert in_process_server.storage.status()["l1"]["objects"] == 0


def _bench_whose_server_is_killed_at_the_lookups(
    tmp_path: Path, then: type[BaseException] | None
) -> tuple[str, BaseException]:
    """A run whose server is SIGKILLed when the lookups begin (with ``then`` raised there
    too: Ctrl-C at that moment); the server's URL and what the run raised."""
    server = serve_cli(["--l1-size-gb", "0.0625", "--no-default-l2"], None, tmp_path / "log")

    def kill_at_the_lookups(label: str) -> None:
        if label == "lookup":
            server.stop(signal.SIGKILL)
            if then is not None:
                raise then

    try:
        run_bench(
            server.url,
            chunks=2,
            chunk_bytes=4096,
            repeats=1,
            inline=False,
            lookup_requests=1000,
            timeout=3,
            step=kill_at_the_lookups,
        )
    except BaseException as failure:
        return server.url, failure
    finally:
        server.stop(signal.SIGKILL)
    raise AssertionError("the run went on without its server")


def test_a_server_dying_mid_run_is_named_with_what_the_run_may_leave(tmp_path: Path) -> None:
    url, failure = _bench_whose_server_is_killed_at_the_lookups(tmp_path, None)
    assert isinstance(failure, (ClientError, RuntimeError)), repr(failure)
    message = str(failure)
    # the cause first (the request after the kill finds no server, or loses it)...
    cause = message.split("; ")[0]
    assert cause in (f"cannot reach the server at {url}",) or cause.startswith(
        f"the connection to {url} was lost"
    ), message
    # ...and what the run could not delete
    assert "the 16 benchmark objects still in L1 could not be deleted" in message, message


def test_a_store_of_an_earlier_repeat_that_kept_other_bytes_fails_the_run(
    in_process_server: TiersServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The first timed store keeps zeros instead of the chunks; the last one (the only
    # one the timed retrieves read) is right. Its throughput is still a figure for wrong bytes.
    honest_store = Client.store
    stores = 0

    def first_store_keeps_zeros(self: Client, keys: list[ObjectKey], buffers: list, **options: object) -> int:  # type: ignore[type-arg]
        nonlocal stores
        stores += 1
        if stores == 1:
            buffers = [np.zeros_like(buffer) for buffer in buffers]
        return honest_store(self, keys, buffers, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(Client, "store", first_store_keeps_zeros)
    with pytest.raises(
        RuntimeError, match="shm STORE 1/2: RETRIEVE returned different bytes than were stored"
    ):
        run_bench(in_process_server.endpoint, chunks=2, chunk_bytes=4096, repeats=2, lookup_requests=10)
    assert in_process_server.storage.status()["l1"]["objects"] == 0


@pytest.mark.parametrize("interrupted_at", ["shm retrieve", "lookup"])
def test_a_run_stopped_by_ctrl_c_deletes_what_it_stored(
    in_process_server: TiersServer, interrupted_at: str
) -> None:
    # A bench stopped by hand on a production server must not leave its batch in L1, nor
    # the lookups' read locks that would keep it from being evicted.
    def interrupt(label: str) -> None:
        if label == interrupted_at:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_bench(
            in_process_server.endpoint,
            chunks=2,
            chunk_bytes=4096,
            repeats=2,
            lookup_requests=10,
            step=interrupt,
        )
    status = in_process_server.storage.status()
    assert status["l1"]["objects"] == 0


def test_a_run_stopped_by_ctrl_c_on_a_dead_server_says_what_it_leaves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The CLI turns Ctrl-C into exit 130 and one line naming the signal, not the run's notes: what
    # the run could not delete must reach the user as a log line (stderr) of its own.
    _url, failure = _bench_whose_server_is_killed_at_the_lookups(tmp_path, KeyboardInterrupt)
    assert isinstance(failure, KeyboardInterrupt), repr(failure)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("the 16 benchmark objects still in L1 could not be deleted" in m for m in warned), warned
