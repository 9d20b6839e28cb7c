"""Helpers of the s3 plugin's tests: configs for the test server, adapters, raw access."""

from __future__ import annotations

import subprocess
import time
import uuid
from typing import Any

import s3fs
from lmcache_plugin_s3 import S3Config
from lmcache_plugin_s3.records import ObjectNames

from lmcache_tiers.keys import ObjectKey
from lmcache_tiers.l2 import AdapterContext, L2Adapter, create_adapter
from lmcache_tiers.plugins import load_registry
from lmcache_tiers.registry import Kind
from lmcache_tiers.testing.blocking import BlockingAdapterClient
from lmcache_tiers.testing.seaweedfs import SeaweedS3

#: the bucket the tests share; each test works under a prefix of its own
BUCKET = "tiers-s3-tests"
#: the environment variables that would give the AWS credential chain credentials of their
#: own (keys, a profile, a web identity, a container's role): a test of the chain removes them
AWS_CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
)


def fresh_prefix(tag: str) -> str:
    return f"{tag}/{uuid.uuid4().hex}"


def s3_config(server: SeaweedS3, prefix: str, **fields: Any) -> S3Config:
    """A config for ``server`` with its static keys (tests leave the environment alone)."""
    settings: dict[str, Any] = {
        "bucket": BUCKET,
        "prefix": prefix,
        "endpoint_url": server.endpoint,
        "aws_access_key_id": server.access_key,
        "aws_secret_access_key": server.secret_key,
        **fields,
    }
    return S3Config(**settings)


def open_adapter(config: S3Config, l1: memoryview, index: int = 0) -> L2Adapter:
    """An ``s3`` adapter built the way the StorageManager builds one."""
    registry = load_registry()
    factory = registry.get(Kind.L2_ADAPTER, "s3").load()
    context = AdapterContext(index=index, name=f"{index}:s3", config=config, l1_buffer=l1)
    return create_adapter(factory, config, context, registry=registry, type_name="s3")


def blocking(adapter: L2Adapter, timeout: float = 60.0) -> BlockingAdapterClient:
    return BlockingAdapterClient(adapter, timeout=timeout)


_RAW_CLIENTS: dict[str, s3fs.S3FileSystem] = {}


class Raw:
    """Direct access to the test bucket, past the adapter: what another writer could do."""

    def __init__(self, server: SeaweedS3, prefix: str) -> None:
        # One client per server for the whole session: each one made and dropped would
        # be torn down by the garbage collector on a loop of its own, noisily.
        self.fs = _RAW_CLIENTS.get(server.endpoint)
        if self.fs is None:
            self.fs = _RAW_CLIENTS[server.endpoint] = s3fs.S3FileSystem(
                key=server.access_key,
                secret=server.secret_key,
                endpoint_url=server.endpoint,
                skip_instance_cache=True,
            )
        self.names = ObjectNames(prefix)

    def path(self, key_or_name: ObjectKey | str) -> str:
        name = key_or_name if isinstance(key_or_name, str) else self.names.of(key_or_name)
        return f"{BUCKET}/{name}"

    def read(self, key: ObjectKey | str) -> bytes:
        return bytes(self.fs.cat_file(self.path(key)))

    def write(self, key: ObjectKey | str, data: bytes, metadata: dict[str, str] | None = None) -> None:
        """One PUT of ``data``: with no ``metadata``, the way a writer that knows nothing
        of header copies (or an older lmcache-tiers) stores an object."""
        self.fs.pipe_file(self.path(key), data, **({"Metadata": metadata} if metadata is not None else {}))

    def metadata(self, key: ObjectKey | str) -> dict[str, str]:
        return dict(self.fs.metadata(self.path(key), refresh=True))

    def exists(self, key: ObjectKey | str) -> bool:
        self.fs.invalidate_cache()
        return bool(self.fs.exists(self.path(key)))


def scoped_identity(server: SeaweedS3, access_key: str, secret_key: str, folder: str) -> None:
    """Give ``server`` an identity allowed to read and write objects under ``folder/`` of
    the test bucket and nothing else -- no HeadBucket, no listing: least privilege for a
    server that owns one prefix.  Returns once the S3 gateway accepts the identity."""
    actions = f"Read:{BUCKET}/{folder}/*,Write:{BUCKET}/{folder}/*"
    weed_shell(
        server,
        f"s3.configure -user={access_key} -access_key={access_key} -secret_key={secret_key} "
        f"-actions={actions} -apply",
    )
    fs = s3fs.S3FileSystem(
        key=access_key, secret=secret_key, endpoint_url=server.endpoint, skip_instance_cache=True
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            fs.pipe_file(f"{BUCKET}/{folder}/identity-ready", b"")
            return
        except PermissionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def remove_identity(server: SeaweedS3, access_key: str) -> None:
    """Delete an identity ``scoped_identity`` made: its requests are then rejected
    (InvalidAccessKeyId), as credentials revoked mid-run are.  Returns once they are."""
    weed_shell(server, f"s3.configure -user={access_key} -delete -apply")


def weed_shell(server: SeaweedS3, command: str) -> None:
    ports = server.ports
    subprocess.run(
        [
            server.binary,
            "shell",
            f"-master=127.0.0.1:{ports['master.port']}.{ports['master.port.grpc']}",
            f"-filer=127.0.0.1:{ports['filer.port']}.{ports['filer.port.grpc']}",
        ],
        input=f"{command}\nexit\n",
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
