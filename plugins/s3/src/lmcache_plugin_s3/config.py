"""Configuration of the ``s3`` adapter type.

The fields are this adapter's own (``bucket``, ``prefix``, ``endpoint_url``, ``region``),
and LMCache's S3 adapter fields are accepted where they mean the same: ``s3_endpoint``
(the virtual-hosted ``s3://<bucket>.<host>`` form, which names both the bucket and the
host), ``s3_region``, ``disable_tls``, ``aws_access_key_id`` / ``aws_secret_access_key``
and ``max_capacity_gb``.  An alias is folded into the canonical field in
``__post_init__``, so the backend reads only the canonical ones; giving both with
different values is an error naming the alias.

This module is imported whenever plugins are listed, so it imports msgspec and the plugin
API only.
"""

from __future__ import annotations

import re
from typing import Annotated, ClassVar, Literal

import msgspec

from lmcache_tiers.plugin import FieldError, L2AdapterConfig, SizeGiB, check_size_gib

#: the secret-bearing fields: never logged, printed or shown by ``repr``
SECRET_FIELDS = ("aws_access_key_id", "aws_secret_access_key")
#: longest prefix accepted; object names add at most 256 bytes (S3 keys end at 1024)
MAX_PREFIX_BYTES = 512
#: what botocore accepts as a region name (a host label, empty included, not all digits);
#: it refuses any other when a client is made, so every request would fail until a restart
_REGION_NAME = re.compile(r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{0,63}(?<!-)")


def _alias(canonical: str, lmcache_doc: str) -> str:
    return f"Alias of `{canonical}` (LMCache's S3 adapter field): {lmcache_doc}"


class S3Config(L2AdapterConfig):
    """One object per chunk in an S3 bucket (AWS S3 or any S3-compatible store), via s3fs.

    Objects are named `<prefix>/<key name>` with the shared key codec, so servers that
    share a bucket and prefix share their chunks: a lookup asks the bucket, never a
    private index.  Each object is a record -- a 4 KiB header holding the full key, the
    payload length, the serde chain and an XXH3-128 checksum, then the payload -- written
    with one PUT (atomic: a reader sees the old object or the new one, never half).  A
    load checks the length in the header against the caller's buffer before copying and
    verifies the checksum; a damaged object is a miss, deleted and counted.

    Credentials come from the standard AWS chain (environment, shared credentials and
    config files, `profile`, container and instance roles) unless static keys are given;
    they are never logged nor printed.  Every request is bounded by `request_timeout_s`
    (retries included), so an unreachable store makes calls fail, never hang.
    """

    #: LMCache's S3 adapter fields without an equivalent here -> why (config errors say it)
    lmcache_unsupported: ClassVar[dict[str, str]] = {
        "s3_num_io_threads": "requests go through s3fs, not the AWS CRT; max_inflight bounds them",
        "s3_prefer_http2": "requests go through s3fs over HTTP/1.1; there is no HTTP/2 to prefer",
        "s3_enable_s3express": "S3 Express One Zone signing is not available",
    }

    bucket: Annotated[
        str | None,
        msgspec.Meta(description="Bucket holding the objects (required, here or through `s3_endpoint`)."),
    ] = None
    prefix: Annotated[
        str,
        msgspec.Meta(
            description=(
                "Folder inside the bucket; objects are `<prefix>/<name>` (slashes at its ends "
                "are ignored; empty = the top level). Servers sharing a cache use the same one."
            )
        ),
    ] = ""
    endpoint_url: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "URL of an S3-compatible service, e.g. `http://127.0.0.1:8333`; null = AWS S3 for `region`."
            )
        ),
    ] = None
    region: Annotated[
        str | None,
        msgspec.Meta(
            description=(
                "Region requests are signed for; null = the AWS chain's "
                "(AWS_DEFAULT_REGION, the config file)."
            )
        ),
    ] = None
    profile: Annotated[
        str | None,
        msgspec.Meta(
            description="Profile of the shared AWS credentials/config files to use; null = default."
        ),
    ] = None
    addressing_style: Annotated[
        Literal["auto", "path", "virtual"],
        msgspec.Meta(
            description="How the bucket is addressed: in the path, in the host name, or botocore's choice."
        ),
    ] = "auto"
    max_capacity_gb: Annotated[
        SizeGiB,
        msgspec.Meta(
            ge=0.0,
            description=(
                "Bytes this server may fill in the bucket, in GiB, for usage and eviction; "
                "0 = no limit (usage -1.0, no eviction)."
            ),
        ),
    ] = 0.0
    max_inflight: Annotated[
        int,
        msgspec.Meta(ge=1, le=4096, description="S3 requests in flight at once (and pooled connections)."),
    ] = 32
    connect_timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0.0, le=600.0, description="Seconds to wait for a TCP connection to the endpoint."),
    ] = 3.0
    read_timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0.0, le=3600.0, description="Seconds a response may stall before the request fails."),
    ] = 10.0
    request_timeout_s: Annotated[
        float,
        msgspec.Meta(
            gt=0.0,
            le=3600.0,
            description="Upper bound on one object request, retries included; past it the key fails.",
        ),
    ] = 30.0
    retries: Annotated[
        int,
        msgspec.Meta(
            ge=0,
            le=20,
            description="Retries of a request that failed transiently (timeouts, 5xx, throttling).",
        ),
    ] = 2
    disable_tls: Annotated[
        bool,
        msgspec.Meta(
            description="Plain HTTP to the endpoint derived from `s3_endpoint` or `region` (LMCache's field)."
        ),
    ] = False
    aws_access_key_id: Annotated[
        str | None,
        msgspec.Meta(
            description="Static access key id (LMCache's field); null = the AWS credential chain. Secret."
        ),
    ] = None
    aws_secret_access_key: Annotated[
        str | None,
        msgspec.Meta(
            description="Static secret access key (LMCache's field), with `aws_access_key_id`. Secret."
        ),
    ] = None
    s3_endpoint: Annotated[
        str | None,
        msgspec.Meta(
            description=_alias(
                "bucket` + `endpoint_url",
                "the virtual-hosted `s3://<bucket>.<host>` or `<bucket>.<host>`; HTTPS unless `disable_tls`.",
            )
        ),
    ] = None
    s3_region: Annotated[str | None, msgspec.Meta(description=_alias("region", "the signing region."))] = None

    def __post_init__(self) -> None:
        self._refuse_passwords_in_endpoints()
        self._fold_aliases()
        check_size_gib("max_capacity_gb", self.max_capacity_gb)
        self._check_location()
        self._check_credentials()
        if self.eviction is not None and self.max_capacity_gb == 0:
            raise FieldError(
                "eviction",
                "eviction needs max_capacity_gb > 0: with no capacity the usage is unknown "
                "and nothing would ever be evicted",
            )

    def __repr__(self) -> str:
        shown = (
            f"{name}={'***' if name in SECRET_FIELDS and value is not None else value!r}"
            for name, value in msgspec.structs.asdict(self).items()
        )
        return f"S3Config({', '.join(shown)})"

    # -- checks ------------------------------------------------------------------------------

    def _refuse_passwords_in_endpoints(self) -> None:
        """Requests are signed with the access keys; a user or password in an endpoint
        would only be logged (the start-up line and errors name the endpoint, and other
        checks repeat a wrong one), so it is refused first and not echoed.  Any ``@``
        counts: with or without a scheme, and before or after a ``/`` in the password."""
        for field in ("endpoint_url", "s3_endpoint"):
            if "@" in (getattr(self, field) or ""):
                raise FieldError(
                    field,
                    f"{field} must not hold a user or password; give aws_access_key_id and "
                    "aws_secret_access_key (or the AWS credential chain) instead",
                )

    def _fold_aliases(self) -> None:
        for field in ("region", "s3_region"):
            value = getattr(self, field)
            if value is not None and not _REGION_NAME.fullmatch(value):
                raise FieldError(field, f"region {value!r} is not a region name (like eu-west-1)")
        if self.s3_region is not None:
            if self.region is not None and self.region != self.s3_region:
                raise FieldError(
                    "s3_region", f"s3_region {self.s3_region!r} contradicts region {self.region!r}"
                )
            msgspec.structs.force_setattr(self, "region", self.s3_region)
        if self.s3_endpoint is None:
            return
        bucket, host = split_virtual_hosted(self.s3_endpoint)
        url = f"{'http' if self.disable_tls else 'https'}://{host}"
        for name, mine, theirs in (("bucket", self.bucket, bucket), ("endpoint_url", self.endpoint_url, url)):
            if mine is not None and mine != theirs:
                raise FieldError(
                    "s3_endpoint", f"s3_endpoint names {name} {theirs!r}, but {name} is {mine!r}"
                )
        msgspec.structs.force_setattr(self, "bucket", bucket)
        msgspec.structs.force_setattr(self, "endpoint_url", url)

    def _check_location(self) -> None:
        if not self.bucket:
            raise FieldError("bucket", "bucket is required (or s3_endpoint, LMCache's form)")
        if "/" in self.bucket or len(self.bucket) > 255 or not self.bucket.isprintable():
            raise FieldError("bucket", f"bucket {self.bucket!r} is not a bucket name")
        prefix = self.prefix.strip("/")
        if len(prefix.encode()) > MAX_PREFIX_BYTES or not prefix.isprintable() or "//" in prefix:
            raise FieldError(
                "prefix",
                f"prefix must be printable, without empty segments, at most {MAX_PREFIX_BYTES} bytes",
            )
        if any(part in (".", "..") for part in prefix.split("/")):
            raise FieldError("prefix", "prefix must not contain '.' or '..' segments")
        msgspec.structs.force_setattr(self, "prefix", prefix)
        url = self.endpoint_url
        if url is not None:
            if not url.startswith(("http://", "https://")) or len(url) <= len("https://"):
                raise FieldError(
                    "endpoint_url", f"endpoint_url must be an http:// or https:// URL, got {url!r}"
                )
            if self.disable_tls and url.startswith("https://"):
                raise FieldError("disable_tls", "disable_tls contradicts an https:// endpoint_url")

    def _check_credentials(self) -> None:
        if (self.aws_access_key_id is None) != (self.aws_secret_access_key is None):
            raise FieldError(
                "aws_secret_access_key" if self.aws_secret_access_key is None else "aws_access_key_id",
                "aws_access_key_id and aws_secret_access_key go together",
            )
        if self.aws_access_key_id is not None and self.profile is not None:
            raise FieldError("profile", "give either a profile or static keys, not both")

    @property
    def use_tls(self) -> bool:
        return self.endpoint_url.startswith("https://") if self.endpoint_url else not self.disable_tls


def split_virtual_hosted(endpoint: str) -> tuple[str, str]:
    """``(bucket, host)`` of LMCache's ``s3://<bucket>.<host>`` / ``<bucket>.<host>``."""
    rest = endpoint[len("s3://") :] if endpoint.startswith("s3://") else endpoint
    bucket, dot, host = rest.partition(".")
    if not dot or not bucket or not host or "/" in rest or "://" in rest:
        raise FieldError(
            "s3_endpoint",
            f"s3_endpoint must be 's3://<bucket>.<host>' or '<bucket>.<host>', got {endpoint!r}; "
            "for a URL use bucket and endpoint_url",
        )
    return bucket, host
