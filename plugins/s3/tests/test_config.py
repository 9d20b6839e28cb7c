"""The ``s3`` config: LMCache's field names, contradictions refused, secrets never shown."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest
from lmcache_plugin_s3 import S3Config

from lmcache_tiers.config import decode_adapter
from lmcache_tiers.errors import ConfigError
from lmcache_tiers.plugins import load_registry

CLI = [sys.executable, "-m", "lmcache_tiers.cli.main"]
SECRET = "wJalrXUtnFEMI-very-secret"


def decode(**fields: object) -> S3Config:
    adapter = decode_adapter(load_registry(), {"type": "s3", **fields}, 0).config
    assert isinstance(adapter, S3Config)
    return adapter


def test_lmcache_field_names_fill_the_canonical_ones() -> None:
    config = decode(s3_endpoint="s3://kv-cache.s3.eu-west-1.amazonaws.com", s3_region="eu-west-1")
    assert (config.bucket, config.endpoint_url, config.region) == (
        "kv-cache",
        "https://s3.eu-west-1.amazonaws.com",
        "eu-west-1",
    )
    plain = decode(s3_endpoint="cache.127.0.0.1:8333", disable_tls=True)
    assert (plain.bucket, plain.endpoint_url, plain.use_tls) == ("cache", "http://127.0.0.1:8333", False)


def test_an_alias_that_agrees_with_its_field_is_accepted_and_one_that_does_not_is_refused() -> None:
    assert decode(bucket="b", s3_endpoint="b.example.com", endpoint_url="https://example.com").bucket == "b"
    with pytest.raises(
        ConfigError,
        match=r"s3_endpoint names bucket 'b', but bucket is 'c' - at `\$\.l2_adapters\[0\]\.s3_endpoint`",
    ):
        decode(bucket="c", s3_endpoint="b.example.com")
    with pytest.raises(ConfigError, match="s3_region 'us-west-2' contradicts region 'eu-west-1'"):
        decode(bucket="b", region="eu-west-1", s3_region="us-west-2")
    with pytest.raises(ConfigError, match="s3_endpoint must be 's3://<bucket>"):
        decode(s3_endpoint="https://example.com/bucket")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "bucket is required"),
        ({"bucket": "a/b"}, "is not a bucket name"),
        ({"bucket": "b", "prefix": "a//b"}, "without empty segments"),
        ({"bucket": "b", "prefix": "a/../b"}, "'.' or '..' segments"),
        ({"bucket": "b", "endpoint_url": "127.0.0.1:8333"}, "must be an http:// or https:// URL"),
        ({"bucket": "b", "endpoint_url": "https://x", "disable_tls": True}, "disable_tls contradicts"),
        ({"bucket": "b", "aws_access_key_id": "k"}, "go together"),
        (
            {"bucket": "b", "aws_access_key_id": "k", "aws_secret_access_key": "s", "profile": "p"},
            "either a profile",
        ),
        ({"bucket": "b", "eviction": {"eviction_policy": "LRU"}}, "eviction needs max_capacity_gb > 0"),
        ({"bucket": "b", "max_inflight": 0}, "Expected `int` >= 1"),
        (
            {"bucket": "b", "region": "eu west 1"},
            r"region 'eu west 1' is not a region name \(like eu-west-1\) - at `\$\.l2_adapters\[0\]\.region`",
        ),
        (
            {"bucket": "b", "s3_region": "us-east-1 "},
            r"region 'us-east-1 ' is not a region name .* - at `\$\.l2_adapters\[0\]\.s3_region`",
        ),
        ({"bucket": "b", "region": "12345"}, "region '12345' is not a region name"),
        ({"bucket": "b", "s3_region": "-eu-west-1"}, "region '-eu-west-1' is not a region name"),
        ({"bucket": "b", "s3_num_io_threads": 64}, "unknown field `s3_num_io_threads`"),
    ],
)
def test_mistakes_are_refused_with_their_path(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode(**fields)


def test_the_prefix_is_a_folder() -> None:
    assert decode(bucket="b", prefix="/team/cache/").prefix == "team/cache"
    assert decode(bucket="b").prefix == ""


def test_eviction_with_a_capacity_is_accepted() -> None:
    config = decode(bucket="b", max_capacity_gb=10, eviction={"eviction_policy": "LRU"})
    assert config.eviction is not None and config.max_capacity_gb == 10


def test_an_endpoint_url_with_a_password_is_refused_without_repeating_it() -> None:
    # S3 signs with the access keys; a password in the URL would only end up in logs.
    with pytest.raises(ConfigError, match="endpoint_url must not hold a user or password") as raised:
        decode(bucket="b", endpoint_url="http://tiers:hunter2@127.0.0.1:8333")
    assert "hunter2" not in str(raised.value)


@pytest.mark.parametrize(
    "region",
    ["us-east-1", "us-gov-west-1", "cn-northwest-1", "us-iso-east-1", "eu-isoe-west-1", "aws-global"],
)
def test_the_region_names_of_every_aws_partition_are_accepted(region: str) -> None:
    assert decode(bucket="b", region=region).region == region
    assert decode(bucket="b", s3_region=region).region == region


def test_an_empty_region_is_accepted_as_botocore_accepts_it() -> None:
    # S3-compatible stores are often configured with an empty region; clients are made
    # for it, so refusing it would stop a working set-up from starting.
    assert decode(bucket="b", endpoint_url="http://127.0.0.1:8333", region="").region == ""
    assert decode(bucket="b", endpoint_url="http://127.0.0.1:8333", s3_region="").region == ""


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"endpoint_url": "tiers:hunter2@127.0.0.1:8333"}, "endpoint_url"),  # no scheme
        ({"endpoint_url": "http://tiers:hun/ter2@127.0.0.1:8333"}, "endpoint_url"),  # '/' in it
        ({"s3_endpoint": "b.tiers:hunter2@127.0.0.1:8333"}, "s3_endpoint"),
        ({"s3_endpoint": "s3://b.tiers:hunter2@127.0.0.1:8333/x"}, "s3_endpoint"),
        (
            {"s3_endpoint": "b.example.com", "endpoint_url": "https://tiers:hunter2@example.com"},
            "endpoint_url",
        ),
    ],
)
def test_a_password_in_any_endpoint_field_is_refused_without_repeating_it(
    fields: dict[str, str], where: str
) -> None:
    with pytest.raises(ConfigError, match=f"must not hold a user or password.* at `.*{where}`") as raised:
        decode(bucket="b", **fields)
    assert "hunter2" not in str(raised.value) and "hun/ter2" not in str(raised.value)


def test_secrets_are_not_in_the_repr() -> None:
    config = S3Config(bucket="b", aws_access_key_id="AKIAEXAMPLE", aws_secret_access_key=SECRET)
    assert SECRET not in repr(config) and "AKIAEXAMPLE" not in repr(config)
    assert "aws_secret_access_key='***'" not in repr(S3Config(bucket="b")), "unset stays visibly unset"
    assert msgspec.structs.replace(config, prefix="p").aws_secret_access_key == SECRET


def test_print_config_and_plugins_show_never_print_the_credentials() -> None:
    adapter = {
        "type": "s3",
        "bucket": "b",
        "endpoint_url": "http://127.0.0.1:1",
        "aws_access_key_id": "AKIAEXAMPLE",
        "aws_secret_access_key": SECRET,
    }
    shown = subprocess.run(
        [*CLI, "serve", "--print-config", "--l2-adapter", json.dumps(adapter)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    printed = json.loads(shown.stdout)["l2_adapters"][0]
    assert printed["aws_secret_access_key"] == "***" and printed["aws_access_key_id"] == "***"
    assert printed["bucket"] == "b"
    assert SECRET not in shown.stdout + shown.stderr and "AKIAEXAMPLE" not in shown.stdout + shown.stderr
    listing = subprocess.run([*CLI, "plugins", "show", "s3"], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert "Alias of" in listing.stdout and "s3_endpoint" in listing.stdout, "aliases are marked"
