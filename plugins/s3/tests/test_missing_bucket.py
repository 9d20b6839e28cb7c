"""A bucket removed while the adapter runs.  A lookup's HEAD answers a missing bucket with
the same bare 404 as a missing object (its answer has no body to name either): the lookup
must fail, counted ``bucket_missing``, not read as a miss -- which core takes for objects
removed behind its back -- and the circuit opens as it does for a store that fails.  A
delete's HEAD is answered so too, and the delete fails the same way."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import lmcache_plugin_s3.client
import pytest
import s3fs
from s3_helpers import blocking, open_adapter, s3_config

from lmcache_tiers.l2 import L2Adapter
from lmcache_tiers.plugin import CircuitConfig
from lmcache_tiers.testing.l2 import make_keys
from lmcache_tiers.testing.seaweedfs import SeaweedS3


@pytest.fixture
def bucket(seaweed: SeaweedS3) -> Iterator[tuple[str, s3fs.S3FileSystem]]:
    """A bucket of the test's own, which the test removes."""
    fs = s3fs.S3FileSystem(
        key=seaweed.access_key,
        secret=seaweed.secret_key,
        endpoint_url=seaweed.endpoint,
        skip_instance_cache=True,
    )
    name = f"tiers-gone-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield name, fs
    fs.invalidate_cache()
    if fs.exists(name):
        fs.rm(name, recursive=True)


def remove_bucket(fs: s3fs.S3FileSystem, name: str) -> None:
    fs.rm(name, recursive=True)
    fs.invalidate_cache()
    deadline = time.monotonic() + 30
    while fs.exists(name):  # the gateway forgets a bucket shortly after its removal
        assert time.monotonic() < deadline, "the bucket was never removed"
        time.sleep(0.1)
        fs.invalidate_cache()


def open_on_bucket(
    seaweed: SeaweedS3, name: str, label: str, l1: memoryview, monkeypatch: pytest.MonkeyPatch
) -> L2Adapter:
    """An adapter on bucket ``name`` whose circuit opens after two failed calls, and for
    which no answer vouches for the bucket past the moment it came: a removal is seen at once."""
    monkeypatch.setattr(lmcache_plugin_s3.client, "BUCKET_TRUSTED_S", 0.0)
    config = s3_config(
        seaweed,
        label,
        bucket=name,
        circuit=CircuitConfig(failure_threshold=2, probe_interval_s=60.0),
    )
    return open_adapter(config, l1)


def test_a_lookup_in_a_bucket_removed_mid_run_fails_counted_and_opens_the_circuit(
    seaweed: SeaweedS3,
    bucket: tuple[str, s3fs.S3FileSystem],
    l1: memoryview,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name, fs = bucket
    adapter = open_on_bucket(seaweed, name, "gone", l1, monkeypatch)
    try:
        client = blocking(adapter)
        keys = make_keys(3)
        assert client.lookup_and_lock(keys).found == [False] * 3  # a plain miss: it exists
        assert "bucket_missing" not in adapter.stats()
        remove_bucket(fs, name)
        for _ in range(2):
            assert client.lookup_and_lock(keys).found == [False] * 3
        stats = adapter.stats()
        assert stats.get("bucket_missing", 0) == 6, "the lookups read a missing bucket as absent keys"
        assert stats["backend_errors"] == 2 and stats["circuit_open"] == 1
    finally:
        adapter.close()


def test_a_delete_in_a_bucket_removed_mid_run_fails_counted(
    seaweed: SeaweedS3,
    bucket: tuple[str, s3fs.S3FileSystem],
    l1: memoryview,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A delete's HEAD answers a missing bucket with the bare 404 of a missing object too:
    # read as "nothing to remove", the delete answered "not deleted" as for absent keys,
    # and the missing bucket was counted only by whatever lookup came next.
    name, fs = bucket
    adapter = open_on_bucket(seaweed, name, "gone-delete", l1, monkeypatch)
    try:
        keys = make_keys(3)
        remove_bucket(fs, name)
        for _ in range(2):
            assert adapter.delete(keys) == [False] * 3
        stats = adapter.stats()
        # A delete that failed asks no lookup after it (``delete_keys_checked``): the
        # missing bucket is the delete's own count.
        assert stats.get("delete_keys_checked", 0) == 0, "the deletes read a missing bucket as absent keys"
        assert stats.get("bucket_missing", 0) == 6
        assert stats["backend_errors"] == 2 and stats["circuit_open"] == 1
    finally:
        adapter.close()
