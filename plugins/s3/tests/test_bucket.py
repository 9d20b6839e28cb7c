"""The bucket as a shared, listed, sometimes absent store: the start-up listing, names the
codec cannot read back, two adapters on one prefix, and what start-up refuses."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import lmcache_plugin_s3.backend as backend_module
import lmcache_plugin_s3.client as client_module
import pytest
from flipping_relay import FlippingRelay
from lmcache_plugin_s3 import S3Config
from s3_helpers import AWS_CREDENTIAL_VARIABLES, BUCKET, Raw, blocking, fresh_prefix, open_adapter, s3_config

from lmcache_tiers.errors import ConfigError
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import BackendAdapter, L2Adapter
from lmcache_tiers.l2.record import RECORD_MAGIC, encode_header
from lmcache_tiers.testing.l2 import make_keys, pattern
from lmcache_tiers.testing.seaweedfs import SeaweedS3, free_port
from lmcache_tiers.testing.threads import DEADLINE_S, joined

SIZE = 32 << 10


def store(adapter: L2Adapter, l1: memoryview, keys: list[ObjectKey], seed: int = 0) -> list[bytes]:
    data = [pattern(seed * 1000 + index, SIZE) for index in range(len(keys))]
    buffers = [l1[index * SIZE : (index + 1) * SIZE] for index in range(len(keys))]
    for buffer, payload in zip(buffers, data, strict=True):
        buffer[:] = payload
    assert blocking(adapter).store(keys, buffers) == [True] * len(keys)
    return data


def load(adapter: L2Adapter, l1: memoryview, keys: list[ObjectKey]) -> list[bytes | None]:
    client = blocking(adapter)
    found = client.lookup_and_lock(keys)
    hits = [key for key, hit in zip(keys, found.found, strict=True) if hit]
    base = 8 << 20
    buffers = [l1[base + index * SIZE : base + (index + 1) * SIZE] for index in range(len(hits))]
    loaded = dict(zip(hits, client.load(hits, buffers), strict=True))
    adapter.unlock(hits)
    contents = dict(zip(hits, (bytes(b) for b in buffers), strict=True))
    return [contents[key] if loaded.get(key) else None for key in keys]


def wait_scanned(adapter: L2Adapter) -> None:
    deadline = time.monotonic() + 60
    while adapter.stats().get("scan_running"):
        assert time.monotonic() < deadline, "the start-up scan never finished"
        time.sleep(0.02)


def test_the_listing_pages_through_the_prefix_and_skips_foreign_objects(
    seaweed: SeaweedS3,
    l1: memoryview,
    opened: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    prefix = fresh_prefix("listing")
    config = s3_config(seaweed, prefix)
    first = open_adapter(config, l1)
    keys = make_keys(10) + make_keys(2, salt="tenant-a")
    store(first, l1, keys)
    first.close()
    raw = Raw(seaweed, prefix)
    raw.write("README.txt", b"not a chunk")
    raw.write(raw.names.of(make_keys(1, start=99)[0]), b"short")  # a valid name, too small for a record
    raw.write("nested/" + raw.names.of(keys[0]).rsplit("/", 1)[1], b"x" * 5000)  # below the prefix
    monkeypatch.setattr(backend_module, "_LIST_PAGE", 3)  # four pages and a bit
    monkeypatch.setattr(backend_module, "_PROGRESS_EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="lmcache_plugin_s3"):
        reopened = open_adapter(config, l1)
        opened.append(reopened)
        wait_scanned(reopened)
    assert set(reopened.iter_keys()) == set(keys)
    assert reopened.used_bytes() == SIZE * len(keys)
    assert reopened.used_bytes_by_salt().get("tenant-a") == 2 * SIZE
    stats = reopened.stats()
    assert stats["scan_keys"] == len(keys) and stats["listing_foreign_objects"] == 2
    assert any("records so far" in record.getMessage() for record in caplog.records), "no progress line"


def test_a_listing_page_truncated_without_a_continuation_token_fails_the_scan(
    seaweed: SeaweedS3,
    l1: memoryview,
    opened: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A service that says "more follows" but not where from: the listing cannot go on,
    # and what it listed is not the whole bucket -- the scan must not end as complete.
    prefix = fresh_prefix("truncated")
    config = s3_config(seaweed, prefix)
    first = open_adapter(config, l1)
    store(first, l1, make_keys(5))
    first.close()
    call = backend_module.S3Client.call

    async def without_token(self: backend_module.S3Client, method: str, **kwargs: object) -> object:
        answer = await call(self, method, **kwargs)
        if method == "list_objects_v2":
            answer.pop("NextContinuationToken", None)
        return answer

    monkeypatch.setattr(backend_module.S3Client, "call", without_token)
    monkeypatch.setattr(backend_module, "_LIST_PAGE", 2)
    with caplog.at_level(logging.WARNING):
        reopened = open_adapter(config, l1)
        opened.append(reopened)
        wait_scanned(reopened)
    assert reopened.stats()["scan_keys"] < 5, "the listing went past the truncated page"
    assert any("without a continuation token" in record.getMessage() for record in caplog.records)
    assert isinstance(reopened, BackendAdapter)
    assert not reopened.state.accounting.complete, "a partial listing taken for the whole bucket"


def test_a_key_with_a_digest_name_round_trips_and_is_listed(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    prefix = fresh_prefix("digest")
    long_model = "模型" * 100  # 600 bytes of UTF-8: too long for a readable object name
    keys = [ObjectKey(long_model, 0, b"\x01" * 32), ObjectKey(long_model, 1, b"\x02" * 32, 0, "tenant")]
    config = s3_config(seaweed, prefix)
    first = open_adapter(config, l1)
    data = store(first, l1, keys)
    assert all(Raw(seaweed, prefix).names.is_digest(Raw(seaweed, prefix).names.of(key)) for key in keys)
    first.close()
    reopened = open_adapter(config, l1)
    opened.append(reopened)
    wait_scanned(reopened)
    assert set(reopened.iter_keys()) == set(keys), "the listing read each digest name's key from its header"
    assert load(reopened, l1, keys) == data


def test_a_digest_named_record_of_a_newer_format_is_kept_by_the_listing_as_such(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    """Only its header tells a digest-named record's key; a newer server sharing the bucket
    writes a header this one cannot read.  The listing leaves it out and keeps it, counted
    as a record of a newer format (as the fs listing counts it), not as a foreign object."""
    prefix = fresh_prefix("digest-newer")
    key = ObjectKey("模型" * 100, 0, b"\x03" * 32)  # too long a model for a readable name
    raw = Raw(seaweed, prefix)
    assert raw.names.is_digest(raw.names.of(key))
    payload = pattern(5, SIZE)
    header = bytearray(encode_header(key, payload, align=4096))
    header[4:6] = (99).to_bytes(2, "little")  # a format a newer server might write
    header[-4:] = zlib.crc32(bytes(header[:-4])).to_bytes(4, "little")  # intact: its crc taken again
    raw.write(key, bytes(header) + payload)
    adapter = open_adapter(s3_config(seaweed, prefix), l1)
    opened.append(adapter)
    wait_scanned(adapter)
    stats = adapter.stats()  # (before iter_keys: each listing counts what it leaves out)
    assert stats["record_version_unknown"] == 1
    assert stats.get("listing_foreign_objects", 0) == 0
    assert stats.get("corrupt_records_removed", 0) == 0
    assert adapter.used_bytes() == 0 and list(adapter.iter_keys()) == []
    assert raw.exists(key), "a newer server's acknowledged write was removed"


def _digest_record(raw: Raw, seed: int) -> tuple[ObjectKey, bytes]:
    """A key whose object gets a digest name (too long a model for a readable one), and a
    record of it."""
    key = ObjectKey("模型" * 100, 0, bytes([seed]) * 32)
    assert raw.names.is_digest(raw.names.of(key))
    payload = pattern(seed, SIZE)
    return key, encode_header(key, payload, align=4096) + payload


def _stats_once_scanned(seaweed: SeaweedS3, prefix: str, l1: memoryview, opened: list[L2Adapter]) -> dict:
    """The stats of an adapter opened on ``prefix`` once its start-up listing is done."""
    adapter = open_adapter(s3_config(seaweed, prefix), l1)
    opened.append(adapter)
    wait_scanned(adapter)
    return adapter.stats()


def test_the_listing_removes_a_damaged_digest_named_record_as_damage(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    """Only its header tells a digest-named record's key, so no lookup can ever reach one
    whose header is damaged: the listing removes it and counts it as damage, as the file
    stores' listings do -- not as an object of another writer, kept for good."""
    prefix = fresh_prefix("digest-damaged")
    raw = Raw(seaweed, prefix)
    key, record = _digest_record(raw, 6)
    damaged = bytearray(record)
    damaged[100] ^= 0xFF  # a bit flip inside the header: its crc fails
    raw.write(key, bytes(damaged))
    stats = _stats_once_scanned(seaweed, prefix, l1, opened)
    assert stats.get("corrupt_records_removed", 0) == 1
    assert stats.get("listing_foreign_objects", 0) == 0
    assert not raw.exists(key), "a damaged record no lookup can reach was left in the bucket"


