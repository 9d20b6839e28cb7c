"""The stores the tests of records changed behind a real server's back run on -- fs, nixl
POSIX files, redis, s3, a Mooncake pool -- with each store's raw objects reached without
the server, and what those tests do with a server: take chunks out of L1 (a restart or a
clear) and read its adapter's stats."""

from __future__ import annotations

import importlib.util
import os
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from shared_stores import STARTERS
from tiers_e2e import ServerProcess, fetch, start_server

from lmcache_tiers.client import Client
from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2.record import RecordError, decode_header

CHUNK = 64 << 10


class Objects:
    """The raw objects of one store, reached without the server."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def read(self, name: str) -> bytes:
        raise NotImplementedError

    def write(self, name: str, data: bytes) -> None:
        raise NotImplementedError

    def find(self, key: ObjectKey) -> str:
        """The name of the object holding ``key``'s intact record."""
        return self.locate([key])[0]

    def locate(self, keys: Sequence[ObjectKey]) -> list[str]:
        """The names of the objects holding ``keys``' intact records, in order: each object
        read once (a store's objects one by one per key were seconds on a remote store)."""
        wanted = set(keys)
        found: dict[ObjectKey, str] = {}
        for name in self.names():
            try:
                header = decode_header(self.read(name))
            except RecordError:
                continue
            if header.key in wanted:
                found.setdefault(header.key, name)
                if len(found) == len(wanted):
                    break
        missing = [key.file_stem() for key in keys if key not in found]
        assert not missing, f"no record of {missing} in the store"
        return [found[key] for key in keys]


class FileObjects(Objects):
    def __init__(self, root: Path) -> None:
        self.root = root

    def names(self) -> list[str]:
        return [str(path) for path in self.root.rglob("*") if path.is_file() and path.suffix == ".bin"]

    def read(self, name: str) -> bytes:
        return Path(name).read_bytes()

    def write(self, name: str, data: bytes) -> None:
        Path(name).write_bytes(data)


class RedisObjects(Objects):
    def __init__(self, url: str) -> None:
        import redis

        self.client = redis.Redis.from_url(url)

    def names(self) -> list[str]:
        return [name.decode() for name in self.client.scan_iter(count=1000)]

    def read(self, name: str) -> bytes:
        value = self.client.get(name)
        assert isinstance(value, bytes)
        return value

    def write(self, name: str, data: bytes) -> None:
        self.client.set(name, data)


class S3Objects(Objects):
    """Objects rewritten with the user metadata they had (what a writer that copies an
    object's metadata, or one that changes its bytes in place, leaves)."""

    def __init__(self, adapter: dict[str, Any], env: dict[str, str]) -> None:
        import botocore.session

        self.bucket = adapter["bucket"]
        self.client = botocore.session.get_session().create_client(
            "s3",
            endpoint_url=adapter["endpoint_url"],
            region_name="us-east-1",
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
        )

    def names(self) -> list[str]:
        listing = self.client.list_objects_v2(Bucket=self.bucket)
        return [entry["Key"] for entry in listing.get("Contents", [])]

    def read(self, name: str) -> bytes:
        body: bytes = self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read()
        return body

    def write(self, name: str, data: bytes) -> None:
        metadata = self.client.head_object(Bucket=self.bucket, Key=name)["Metadata"]
        self.client.put_object(Bucket=self.bucket, Key=name, Body=data, Metadata=metadata)


class MooncakeObjects(Objects):
    """Objects of a Mooncake pool, through a plain client of its own (an object is
    immutable there: a rewrite removes it and puts the new bytes)."""

    def __init__(self, cluster: Any) -> None:
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        from mooncake.store import MooncakeDistributedStore

        self.cluster = cluster
        self.client = MooncakeDistributedStore()
        code = self.client.setup(
            "127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "", cluster.master_server_address
        )
        assert code == 0, f"Mooncake client set-up returned {code}"

    def names(self) -> list[str]:
        return list(self.cluster.keys())

    def read(self, name: str) -> bytes:
        return bytes(self.client.get(name))

    def write(self, name: str, data: bytes) -> None:
        assert self.client.remove(name, True) == 0
        if data:  # Mooncake refuses an empty object: emptied is removed
            assert self.client.put(name, data) == 0

    def close(self) -> None:
        self.client.close()


def flip(data: bytes, at: int) -> bytes:
    """``data`` with one bit of byte ``at`` flipped."""
    out = bytearray(data)
    out[at] ^= 0x10
    return bytes(out)


def header_end(data: bytes) -> int:
    """Where a record's payload starts: its header's length, as the header says."""
    return int.from_bytes(data[8:12], "little")


# -- stores --------------------------------------------------------------------------------


def _fs(tmp_path: Path, stack: ExitStack) -> tuple[dict[str, Any], dict[str, str], Objects]:
    if importlib.util.find_spec("lmcache_plugin_fs") is None:
        pytest.skip("lmcache-plugin-fs is not installed")
    root = tmp_path / "fs-l2"
    return {"type": "fs", "path": str(root), "shard_dirs": True}, {}, FileObjects(root)