def test_a_listing_reading_damage_a_second_read_does_not_find_keeps_the_record(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    """The listing reads a digest-named record's header to learn its key: a byte flipped on
    the way (a faulty link or middlebox) is no damage of the object, an acknowledged write
    a second read of it finds intact."""
    prefix = fresh_prefix("digest-flipped")
    raw = Raw(seaweed, prefix)
    key, record = _digest_record(raw, 8)
    raw.write(key, record)
    with FlippingRelay(seaweed.endpoint) as relay:
        relay.flip_once(after=100, marker=RECORD_MAGIC)  # inside the header
        adapter = open_adapter(s3_config(seaweed, prefix, endpoint_url=relay.endpoint), l1)
        opened.append(adapter)
        wait_scanned(adapter)
        assert relay.flipped == 1, "no byte was flipped: the test tested nothing"
    stats = adapter.stats()
    assert stats["damage_not_repeated"] == 1 and stats.get("corrupt_records_removed", 0) == 0
    assert list(adapter.iter_keys()) == [key], "the record was not listed"
    assert raw.exists(key) and raw.read(key) == record, "an intact object was removed"


def test_a_failed_header_read_of_the_listing_is_a_read_error_and_keeps_the_object(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A digest-named record whose header the listing cannot read (the request failed)
    says nothing about the object: it is not listed, kept, and counted as a read error
    (``listing_read_errors``, as the file stores count one), not as a foreign object."""
    prefix = fresh_prefix("digest-unread")
    raw = Raw(seaweed, prefix)
    key, record = _digest_record(raw, 7)
    raw.write(key, record)
    name = raw.names.of(key)
    request = backend_module.S3Client.request

    async def failing_header_read(self: backend_module.S3Client, method: str, **kwargs: object) -> object:
        if method == "get_object" and kwargs.get("Key") == name and "Range" in kwargs:
            raise ConnectionResetError("injected: the connection dropped during the header read")
        return await request(self, method, **kwargs)

    monkeypatch.setattr(backend_module.S3Client, "request", failing_header_read)
    stats = _stats_once_scanned(seaweed, prefix, l1, opened)
    assert stats.get("listing_read_errors", 0) == 1
    assert stats.get("listing_foreign_objects", 0) == 0
    assert stats.get("corrupt_records_removed", 0) == 0
    assert raw.exists(key), "an object whose header could not be read was removed"


def test_two_adapters_on_one_prefix_see_each_others_stores_and_deletes(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    config = s3_config(seaweed, fresh_prefix("shared"))
    one, two = open_adapter(config, l1, 0), open_adapter(config, l1, 1)
    opened += [one, two]
    keys = make_keys(4)
    data = store(one, l1, keys)
    assert load(two, l1, keys) == data, "stored through one, a hit through the other"
    assert two.used_bytes() == 4 * SIZE, "the hits were accounted"
    assert one.delete(keys[:2]) == [True, True]
    assert load(two, l1, keys) == [None, None, *data[2:]], "deleted through one, a miss through the other"
    assert two.used_bytes() == 2 * SIZE, "the misses released the bytes"
    assert two.delete(keys) == [False, False, True, True]


def test_a_missing_bucket_stops_start_up_with_one_line(seaweed: SeaweedS3, l1: memoryview) -> None:
    config = s3_config(seaweed, "p", bucket="no-such-bucket-here")
    with pytest.raises(
        ConfigError, match=r"bucket 'no-such-bucket-here' does not exist at http://127\.0\.0\.1:"
    ):
        open_adapter(config, l1)


def test_rejected_credentials_stop_start_up(seaweed: SeaweedS3, l1: memoryview) -> None:
    config = s3_config(seaweed, "p", aws_secret_access_key="wrong-secret")
    with pytest.raises(ConfigError, match="refused the credentials") as raised:
        open_adapter(config, l1)
    assert "wrong-secret" not in str(raised.value)


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("profile", r"ProfileNotFound: The config profile \(no-such-profile\) could not be found"),
        ("unparsable", r"ConfigParseError: Unable to parse config file"),
        ("half_a_key_pair", r"PartialCredentialsError: .*missing: AWS_SECRET_ACCESS_KEY"),
        ("no_credentials", r"NoCredentialsError: Unable to locate credentials"),
        ("region", r"InvalidRegionError: Provided region_name 'eu west 1' doesn't match"),
    ],
)
def test_aws_settings_no_request_can_use_stop_start_up(
    seaweed: SeaweedS3,
    l1: memoryview,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    mistake: str,
    message: str,
) -> None:
    # The store answers; every request would still fail until a restart, so these are
    # configuration mistakes like a missing bucket, not a store that may come back.
    for variable in AWS_CREDENTIAL_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance role asked off this machine
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    fields: dict[str, object] = {"aws_access_key_id": None, "aws_secret_access_key": None}
    if mistake == "profile":
        fields["profile"] = "no-such-profile"
    elif mistake == "unparsable":
        (tmp_path / "config").write_text("[default\nregion = us-east-1\n")
    elif mistake == "half_a_key_pair":
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    elif mistake == "region":  # no client can be made for it: every request would fail
        monkeypatch.setenv("AWS_DEFAULT_REGION", "eu west 1")
        fields = {}
    config = s3_config(seaweed, "p", **fields)
    with pytest.raises(ConfigError, match=f"the AWS settings cannot be used: {message}"):
        open_adapter(config, l1)


def test_credentials_come_from_the_environment_and_are_never_logged(
    seaweed: SeaweedS3,
    l1: memoryview,
    opened: list[L2Adapter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    for name, value in seaweed.env.items():
        monkeypatch.setenv(name, value)
    config = s3_config(seaweed, fresh_prefix("env"), aws_access_key_id=None, aws_secret_access_key=None)
    with caplog.at_level(logging.DEBUG):
        adapter = open_adapter(config, l1)
        opened.append(adapter)
        keys = make_keys(2)
        assert load(adapter, l1, keys) == [None, None]
        data = store(adapter, l1, keys)
        assert load(adapter, l1, keys) == data
    text = "\n".join(record.getMessage() for record in caplog.records)
    assert text.count("credentials from env") == 1, "said once, by the adapter (not its start-up check)"
    assert seaweed.secret_key not in text and seaweed.secret_key not in repr(config)


def test_an_endpoint_that_refuses_connections_fails_calls_at_once(
    l1: memoryview, opened: list[L2Adapter], caplog: pytest.LogCaptureFixture
) -> None:
    config = S3Config(
        bucket=BUCKET,
        endpoint_url=f"http://127.0.0.1:{free_port()}",  # nothing listens there
        aws_access_key_id="k",
        aws_secret_access_key="s",
        connect_timeout_s=1.0,
        request_timeout_s=5.0,
        retries=1,
    )
    with caplog.at_level(logging.WARNING, logger="lmcache_plugin_s3"):
        adapter = open_adapter(config, l1)  # not a configuration error: the store may come back
        opened.append(adapter)
    assert any("did not answer at start-up" in record.getMessage() for record in caplog.records)
    keys = make_keys(3)
    started = time.monotonic()
    client = blocking(adapter, timeout=30)  # far above request_timeout_s: guards against a hang
    assert client.lookup_and_lock(keys).found == [False] * 3
    assert client.store(keys, [l1[:SIZE]] * 3) == [False] * 3
    assert adapter.delete(keys) == [False] * 3
    assert time.monotonic() - started < 30
    assert adapter.stats()["backend_errors"] >= 3


@contextlib.contextmanager
def silent_store(**timeouts: float) -> Iterator[S3Config]:
    """The config of a store that accepts connections and never answers; ``timeouts``
    are the config's (``read_timeout_s``, ``request_timeout_s``)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        yield S3Config(
            bucket=BUCKET,
            endpoint_url=f"http://127.0.0.1:{silent.getsockname()[1]}",
            aws_access_key_id="k",
            aws_secret_access_key="s",
            connect_timeout_s=1.0,
            retries=0,
            **timeouts,
        )


@pytest.fixture
def brief_start_up_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up check waits up to 5 s for a silent store's answer before the adapter
    opens anyway; tests of what follows the open need not sit that out."""
    monkeypatch.setattr(client_module, "_PROBE_READ_S", 0.2)


class SilentPeer:
    """A store on loopback that accepts connections, reads what each request starts with,
    and never answers: which requests reached it is seen by their method (a lookup's
    HEAD), apart from the start-up check's (a listing GET, a TLS hello)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._methods: list[str] = []
        threading.Thread(target=self._accept, name="silent-peer", daemon=True).start()

    def config(self, **fields: object) -> S3Config:
        settings: dict[str, object] = {
            "bucket": BUCKET,
            "endpoint_url": f"http://127.0.0.1:{self._listener.getsockname()[1]}",
            "aws_access_key_id": "k",
            "aws_secret_access_key": "s",
            "connect_timeout_s": 1.0,
            "read_timeout_s": 300.0,
            "request_timeout_s": 300.0,
            "retries": 0,
            **fields,
        }
        return S3Config(**settings)  # type: ignore[arg-type]

    def requests(self, method: str) -> int:
        with self._lock:
            return self._methods.count(method)

    def connections_besides_the_start_up_checks(self) -> int:
        """Connections made, less those whose first bytes were not a HEAD (the check's
        listing, its TLS hello): one whose bytes are not read yet counts."""
        with self._lock:
            return len(self._connections) - sum(method != "HEAD" for method in self._methods)

    def wait_for_requests(self, method: str, count: int) -> None:
        deadline = time.monotonic() + DEADLINE_S
        while self.requests(method) < count:
            assert time.monotonic() < deadline, f"{count} {method} requests never reached the peer"
            time.sleep(0.01)

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            for connection in self._connections:
                connection.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, _address = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                self._connections.append(connection)
            threading.Thread(target=self._read_method, args=(connection,), daemon=True).start()

    def _read_method(self, connection: socket.socket) -> None:
        start = b""
        with contextlib.suppress(OSError):
            while b" " not in start and len(start) < 16:
                more = connection.recv(16 - len(start))
                if not more:
                    break
                start += more
        with self._lock:
            self._methods.append(start.split(b" ", 1)[0].decode("latin-1"))


@pytest.fixture
def silent_peer() -> Iterator[SilentPeer]:
    peer = SilentPeer()
    yield peer
    peer.close()


@pytest.mark.usefixtures("brief_start_up_check")
def test_close_ends_requests_stuck_on_a_silent_peer(l1: memoryview, silent_peer: SilentPeer) -> None:
    adapter = open_adapter(silent_peer.config(), l1)
    task = adapter.submit_lookup_and_lock(make_keys(2))
    silent_peer.wait_for_requests("HEAD", 2)  # both lookups wait for an answer now
    started = time.monotonic()
    adapter.close()
    assert time.monotonic() - started < 60, "close() waited for the silent peer"
    results = adapter.pop_completed_lookups()
    assert results[task].found == [False, False]


@pytest.mark.usefixtures("brief_start_up_check")
def test_close_starts_none_of_the_requests_waiting_for_a_slot(
    l1: memoryview, silent_peer: SilentPeer
) -> None:
    # one request on the wire, the others wait for its slot
    adapter = open_adapter(silent_peer.config(max_inflight=1), l1)
    try:
        task = adapter.submit_lookup_and_lock(make_keys(3))
        silent_peer.wait_for_requests("HEAD", 1)  # the first request is waiting for an answer
    finally:
        adapter.close()
    assert adapter.pop_completed_lookups()[task].found == [False] * 3
    assert silent_peer.connections_besides_the_start_up_checks() == 1, (
        "a request that waited for a slot went out after close"
    )


def test_the_listing_removes_a_digest_named_record_whose_header_names_another_name(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    """A digest-named object whose intact header names a key whose object has another
    name: no writer puts a record there and no lookup of its key reaches it, so the
    listing removes it as damage, as the file stores' listings do -- never lists it, never
    leaves it in the bucket for good as a foreign object."""
    prefix = fresh_prefix("digest-misnamed")
    raw = Raw(seaweed, prefix)
    key, _record = _digest_record(raw, 8)
    _other, other_record = _digest_record(raw, 9)
    raw.write(key, other_record)  # another key's record under the name of ``key``
    stats = _stats_once_scanned(seaweed, prefix, l1, opened)
    assert stats.get("corrupt_records_removed", 0) == 1
    assert stats.get("listing_foreign_objects", 0) == 0
    assert not raw.exists(key), "a misnamed record no lookup can reach was left in the bucket"


def test_a_listing_interrupted_by_the_close_counts_no_header_read_errors(
    seaweed: SeaweedS3, l1: memoryview, opened: list[L2Adapter]
) -> None:
    """The close interrupts a listing part-way through a page: the header reads of the
    page's digest-named records it refuses are the close, not read errors of the bucket
    (no ``listing_read_errors`` counted nor logged per record); the listing fails as a
    whole, so nothing is taken for the complete prefix."""
    prefix = fresh_prefix("digest-interrupted")
    raw = Raw(seaweed, prefix)
    for seed in (11, 12, 13):
        key, record = _digest_record(raw, seed)
        raw.write(key, record)
    adapter = open_adapter(s3_config(seaweed, prefix), l1)
    opened.append(adapter)
    wait_scanned(adapter)
    backend = adapter.backend.inner  # type: ignore[attr-defined]  # behind core's circuit breaker
    call = backend.client.call

    async def closing_after_the_page(method: str, **kwargs: object) -> object:
        answer = await call(method, **kwargs)
        if method == "list_objects_v2":
            backend.interrupt()  # what the close does first
        return answer

    backend.client.call = closing_after_the_page
    with pytest.raises(backend_module.S3RequestError, match="closing"):
        list(adapter.runner.listing(100))  # type: ignore[attr-defined]
    assert adapter.stats().get("listing_read_errors", 0) == 0


def test_the_start_up_probe_runs_on_a_thread_named_for_the_adapter() -> None:
    """The bucket check waits on a thread of its own; a thread dump taken while a silent
    store holds start-up must show whose it is, under the ``l2-<adapter>-`` prefix every
    other thread of an adapter has."""
    from lmcache_plugin_s3.client import check_bucket

    with silent_store(read_timeout_s=1.0) as config:
        before = set(threading.enumerate())
        answers: list[bool] = []
        checking = threading.Thread(
            target=lambda: answers.append(check_bucket(config, "0:s3")), name="test-check", daemon=True
        )
        checking.start()
        names: set[str] = set()
        deadline = time.monotonic() + DEADLINE_S  # the check's own 1 s read timeout ends it well before
        while checking.is_alive():
            assert time.monotonic() < deadline, "the bucket check of a silent store never ended"
            names.update(thread.name for thread in threading.enumerate() if thread not in before)
            time.sleep(0.01)
        joined(checking, "the bucket check of a silent store")
    assert answers == [False], "the silent store answered"
    probes = sorted(name for name in names if "probe" in name)
    assert probes and all(name.startswith("l2-0:s3-probe") for name in probes), probes


def test_an_https_endpoint_that_does_not_speak_tls_stops_start_up(seaweed: SeaweedS3, l1: memoryview) -> None:
    # Every request would fail its TLS handshake until the configuration changes: started,
    # its L2 would stay dead, the line saying only that the store "did not answer".
    endpoint = seaweed.endpoint.replace("http://", "https://")
    config = s3_config(seaweed, "p", endpoint_url=endpoint)
    with pytest.raises(ConfigError) as raised:
        open_adapter(config, l1)
    text = str(raised.value)
    assert text.startswith(f"0:s3: {endpoint} failed the TLS handshake (SSLError: ")
    assert "endpoint_url" in text