def _nixl(tmp_path: Path, stack: ExitStack) -> tuple[dict[str, Any], dict[str, str], Objects]:
    if importlib.util.find_spec("lmcache_plugin_nixl") is None:
        pytest.skip("lmcache-plugin-nixl is not installed")
    root = tmp_path / "nixl-l2"
    adapter = {
        "type": "nixl_store_dynamic",
        "backend": "POSIX",
        "backend_params": {"file_path": str(root), "use_direct_io": "false", "max_capacity_gb": "1"},
    }
    return adapter, {}, FileObjects(root)


def _redis(tmp_path: Path, stack: ExitStack) -> tuple[dict[str, Any], dict[str, str], Objects]:
    adapter, env = STARTERS["redis"](tmp_path, stack)
    return adapter, env, RedisObjects(adapter["url"])


def _s3(tmp_path: Path, stack: ExitStack) -> tuple[dict[str, Any], dict[str, str], Objects]:
    adapter, env = STARTERS["s3"](tmp_path, stack)
    return adapter, env, S3Objects(adapter, env)


def _mooncake(tmp_path: Path, stack: ExitStack) -> tuple[dict[str, Any], dict[str, str], Objects]:
    if importlib.util.find_spec("lmcache_plugin_mooncake") is None:
        pytest.skip("lmcache-plugin-mooncake is not installed")
    from lmcache_plugin_mooncake.cluster import LocalCluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = LocalCluster(tmp_path / "mooncake")
    stack.callback(cluster.stop)
    cluster.start()
    cluster.add_segment_host("256MB")
    objects = MooncakeObjects(cluster)
    stack.callback(objects.close)
    return cluster.adapter(), {"MC_TCP_BIND_ADDRESS": "127.0.0.1"}, objects


STORES = {"fs": _fs, "mooncake": _mooncake, "nixl": _nixl, "redis": _redis, "s3": _s3}
#: the stores that are a service, started once per module: a test works under a namespace
#: of its own there (the adapter field naming it, and the separator after it)
NAMESPACE = {"mooncake": ("key_prefix", "/"), "redis": ("key_prefix", ":"), "s3": ("prefix", "/")}


class NamespacedObjects(Objects):
    """The objects of one namespace of a store: only those a test's servers wrote."""

    def __init__(self, objects: Objects, namespace: str) -> None:
        self.objects, self.namespace = objects, namespace

    def names(self) -> list[str]:
        return [name for name in self.objects.names() if name.startswith(self.namespace)]

    def read(self, name: str) -> bytes:
        return self.objects.read(name)

    def write(self, name: str, data: bytes) -> None:
        self.objects.write(name, data)


@pytest.fixture(scope="module", params=sorted(STORES))
def store_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, tuple[dict[str, Any], dict[str, str], Objects] | None]]:
    """A Redis, SeaweedFS or Mooncake pool for the module's tests (starting one takes
    seconds); None for the file stores, each test's directory of its own."""
    if request.param not in NAMESPACE:
        yield request.param, None
        return
    with ExitStack() as stack:
        yield request.param, STORES[request.param](tmp_path_factory.mktemp(request.param), stack)


#: a test's store: its kind, the adapter object, the servers' environment, its objects
Store = tuple[str, dict[str, Any], dict[str, str], Objects]


@pytest.fixture
def store(
    store_service: tuple[str, tuple[dict[str, Any], dict[str, str], Objects] | None], tmp_path: Path
) -> Iterator[Store]:
    """The test's store, in which only its own records are: a file store's directory, or
    a namespace of its own in the module's service."""
    kind, service = store_service
    if service is None:
        with ExitStack() as stack:
            yield (kind, *STORES[kind](tmp_path, stack))
        return
    adapter, env, objects = service
    field, end = NAMESPACE[kind]
    namespace = f"hostile-{uuid.uuid4().hex[:8]}{end}"
    yield kind, {**adapter, field: namespace}, env, NamespacedObjects(objects, namespace)


def backend_stats(client: Client) -> dict[str, int]:
    """The first adapter's backend stats, from the server's status."""
    stats: dict[str, int] = client.status()["adapters"][0]["backend"]
    return stats


#: the two ways a test takes the chunks it stored out of L1, in this order: L1 cleared (the
#: server that stored them accounts them), then that server stopped and another started on
#: the store (it knows them from its start-up scan only)
WAYS_OUT_OF_L1 = ("l1-cleared", "restarted")


def out_of_l1_both_ways(
    server: ServerProcess, directory: Path, adapter: dict[str, Any], env: dict[str, str]
) -> Iterator[tuple[str, ServerProcess]]:
    """Each way of ``WAYS_OUT_OF_L1`` with the server to read from then: ``server``, its L1
    cleared, then (``server`` stopped) another started on ``adapter`` in ``directory``.
    A test stores and changes a set of keys for each way and reads each set its way, so
    one run of the first server serves both."""
    with Client(server.url, timeout=60) as client:
        client.clear(force=True)
    yield WAYS_OUT_OF_L1[0], server
    assert server.stop() == 0, server.output()
    yield WAYS_OUT_OF_L1[1], start_server(directory, adapters=[adapter], env=env)


def metrics_of(server: ServerProcess) -> str:
    """The server's /metrics text."""
    assert server.http_url is not None
    status, _, body = fetch(server.http_url + "/metrics")
    assert status == 200
    return body
